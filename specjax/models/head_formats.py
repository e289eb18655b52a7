"""Drafter checkpoints as the ecosystem publishes them, read as they are (and written, for the
speculators format, so that heads trained here can be served by vLLM).

- speculators (vLLM's format): `config.json` with `speculators_model_type` "eagle3" (or
  "dflash", see models/dflash.py) and the decoder layer's own HF config under
  `transformer_layer_config`; `model.safetensors` with `fc`, `layers.{i}.*` (HF names), `norm`,
  `lm_head` over the draft vocabulary, `d2t` (draft index -> target id, as an offset: target id =
  index + d2t[index]) and `t2d` (which target ids are drafted); an `embed_tokens` copy of the
  target's embedding, which the head does not need (the target's own is used).
- EAGLE-3's original release: a Llama-like `config.json` with `draft_vocab_size`, and the same
  tensors with the decoder layer under `midlayer.*`.
- IBM's MLP speculator (fms-extras, served by vLLM as `mlp_speculator`): `config.json` with
  model_type "mlp_speculator" (emb_dim, inner_dim, n_predict, tie_weights, scale_input,
  vocab_size) and per stage `speculator.emb.{i}.weight` [V, I], `speculator.proj.{i}.weight`
  [I, E or I], `speculator.head.{i}.weight` [V, I], `speculator.ln.{i}.weight` and `.bias` (the
  `speculator.` prefix optional, as vLLM reads them); see models/mlp_speculator.py.

Tensors are read with specjax's own safetensors reader (models/tensors.py): no torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.dflash import DFlashConfig, DFlashHead
from specjax.models.dflash import param_shapes as dflash_shapes
from specjax.models.dflash import params_from_flat as dflash_from_flat
from specjax.models.eagle import EagleConfig, EagleHead, EagleParams
from specjax.models.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    param_shapes,
    params_from_flat,
)
from specjax.models.families import rope_parameters, rope_scaling_from_hf
from specjax.models.medusa import MedusaConfig, MedusaHead, MedusaParams
from specjax.models.mlp_speculator import MLPSpeculatorConfig, MLPSpeculatorHead, MLPSpeculatorParams
from specjax.models.params import checkpoint_layer_shapes, layer_from_checkpoint
from specjax.models.tensors import LazyTensor, of_array, open_safetensors, write_safetensors
from specjax.models.torch_checkpoint import load_torch_checkpoint

# HF's per-layer names under layers.{i}. (or midlayer.) -> ours.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
}
_LAYER_TYPES = ("llama", "qwen3")  # decoder layers a published EAGLE-3 head may have


def _on_device(params):
    """Params read from a file (numpy) as arrays on the default device."""
    return jax.tree.map(jnp.asarray, params)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"head folder {str(folder)!r} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def head_format(folder: Path) -> str | None:
    """ "speculators", "eagle3-release", "eagle1-release", "medusa-release", "mlp_speculator" or
    None (not a published head this module reads)."""
    if not (folder / "config.json").is_file():
        return None
    config = read_config(folder)
    if config.get("model_type") == "mlp_speculator":
        return "mlp_speculator"
    if "speculators_model_type" in config:
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa-release"
    names = _tensor_names(folder)
    if any(name.startswith("midlayer.") for name in names):
        return "eagle3-release"
    if "fc.weight" in names and any(name.startswith("layers.0.") for name in names):
        return "eagle1-release"
    return None


def _tensor_names(folder: Path) -> list[str]:
    try:
        return list(_tensors(folder))
    except ValueError:  # no weights at all: not a head (the caller says so)
        return []


# torch pickles the releases ship, read without torch (models/torch_checkpoint.py).
_TORCH_FILES = ("pytorch_model.bin", "medusa_lm_head.pt")


def _tensors(folder: Path) -> dict[str, LazyTensor]:
    """Every tensor of a head folder: its safetensors files, or a torch pickle of a release."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        tensors = {}
        for file in files:
            tensors.update(open_safetensors(file))
        return tensors
    for name in _TORCH_FILES:
        if (folder / name).is_file():
            return {key: of_array(value, key) for key, value in load_torch_checkpoint(folder / name).items()}
    raise ValueError(
        f"head folder {str(folder)!r} has no weights: expected *.safetensors or one of "
        f"{', '.join(_TORCH_FILES)}"
    )


