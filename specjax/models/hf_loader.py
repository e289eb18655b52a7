"""Read an HF checkpoint folder (`config.json` + safetensors) without torch, one tensor at a time.

The folder is what `save_pretrained` writes: `config.json`, then either `model.safetensors` or
shards listed in `model.safetensors.index.json`. `open_hf_folder` parses the config (its family:
models/families.py), maps every tensor's HF name onto ours and returns them unread
(models/tensors.py), so that `checkpoint.params_from_tensors` can check the whole checkpoint
first and then read, convert and place it tensor by tensor. Torch keeps matrices `[out, in]`;
ours are `[in, out]`, so matrices are transposed as they are read.

gpt-oss keeps each layer's experts in one tensor per weight, already `[X, in, out]`, its gate and
up columns interleaved (`mlp.experts.gate_up_proj`), or as released in MXFP4 (`*_blocks` and
`*_scales`), which is dequantized as it is read (models/mxfp4.py).

FP8 checkpoints (config.json's quantization_config quant_method "fp8": DeepSeek-V3, the Qwen3 FP8
releases) keep each quantized weight's float8_e4m3fn values with its `weight_scale_inv` block
scales (`fp8_tensors`; models/quantized.py, `from_fp8`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from specjax.models import families, mtp
from specjax.models.checkpoint import params_from_tensors
from specjax.models.config import LlamaConfig
from specjax.models.mxfp4 import mxfp4_tensor
from specjax.models.params import LlamaParams
from specjax.models.quantized import FP8_DTYPE, check_fp8_config, from_fp8
from specjax.models.tensors import LazyTensor, open_safetensors, stacked

# Buffers some old checkpoints saved; recomputed by the forward.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Files whose presence means the folder carries a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_hf_folder(folder: str | Path, dtype: Any = "float32") -> tuple[LlamaConfig, LlamaParams, Any]:
    """(config, params of `dtype`, tokenizer or None) from an HF checkpoint folder."""
    config, tensors, tokenizer = open_hf_folder(folder)
    tensors, _ = split_mtp(tensors)
    return config, params_from_tensors(config, tensors, str(folder), dtype), tokenizer


def split_mtp(tensors: dict[str, LazyTensor]) -> tuple[dict[str, LazyTensor], dict[str, LazyTensor]]:
    """(the decoder's tensors, the MTP layers' `mtp.*` ones): see models/mtp.py."""
    own = {name: t for name, t in tensors.items() if not name.startswith("mtp.")}
    return own, {name: t for name, t in tensors.items() if name.startswith("mtp.")}


def read_config(folder: Path) -> LlamaConfig:
    return _config_from(folder, _read_json_config(folder))


def _read_json_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"{folder} is not an HF checkpoint folder: it has no config.json "
            "(expected config.json and model.safetensors or model.safetensors.index.json)"
        )
    with open(config_path) as f:
        return json.load(f)


def _config_from(folder: Path, hf_config: dict[str, Any]) -> LlamaConfig:
    try:
        return families.config_from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"{folder / 'config.json'}: {error}") from None


def open_hf_folder(folder: str | Path) -> tuple[LlamaConfig, dict[str, LazyTensor], Any]:
    """(config, unread tensors by our flat names, tokenizer or None) from a folder. Tensors the
    family does not use are a ValueError naming them; so is a quantization_config specjax does not
    read (it reads FP8 weights, `fp8_tensors`, and gpt-oss's MXFP4 experts)."""
    folder = Path(folder)
    hf_config = _read_json_config(folder)
    config = _config_from(folder, hf_config)
    hf = checkpoint_tensors(folder)
    quantization = hf_config.get("quantization_config")
    if quantization is not None:
        try:
            hf = _quantized_tensors(hf, quantization)
        except ValueError as error:
            raise ValueError(f"{folder / 'config.json'}: {error}") from None
    tensors, unknown = map_tensors(config, hf)
    if unknown:
        more = " ..." if len(unknown) > 8 else ""
        raise ValueError(
            f"checkpoint {folder} has tensors a {config.model_type} model does not use: "
            f"{sorted(unknown)[:8]}{more}"
        )
    return config, tensors, tokenizer_from_folder(folder)


def checkpoint_tensors(folder: Path) -> dict[str, LazyTensor]:
    """Every tensor of the folder's safetensors file or shards, by HF name, unread."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return open_safetensors(single)
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(open_safetensors(folder / shard))
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ValueError(f"{index} lists tensors its shards do not hold: {missing[:8]}")
        return tensors
    raise ValueError(
        f"{folder} has no model.safetensors or model.safetensors.index.json; only safetensors "
        "checkpoints are supported"
    )


QUANT_METHODS = ("fp8", "mxfp4")  # the quantization_config quant_method values read


def _quantized_tensors(hf: dict[str, LazyTensor], quantization: dict) -> dict[str, LazyTensor]:
    """The checkpoint's tensors as its quantization_config says to read them: MXFP4's as they are
    (`_float_or_mxfp4` pairs them), FP8's `fp8_tensors`; other methods are a ValueError."""
    method = quantization.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(
            f"quantization_config quant_method={method!r} is not read by specjax; it reads "
            f"{QUANT_METHODS} (FP8 checkpoints as DeepSeek-V3 and Qwen3 FP8 release them)"
        )
    return hf if method == "mxfp4" else fp8_tensors(hf, check_fp8_config(quantization))


def fp8_tensors(hf: dict[str, LazyTensor], block: tuple[int, int] | None) -> dict[str, LazyTensor]:
    """An FP8 checkpoint's tensors: each float8_e4m3fn `X.weight` [..., out, in] with its
    `X.weight_scale_inv` (`block` [out, in] weights per scale, or one per tensor) as one tensor
    that reads as a QuantizedWeight already in our layout [..., in, out] (`from_fp8`, "fp8"); the
    rest (embedding, norms, the head, a router: what the release left unquantized) as they are."""
    out = {}
    for name, tensor in hf.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in hf:
                raise ValueError(
                    f"{tensor.source} scales no weight: {name.removesuffix('_scale_inv')} is missing"
                )
            continue
        scale = hf.get(name + "_scale_inv")
        if (tensor.dtype == FP8_DTYPE) != (scale is not None):
            what = "is float8 without" if scale is None else f"is {tensor.dtype} with"
            raise ValueError(f"FP8 checkpoint: {tensor.source} {what} a {name}_scale_inv")
        out[name] = tensor if scale is None else _fp8_tensor(tensor, scale, block)
    return out


def _fp8_tensor(weight: LazyTensor, scale_inv: LazyTensor, block: tuple[int, int] | None) -> LazyTensor:
    return LazyTensor(
        (*weight.shape[:-2], weight.shape[-1], weight.shape[-2]),
        np.dtype(np.float32),
        lambda: from_fp8(weight.read(), scale_inv.read(), block),
        weight.source,
        quantized="fp8",
    )


def _ours(tensor: LazyTensor) -> LazyTensor:
    """A checkpoint matrix in our layout: HF's [out, in] transposed; an FP8 weight reads in ours."""
    return tensor if tensor.quantized else tensor.transposed()


def map_tensors(config: LlamaConfig, hf: dict[str, LazyTensor]) -> tuple[dict[str, LazyTensor], list[str]]:
    """(our flat name -> tensor in our layout, the HF names left over). Nothing is read."""
    hf = {name: t for name, t in hf.items() if not _IGNORED.fullmatch(name)}
    used: set[str] = set()

    def take(name: str) -> LazyTensor | None:
        tensor = hf.get(name)
        if tensor is not None:
            used.add(name)
        return tensor

    ours: dict[str, LazyTensor] = {}
    for hf_name, name in (("model.embed_tokens.weight", "embed"), ("model.norm.weight", "final_norm")):
        if (tensor := take(hf_name)) is not None:
            ours[name] = tensor
    head = take("lm_head.weight")  # with tied embeddings HF ignores a saved one, and so do we
    if head is not None and not config.tie_word_embeddings:
        ours["lm_head"] = _ours(head)  # [V, D] -> [D, V]
    for i in range(config.num_layers):
        for name, tensor in _layer_tensors(config, i, take).items():
            ours[f"layers.{i}.{name}"] = tensor
    ours |= _mtp_tensors(config, take)
    return ours, [name for name in hf if name not in used]


def _mtp_tensors(config: LlamaConfig, take) -> dict[str, LazyTensor]:
    """The checkpoint's MTP layers (model.layers.{L + j}, after the decoder's L layers; the forward
    does not run them) as `mtp.{j}.{name}`: their own tensors and their decoder block's (read by
    models/mtp.py); their copies of the embedding and the head are the target's, not read."""
    out = {}
    config_mtp = mtp.mtp_layer_config(config)
    for j in range(config.num_mtp_layers):
        for ours, theirs in mtp.mtp_tensor_names(config, j).items():
            if (tensor := take(theirs)) is not None:
                out[ours] = tensor.transposed()  # eh_proj [D, 2D] -> [2D, D]; norms as they are
        prefix = f"model.layers.{config.num_layers + j}."
        for name in mtp.MTP_IGNORED:
            take(prefix + name)
        block = _layer_tensors(
            config_mtp, 0, lambda name, prefix=prefix: take(name.replace("model.layers.0.", prefix, 1))
        )
        out |= {f"mtp.{j}.{name}": tensor for name, tensor in block.items()}
    return out


def _layer_tensors(config: LlamaConfig, i: int, take) -> dict[str, LazyTensor]:
    """Layer i's tensors by our names (those present; `params_from_tensors` names what is missing)."""
    prefix = f"model.layers.{i}."
    names = families.attention_tensors(config) | families.norm_tensors(config)
    if not config.is_moe_layer(i):
        names |= families.DENSE_MLP_TENSORS
    out = {}
    for ours, theirs in names.items():
        if (tensor := take(prefix + theirs)) is not None:
            out[ours] = _ours(tensor)  # matrices [out, in] -> [in, out]; vectors as they are
    if (fused := take(prefix + "self_attn.qkv_proj.weight")) is not None:  # Phi-3: q, k, v rows
        q, kv = config.q_size, config.kv_size
        for name, (start, stop) in {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}.items():
            out[name] = fused.rows(start, stop).transposed()
    if (fused := take(prefix + "mlp.gate_up_proj.weight")) is not None:  # Phi-3: gate rows, then up
        F = config.intermediate_size
        out["gate"], out["up"] = fused.rows(0, F).transposed(), fused.rows(F, 2 * F).transposed()
    if config.is_moe_layer(i):
        experts = _gpt_oss_expert_tensors if config.model_type == "gpt_oss" else _expert_tensors
        out.update(experts(config, prefix, take))
    return out


def _gpt_oss_expert_tensors(config: LlamaConfig, prefix: str, take) -> dict[str, LazyTensor]:
    """gpt-oss's router [D, X] (and its bias), and its experts' weights and biases: gate and up
    from the interleaved columns of gate_up_proj [X, D, 2F] (float, or MXFP4 blocks and scales)."""
    out = {}
    if (router := take(prefix + "mlp.router.weight")) is not None:
        out["router"] = router.transposed()
    if (bias := take(prefix + "mlp.router.bias")) is not None:
        out["router_bias"] = bias
    experts = prefix + "mlp.experts."
    for theirs, (first, second) in {
        "gate_up_proj": ("expert_gate", "expert_up"),
        "gate_up_proj_bias": ("expert_gate_bias", "expert_up_bias"),
    }.items():
        if (fused := _float_or_mxfp4(experts + theirs, take)) is not None:
            out[first], out[second] = fused.interleaved(0), fused.interleaved(1)
    for theirs, ours in {"down_proj": "expert_down", "down_proj_bias": "expert_down_bias"}.items():
        if (tensor := _float_or_mxfp4(experts + theirs, take)) is not None:
            out[ours] = tensor
    return out


def _float_or_mxfp4(name: str, take) -> LazyTensor | None:
    """The tensor `name`, or the one its MXFP4 `name_blocks` and `name_scales` hold (dequantized
    to float32 when read), or None when neither is there."""
    if (tensor := take(name)) is not None:
        return tensor
    blocks, scales = take(name + "_blocks"), take(name + "_scales")
    if blocks is None or scales is None:
        return None
    return mxfp4_tensor(blocks, scales, name + "_{blocks,scales}")


def _expert_tensors(config: LlamaConfig, prefix: str, take) -> dict[str, LazyTensor]:
    """A mixture's router [D, X] and its experts' weights stacked [X, in, out], from the
    checkpoint's one tensor per expert."""
    router_name, per_expert = families.expert_tensors(config)
    out = {}
    for ours, theirs in families.moe_extra_tensors(config).items():
        if (tensor := take(prefix + theirs)) is not None:
            out[ours] = _ours(tensor)
    if (router := take(prefix + router_name)) is not None:
        out["router"] = _ours(router)
    for ours, pattern in per_expert.items():
        parts = [take(prefix + pattern.format(j=j)) for j in range(config.num_experts)]
        if all(part is not None for part in parts):
            out[ours] = stacked([_ours(part) for part in parts], prefix + pattern.format(j="*"))
    return out


def tokenizer_from_folder(folder: str | Path):
    """The folder's tokenizer, or None when it has no tokenizer files.

    A `tokenizer.json` loads through `PreTrainedTokenizerFast` directly. Only a folder with just the
    slow files (`tokenizer.model`, `vocab.json`) goes through `AutoTokenizer`, whose config classes
    import torch when it is installed.
    """
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    return None
