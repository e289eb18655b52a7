"""Read an HF checkpoint folder (`config.json` + safetensors) without torch.

The folder is what `save_pretrained` writes: `config.json`, then either `model.safetensors` or
shards listed in `model.safetensors.index.json`. Torch weights are `[out, in]`; ours are `[in, out]`
and stacked over layers, so every projection is transposed and the layers are stacked here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from specjax.models.checkpoint import collect_layers, params_from_arrays
from specjax.models.config import LlamaConfig
from specjax.models.llama import LlamaParams

# HF per-layer tensor name -> (our checkpoint name, is a matrix to transpose to [in, out]).
_LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("q", True),
    "self_attn.k_proj.weight": ("k", True),
    "self_attn.v_proj.weight": ("v", True),
    "self_attn.o_proj.weight": ("o", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("gate", True),
    "mlp.up_proj.weight": ("up", True),
    "mlp.down_proj.weight": ("down", True),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some old checkpoints saved; recomputed by the forward.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Files whose presence means the folder carries a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_hf_folder(folder: str | Path) -> tuple[LlamaConfig, LlamaParams, Any]:
    """(config, float32 params, tokenizer or None) from an HF checkpoint folder."""
    config, arrays, tokenizer = read_hf_folder(folder)
    return config, params_from_arrays(config, arrays, source=str(folder)), tokenizer


def read_hf_folder(folder: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], Any]:
    """(config, flat float32 numpy arrays in our layout, tokenizer or None) from a folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"{folder} is not an HF checkpoint folder: it has no config.json "
            "(expected config.json and model.safetensors or model.safetensors.index.json)"
        )
    with open(config_path) as f:
        hf_config = json.load(f)
    try:
        config = LlamaConfig.from_hf(hf_config)
    except ValueError as error:
        raise ValueError(f"{config_path}: {error}") from None
    arrays = _convert_tensors(config, _read_safetensors(folder), folder)
    return config, arrays, tokenizer_from_folder(folder)


def _read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(load_file(folder / shard))
        return tensors
    raise ValueError(
        f"{folder} has no model.safetensors or model.safetensors.index.json; only safetensors "
        "checkpoints are supported"
    )


def _convert_tensors(config: LlamaConfig, tensors: dict[str, np.ndarray], folder) -> dict[str, np.ndarray]:
    def f32(x):
        return np.asarray(x, np.float32)

    arrays = {}
    for hf_name, ours in (("model.embed_tokens.weight", "embed"), ("model.norm.weight", "final_norm")):
        if hf_name in tensors:
            arrays[ours] = f32(tensors.pop(hf_name))
    # With tied embeddings HF ignores a saved lm_head.weight (it equals embed), and so do we.
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is not None and not config.tie_word_embeddings:
        arrays["lm_head"] = f32(lm_head).T  # [V, D] -> [D, V]

    per_layer: dict[str, dict[int, np.ndarray]] = {}
    unknown = []
    for name, value in tensors.items():
        match = _LAYER_NAME.fullmatch(name)
        if match and match.group(2) in _LAYER_TENSORS:
            ours, transpose = _LAYER_TENSORS[match.group(2)]
            per_layer.setdefault(ours, {})[int(match.group(1))] = f32(value).T if transpose else f32(value)
        elif not _IGNORED.fullmatch(name):
            unknown.append(name)
    arrays.update(collect_layers(per_layer, unknown, config.num_layers, f"checkpoint {folder}"))
    return arrays


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