def eagle3_config_from_layer_config(
    layer: dict[str, Any], draft_vocab_size: int, aux_layer_ids, source: str, **options
) -> Eagle3Config:
    """An Eagle3Config from a decoder layer's HF config dict (speculators' transformer_layer_config,
    or the release's own config.json)."""
    model_type = layer.get("model_type", "llama")
    if model_type not in _LAYER_TYPES:
        raise ValueError(
            f"{source}: a decoder layer of model_type {model_type!r} is not supported; supported: "
            f"{', '.join(_LAYER_TYPES)}"
        )
    if layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {layer['hidden_act']!r} is not supported; only silu is")
    rope = rope_parameters(layer)
    heads = layer["num_attention_heads"]
    return Eagle3Config(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=tuple(aux_layer_ids),
        num_layers=layer.get("num_hidden_layers", 1),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from_hf(rope),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(layer.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        **options,
    )


def read_eagle3(folder: Path, target_num_layers: int | None = None) -> Eagle3Head:
    """An EAGLE-3 head from a speculators folder or from EAGLE-3's original release layout.
    A head that names no fused layers takes the published default (2, L/2, L-3), which needs
    the target's layer count: `target_num_layers`."""
    fmt = head_format(folder)
    config = read_config(folder)
    source = f"head {str(folder)!r}"
    if fmt == "speculators":
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(
                f"{source} is a speculators {config['speculators_model_type']!r} head, not eagle3"
            )
        layer = dict(config["transformer_layer_config"])
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        options = {
            k: bool(config.get(k, False))
            for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
        }
        target_hidden = config.get("target_hidden_size")
        prefix = "layers."
    elif fmt == "eagle3-release":
        layer = dict(config)
        layer["vocab_size"] = config.get("vocab_size")
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        options = {"norm_before_residual": bool(config.get("norm_before_residual", False))}
        target_hidden = config.get("target_hidden_size")
        prefix = "midlayer."
    else:
        raise ValueError(f"{source} is neither a speculators head nor an EAGLE-3 release")
    if ids is None:
        if target_num_layers is None:
            raise ValueError(
                f"{source} names no fused target layers; load it with its target (load_head(path, target))"
            )
        ids = default_aux_layer_ids(target_num_layers)
    tensors = _tensors(folder)
    draft_vocab = int(config.get("draft_vocab_size") or tensors["lm_head.weight"].shape[0])
    head_config = eagle3_config_from_layer_config(
        layer, draft_vocab, ids, source, target_hidden_size=target_hidden, **options
    )
    flat, used = {}, set()
    for name, tensor in tensors.items():
        ours = _our_name(name, prefix)
        if ours is not None:
            flat[ours] = tensor
            used.add(name)
    unknown = sorted(set(tensors) - used - {"d2t", "t2d", "embed_tokens.weight"})
    if unknown:
        raise ValueError(f"{source} has tensors an EAGLE-3 head does not use: {unknown[:8]}")
    arrays = _checked_arrays(flat, param_shapes(head_config), source)
    vocab = _draft_vocab(tensors, head_config, source)
    ours = config.get("specjax") or {}  # a head specjax wrote: who it belongs to, how it was made
    meta = ours.get("meta") or {"source": str(folder), "format": fmt}
    params = _on_device(params_from_flat(head_config, arrays))
    return Eagle3Head(head_config, params, vocab, target=ours.get("target") or {}, meta=meta)


def _our_name(name: str, layer_prefix: str) -> str | None:
    """A head tensor's flat name in our layout (see eagle3.param_shapes), or None."""
    globals_ = {
        "fc.weight": "fc",
        "norm.weight": "norm",
        "lm_head.weight": "lm_head",
        "input_norm.weight": "input_norm",
        "hidden_norm.weight": "hidden_norm",  # DFlash's (EAGLE-3's sits in its first layer)
    }
    if name in globals_:
        return globals_[name]
    if name.startswith("fc_norm."):  # fc_norm.{j}.weight: stacked below
        return f"fc_norms.{name.split('.')[1]}"
    if name.startswith(layer_prefix):
        rest = name[len(layer_prefix) :]
        index, _, hf = rest.partition(".") if layer_prefix == "layers." else ("0", ".", rest)
        if hf == "hidden_norm.weight":
            return "hidden_norm" if index == "0" else None
        if hf in _LAYER_NAMES:
            return f"layers.{index}.{_LAYER_NAMES[hf]}"
    return None


def _checked_arrays(flat: dict[str, LazyTensor], shapes: dict[str, tuple[int, ...]], source: str) -> dict:
    """Our arrays ([in, out] matrices) after checking every name and shape against the config."""
    norms = sorted(name for name in flat if name.startswith("fc_norms."))
    if norms:
        parts = [flat.pop(name).read() for name in norms]
        flat["fc_norms"] = of_array(np.stack(parts), "fc_norm.*")
    missing = sorted(set(shapes) - set(flat))
    unexpected = sorted(set(flat) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match its config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    arrays = {}
    for name, shape in shapes.items():
        tensor = flat[name]
        value = tensor.read()
        value = value.T if value.ndim == 2 and name != "fc_norms" else value  # torch [out, in] -> [in, out]
        if tuple(value.shape) != tuple(shape):
            raise ValueError(
                f"{source}: {tensor.source} has shape {tuple(tensor.shape)}, the config needs {shape[::-1]}"
            )
        arrays[name] = np.ascontiguousarray(value)  # in the dtype it was stored in
    return arrays


def _draft_vocab(tensors: dict[str, LazyTensor], config, source: str) -> np.ndarray:
    """Draft index -> target id from `d2t` (offsets); all ids in order when the head drafts the
    whole vocabulary and has none."""
    W = getattr(config, "num_draft_tokens", config.draft_vocab_size)  # DFlash: None means the target's
    if "d2t" not in tensors:
        if W != config.vocab_size:
            raise ValueError(f"{source} drafts over {W} tokens of {config.vocab_size} but has no d2t map")
        return np.arange(W, dtype=np.int32)
    d2t = tensors["d2t"].read().astype(np.int64)
    if d2t.shape != (W,):
        raise ValueError(f"{source}: d2t has shape {d2t.shape}, the config's draft vocabulary is {W}")
    vocab = np.arange(W) + d2t
    if "t2d" in tensors:
        t2d = tensors["t2d"].read().astype(bool)
        if t2d.shape != (config.vocab_size,) or not np.array_equal(np.flatnonzero(t2d), np.sort(vocab)):
            raise ValueError(f"{source}: t2d does not mark the target ids d2t maps to")
    return vocab.astype(np.int32)


def write_speculators_eagle3(folder: Path, head: Eagle3Head, verifier: str | None = None) -> None:
    """The head as a speculators "eagle3" folder (config.json, model.safetensors), which vLLM
    serves: matrices in torch's [out, in], d2t as offsets, t2d as a mask."""
    from specjax.models.params import layer_to_checkpoint

    c = head.config
    folder.mkdir(parents=True, exist_ok=True)
    p = head.params
    tensors = {
        "fc.weight": np.asarray(p.fc).T,
        "norm.weight": np.asarray(p.norm),
        "lm_head.weight": np.asarray(p.lm_head).T,
    }
    if p.input_norm is not None:
        tensors["input_norm.weight"] = np.asarray(p.input_norm)
    if p.fc_norms is not None:
        for j, weight in enumerate(np.asarray(p.fc_norms)):
            tensors[f"fc_norm.{j}.weight"] = weight
    hf = {ours: theirs for theirs, ours in _LAYER_NAMES.items()}
    for i, layer in enumerate(p.layers):
        for name, value in layer_to_checkpoint(layer, c.layer_config, i).items():
            value = np.asarray(value)
            tensors[f"layers.{i}.{hf[name]}"] = value.T if value.ndim == 2 else value
    tensors["layers.0.hidden_norm.weight"] = np.asarray(p.hidden_norm)
    vocab = np.asarray(head.vocab, np.int64)
    tensors["d2t"] = vocab - np.arange(len(vocab))
    t2d = np.zeros(c.vocab_size, bool)
    t2d[vocab] = True
    tensors["t2d"] = t2d
    write_safetensors(
        folder / "model.safetensors", {n: of_array(np.ascontiguousarray(v), n) for n, v in tensors.items()}
    )
    layer_config = {
        "model_type": "qwen3" if c.qk_norm else "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": c.qkv_bias,
        "rope_parameters": _rope_dict(c),
    }
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": c.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "transformer_layer_config": layer_config,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "specjax": {"target": head.target, "meta": head.meta},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def _rope_dict(c: Eagle3Config | DFlashConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    s = c.rope_scaling
    if s is not None and s.rope_type == "linear":
        rope.update(rope_type="linear", factor=s.factor)
    elif s is not None:
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return rope


def read_dflash(folder: Path, target_num_layers: int | None = None) -> DFlashHead:
    """A DFlash head from a speculators "dflash" folder."""
    config = read_config(folder)
    source = f"head {str(folder)!r}"
    if config.get("speculators_model_type") != "dflash":
        raise ValueError(f"{source} is not a speculators dflash head")
    if config.get("sample_from_anchor"):
        raise ValueError(f"{source}: sample_from_anchor=true (the anchor slot drafting too) is not supported")
    layer = dict(config["transformer_layer_config"])
    if any(t != "full_attention" for t in layer.get("layer_types") or []):
        raise ValueError(f"{source}: sliding-window draft layers are not supported; only full attention")
    if layer.get("model_type", "qwen3") != "qwen3":
        raise ValueError(
            f"{source}: draft layers of model_type {layer['model_type']!r}; only qwen3 is supported"
        )
    ids = config.get("aux_hidden_state_layer_ids")
    if ids is None:
        if target_num_layers is None:
            raise ValueError(f"{source} names no fused target layers; load it with its target")
        ids = default_aux_layer_ids(target_num_layers)
    if config.get("mask_token_id") is None:
        raise ValueError(f"{source} has no mask_token_id")
    rope = rope_parameters(layer)
    heads = layer["num_attention_heads"]
    tensors = _tensors(folder)
    head_config = DFlashConfig(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        vocab_size=layer["vocab_size"],
        num_layers=layer.get("num_hidden_layers", 1),
        aux_layer_ids=tuple(ids),
        block_size=int(config.get("block_size", 8)),
        mask_token_id=int(config["mask_token_id"]),
        # An LM head of its own where the file has one (speculators drops it over the target's
        # whole vocabulary, and its readers then use the target's).
        draft_vocab_size=int(config["draft_vocab_size"]) if "lm_head.weight" in tensors else None,
        target_hidden_size=config.get("target_hidden_size"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from_hf(rope),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(layer.get("attention_bias", False)),
    )
    flat, used = {}, set()
    for name, tensor in tensors.items():
        ours = _our_name(name, "layers.")
        if ours is not None:
            flat[ours] = tensor
            used.add(name)
    unknown = sorted(set(tensors) - used - {"d2t", "t2d", "embed_tokens.weight"})
    if unknown:
        raise ValueError(f"{source} has tensors a DFlash head does not use: {unknown[:8]}")
    arrays = _checked_arrays(flat, dflash_shapes(head_config), source)
    vocab = _draft_vocab(tensors, head_config, source)
    ours = config.get("specjax") or {}
    meta = ours.get("meta") or {"source": str(folder), "format": "speculators"}
    params = _on_device(dflash_from_flat(head_config, arrays))
    return DFlashHead(head_config, params, vocab, target=ours.get("target") or {}, meta=meta)


def write_speculators_dflash(folder: Path, head: DFlashHead, verifier: str | None = None) -> None:
    """The head as a speculators "dflash" folder, which vLLM serves."""
    from specjax.models.params import layer_to_checkpoint

    c, p = head.config, head.params
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        "fc.weight": np.asarray(p.fc).T,
        "hidden_norm.weight": np.asarray(p.hidden_norm),
        "norm.weight": np.asarray(p.norm),
    }
    if p.lm_head is not None:
        tensors["lm_head.weight"] = np.asarray(p.lm_head).T
        vocab = np.asarray(head.vocab, np.int64)
        tensors["d2t"] = vocab - np.arange(len(vocab))
        t2d = np.zeros(c.vocab_size, bool)
        t2d[vocab] = True
        tensors["t2d"] = t2d
    hf = {ours: theirs for theirs, ours in _LAYER_NAMES.items()}
    for i, layer in enumerate(p.layers):
        for name, value in layer_to_checkpoint(layer, c.layer_config, i).items():
            value = np.asarray(value)
            tensors[f"layers.{i}.{hf[name]}"] = value.T if value.ndim == 2 else value
    arrays = {n: of_array(np.ascontiguousarray(v), n) for n, v in tensors.items()}
    write_safetensors(folder / "model.safetensors", arrays)
    layer_config = {
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "attention_bias": c.qkv_bias,
        "rope_parameters": _rope_dict(c),
    }
    config = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "draft_vocab_size": c.num_draft_tokens,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "mask_token_id": c.mask_token_id,
        "target_hidden_size": c.target_hidden_size,
        "sample_from_anchor": False,
        "transformer_layer_config": layer_config,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1}],
            "verifier": {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]},
        },
        "specjax": {"target": head.target, "meta": head.meta},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def read_eagle1_release(folder: Path) -> EagleHead:
    """An EAGLE-1 head as its authors released it: a Llama-like config.json, and `fc` (over
    [token embedding, feature], with a bias), one decoder layer `layers.0.*` without an input
    norm, and a copy of the target's embedding (unused: the target's own is read)."""
    config = read_config(folder)
    source = f"head {str(folder)!r}"
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{source}: EAGLE-1 heads of {config['num_hidden_layers']} layers; only 1 is supported"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {config['hidden_act']!r} is not supported; only silu is")
    rope = rope_parameters(config)
    heads = config["num_attention_heads"]
    D = config["hidden_size"]
    head_config = EagleConfig(
        hidden_size=D,
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or D // heads,
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["vocab_size"],
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from_hf(rope),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        qkv_bias=bool(config.get("attention_bias", False)),
        input_norm=False,
    )
    tensors = _tensors(folder)
    flat, used = {}, set()
    for name, tensor in tensors.items():
        ours = _our_name(name, "layers.")
        if ours is not None and ours.startswith("layers.0."):
            flat[ours.removeprefix("layers.0.")] = tensor
            used.add(name)
    unknown = sorted(set(tensors) - used - {"fc.weight", "fc.bias", "embed_tokens.weight"})
    if unknown:
        raise ValueError(f"{source} has tensors an EAGLE-1 head does not use: {unknown[:8]}")
    shapes = checkpoint_layer_shapes(head_config.layer_config)
    shapes.pop("attn_norm")  # the released layer has none (see input_norm)
    arrays = _checked_arrays(flat, shapes, source)
    arrays["attn_norm"] = np.ones((D,), arrays["q"].dtype)  # never read: input_norm=False
    if "fc.weight" not in tensors:
        raise ValueError(f"{source} has no fc.weight")
    fc = tensors["fc.weight"].read().T  # [2D, D] over inputs [embedding, feature]
    if fc.shape != (2 * D, D):
        raise ValueError(f"{source}: fc.weight has shape {fc.T.shape}, the config needs {(D, 2 * D)}")
    fc = np.ascontiguousarray(np.concatenate([fc[D:], fc[:D]]))  # ours reads [feature, embedding]
    bias = tensors["fc.bias"].read() if "fc.bias" in tensors else np.zeros((D,), fc.dtype)
    params = _on_device(
        EagleParams(fc=fc, fc_bias=bias, layer=layer_from_checkpoint(arrays, head_config.layer_config))
    )
    meta = {"source": str(folder), "format": "eagle1-release"}
    vocab = np.arange(head_config.vocab_size, dtype=np.int32)
    return EagleHead(head_config, params, vocab, target={}, meta=meta)


def read_medusa_release(folder: Path) -> MedusaHead:
    """Medusa heads as released: config.json with medusa_num_heads and medusa_num_layers, and per
    head i its residual blocks `{i}.{j}.linear.*` and its own LM head `{i}.{L}.weight` (in
    medusa_lm_head.pt, or under `medusa_head.` in safetensors)."""
    config = read_config(folder)
    source = f"head {str(folder)!r}"
    M, L = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    tensors = {name.removeprefix("medusa_head."): t for name, t in _tensors(folder).items()}
    expected = {f"{i}.{j}.linear.{p}" for i in range(M) for j in range(L) for p in ("weight", "bias")}
    expected |= {f"{i}.{L}.weight" for i in range(M)}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match medusa_num_heads={M}, medusa_num_layers={L}: missing "
            f"{missing[:6]}, unexpected {unexpected[:6]}"
        )
    V, D = tensors[f"0.{L}.weight"].shape
    w = np.stack([[tensors[f"{i}.{j}.linear.weight"].read().T for j in range(L)] for i in range(M)])
    b = np.stack([[tensors[f"{i}.{j}.linear.bias"].read() for j in range(L)] for i in range(M)])
    if w.shape[2:] != (D, D):
        raise ValueError(f"{source}: residual blocks of shape {w.shape[2:]}, the LM heads' width is {D}")
    lm_heads = np.stack([tensors[f"{i}.{L}.weight"].read().T for i in range(M)])  # [M, D, V]
    more = L > 1
    params = MedusaParams(
        w=w[:, 0],
        b=b[:, 0],
        more_w=w[:, 1:] if more else None,
        more_b=b[:, 1:] if more else None,
        lm_heads=lm_heads,
    )
    params = _on_device(params)
    head_config = MedusaConfig(M, D, V, V, num_layers=L, own_lm_heads=True)
    meta = {"source": str(folder), "format": "medusa-release"}
    return MedusaHead(head_config, params, target={}, meta=meta, vocab=np.arange(V, dtype=np.int32))


def read_published_head(folder: Path, target=None):
    """Any published head this module reads, by what the folder holds (see `head_format`);
    `target` (a Model) resolves what a head leaves to its target and is checked against it."""
    fmt = head_format(folder)
    layers = None if target is None else target.config.num_layers
    if fmt == "speculators":
        kind = read_config(folder)["speculators_model_type"]
        if kind not in ("eagle3", "dflash"):
            raise ValueError(
                f"head {str(folder)!r}: speculators_model_type {kind!r} is not supported; "
                "supported: eagle3, dflash"
            )
        head = read_eagle3(folder, layers) if kind == "eagle3" else read_dflash(folder, layers)
    elif fmt == "eagle3-release":
        head = read_eagle3(folder, layers)
    elif fmt == "eagle1-release":
        head = read_eagle1_release(folder)
    elif fmt == "medusa-release":
        head = read_medusa_release(folder)
    elif fmt == "mlp_speculator":
        head = read_mlp_speculator(folder)
    else:
        raise ValueError(
            f"head {str(folder)!r} is not a head specjax reads: expected a specjax head (head.json), a "
            "speculators folder, an EAGLE-1 or EAGLE-3 release, a Medusa release or an MLP speculator"
        )
    if target is not None:
        head.check_target(target)
    return head


def _mlp_tensor_names(config: MLPSpeculatorConfig) -> dict[str, tuple[str, int]]:
    """Published tensor name (without `speculator.`) -> (our field, stage index) for every stored
    weight of `config`: stage 0's projection apart, the later stages' stacked."""
    names = {"proj.0.weight": ("proj_first", 0)}
    for j in range(1, 2 if config.tie_weights else config.n_predict):
        names[f"proj.{j}.weight"] = ("proj", j - 1)
    for s in range(config.stored_stages):
        names |= {
            f"emb.{s}.weight": ("emb", s),
            f"head.{s}.weight": ("head", s),
            f"ln.{s}.weight": ("ln_weight", s),
            f"ln.{s}.bias": ("ln_bias", s),
        }
    return names


def read_mlp_speculator(folder: Path) -> MLPSpeculatorHead:
    """An MLP speculator as IBM publishes it (config.json with model_type "mlp_speculator",
    safetensors `speculator.{emb,proj,head,ln}.{i}.*`). A tied one keeps stage 0's emb, head and
    norm and proj 0 and 1; the copies torch writes under the other stages' names are not read,
    as vLLM does not read them. top_k_tokens_per_head and n_candidates (candidate trees) are not
    used: the speculator drafts a chain, as in vLLM."""
    config = read_config(folder)
    source = f"head {str(folder)!r}"
    try:
        emb_dim = config["emb_dim"]
        head_config = MLPSpeculatorConfig(
            emb_dim=emb_dim,
            inner_dim=config.get("inner_dim") or emb_dim,
            vocab_size=config["vocab_size"],
            n_predict=config["n_predict"],
            tie_weights=bool(config.get("tie_weights", config.get("tie_wts", False))),
            scale_input=bool(config.get("scale_input", False)),
        )
    except KeyError as error:
        raise ValueError(f"{source}: config.json has no {error.args[0]!r}") from None
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    tensors = {name.removeprefix("speculator."): t for name, t in _tensors(folder).items()}
    names = _mlp_tensor_names(head_config)
    aliases = set(_mlp_tensor_names(dataclasses.replace(head_config, tie_weights=False))) - set(names)
    missing = sorted(set(names) - set(tensors))
    unexpected = sorted(set(tensors) - set(names) - (aliases if head_config.tie_weights else set()))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match its config (n_predict={head_config.n_predict}, tie_weights="
            f"{head_config.tie_weights}): missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    shapes = head_config.param_shapes()
    parts: dict[str, list] = {field: [None] * shapes[field][0] for field in shapes if field != "proj_first"}
    arrays = {}
    for name, (field, index) in names.items():
        matrix = field in ("proj_first", "proj", "head")  # torch [out, in]; ours [in, out]
        ours = shapes[field] if field == "proj_first" else shapes[field][1:]
        theirs = ours[::-1] if matrix else ours
        if tuple(tensors[name].shape) != theirs:
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)}, the config needs {theirs}"
            )
        value = tensors[name].read().T if matrix else tensors[name].read()
        if field == "proj_first":
            arrays[field] = np.ascontiguousarray(value)
        else:
            parts[field][index] = value
    for field, values in parts.items():
        arrays[field] = np.stack(values) if values else np.zeros(shapes[field], arrays["proj_first"].dtype)
    ours = config.get("specjax") or {}  # a speculator specjax wrote: who it belongs to, how it was made
    meta = ours.get("meta") or {"source": str(folder), "format": "mlp_speculator"}
    params = _on_device(MLPSpeculatorParams(**arrays))
    return MLPSpeculatorHead(head_config, params, target=ours.get("target") or {}, meta=meta)


def write_mlp_speculator(folder: Path, head: MLPSpeculatorHead) -> None:
    """The speculator in its published format (config.json, model.safetensors), which vLLM serves
    as `mlp_speculator`: matrices in torch's [out, in], one tensor per stored weight."""
    c = head.config
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (field, index) in _mlp_tensor_names(c).items():
        value = np.asarray(getattr(head.params, field))
        value = value if field == "proj_first" else value[index]
        value = value.T if field in ("proj_first", "proj", "head") else value  # torch's [out, in]
        tensors[f"speculator.{name}"] = of_array(np.ascontiguousarray(value), name)
    write_safetensors(folder / "model.safetensors", tensors)
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": c.vocab_size,
        "emb_dim": c.emb_dim,
        "inner_dim": c.inner_dim,
        "n_predict": c.n_predict,
        "top_k_tokens_per_head": [1] * c.n_predict,  # a chain: what specjax and vLLM draft
        "n_candidates": 1,
        "tie_weights": c.tie_weights,
        "scale_input": c.scale_input,
        "specjax": {"target": head.target, "meta": head.meta},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
