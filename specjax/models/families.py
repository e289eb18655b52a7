"""The model families an HF checkpoint folder may hold: each is a config mapping (its
`config.json` onto `LlamaConfig`) and a tensor name map (its checkpoint names onto ours), not a
model of its own.

What each family's model_type changes from Llama:

- llama: nothing (rope types default, linear and llama3);
- mistral: a sliding window on every layer;
- qwen2: q/k/v biases; with use_sliding_window, a window on the layers from max_window_layers on;
- qwen3: an RMSNorm of each query and key head; head_dim apart from hidden / heads;
- gemma3_text: (1 + w) norms, GeGLU, embeddings times sqrt(hidden), norms on the attention and
  MLP outputs, q/k norms, query_pre_attn_scalar, sliding and full layers interleaved, each kind
  with its own rotary base;
- phi3: fused qkv_proj and gate_up_proj tensors, partial rotary, a sliding window;
- mixtral: a mixture of experts in every layer (softmax, top-k, renormalized);
- qwen3_moe: Qwen3's attention with a mixture of experts (norm_topk_prob), dense MLPs in
  mlp_only_layers;
- gpt_oss: attention sinks, q/k/v and o biases, sliding and full layers alternating, YaRN rotary,
  a mixture of experts in every layer with a biased router (softmax over the top k logits) and
  biased experts whose SwiGLU is clamped (gate * sigmoid(alpha * gate) * (up + 1)).

Anything else, or an option of these that the forward does not compute (an unknown rope type,
attention logit soft-capping, shared experts, ...), is a ValueError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from specjax.models.config import LlamaConfig, RopeScaling

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen3_moe",
    "gpt_oss",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """A config from an HF `config.json` dict, refusing what the forward cannot run."""
    model_type = hf.get("model_type")
    if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
        raise ValueError(
            "config.json model_type 'gemma3' is the multimodal Gemma 3; specjax runs its text model "
            "(model_type 'gemma3_text', e.g. gemma-3-1b) only"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _refuse_unsupported_options(hf)
    fields = _common_fields(hf)
    fields.update(_FAMILY_FIELDS[model_type](hf))
    return LlamaConfig(**fields)


def _common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    rope = rope_parameters(hf)
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from_hf(rope),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        model_type=hf["model_type"],
        hidden_act=_activation(act),
    )


def _activation(name: str) -> str:
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"config.json hidden_act {name!r} is not supported; supported: silu, gelu_pytorch_tanh")


def _refuse_unsupported_options(hf: dict[str, Any]) -> None:
    """Options some configs of these families carry that would change the logits."""
    checks = {
        "attn_logit_softcapping": lambda v: v is None,
        "use_bidirectional_attention": lambda v: not v,
        "shared_expert_intermediate_size": lambda v: not v,
        "attention_sink": lambda v: not v,
        "sinks": lambda v: not v,
        "mlp_bias": lambda v: not v,
    }
    for name, fine in checks.items():
        if name in hf and not fine(hf[name]):
            raise ValueError(
                f"config.json {name}={hf[name]!r} is not supported; only the family's default "
                "attention and MLP are"
            )


def _window_on_every_layer(hf: dict[str, Any]) -> dict[str, Any]:
    """Mistral, Mixtral, Phi-3: `sliding_window` (null: none) applies to every layer."""
    return dict(sliding_window=hf.get("sliding_window"))


def _qwen_window(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 and Qwen3: a window only with use_sliding_window, on the layers config.json's
    layer_types marks (or, without them, from max_window_layers on)."""
    if not hf.get("use_sliding_window") or not hf.get("sliding_window"):
        return {}
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", L) else "full_attention" for i in range(L)
    ]
    return dict(sliding_window=hf["sliding_window"], layer_types=tuple(types))


def _qwen2(hf):
    return dict(qkv_bias=bool(hf.get("attention_bias", True)), **_qwen_window(hf))


def _qwen3(hf):
    return dict(qk_norm=True, **_qwen_window(hf))


def _gemma3(hf):
    L = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)
    ]
    rope = hf.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):  # transformers 5: one entry per layer type
        full, local = rope["full_attention"], rope.get("sliding_attention") or {}
    else:  # flat: rope_theta and rope_scaling for global layers, rope_local_base_freq for local ones
        full, local = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}, {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json rope_parameters.sliding_attention rope_type {local['rope_type']!r} is not "
            "supported; sliding layers use the default rotation"
        )
    return dict(
        norm="gemma",
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(types),
        rope_theta=float(full.get("rope_theta", 1e6)),
        rope_scaling=rope_scaling_from_hf(full),
        local_rope_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


def _phi3(hf):
    factor = float(rope_parameters(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dict(rotary_dim=int(head_dim * factor), **_window_on_every_layer(hf))


def _mixtral(hf):
    return dict(
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=True,
        **_window_on_every_layer(hf),
    )


def _qwen3_moe(hf):
    L, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = [i for i in range(L) if i in (hf.get("mlp_only_layers") or []) or (i + 1) % step]
    return dict(
        num_experts=hf.get("num_experts") or hf["num_local_experts"],  # transformers 5 renames it
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        dense_layers=tuple(dense),
        **_qwen3(hf),
    )


def _gpt_oss(hf):
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)
    ]
    return dict(
        norm="rms_float32",
        hidden_act="clamped_swiglu",
        qkv_bias=bool(hf.get("attention_bias", True)),
        o_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(types),
        num_experts=hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        norm_topk_prob=True,  # a softmax over the top k logits: the top k probabilities renormalized
        moe_bias=True,
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
    )


_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": lambda hf: {},
    "mistral": _window_on_every_layer,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
}


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 nests rope settings in `rope_parameters`; older configs keep them flat."""
    params = dict(hf.get("rope_scaling") or {})
    nested = hf.get("rope_parameters") or {}
    if "full_attention" not in nested:  # per-layer-type entries are Gemma 3's (see _gemma3)
        params.update(nested)
    if "rope_theta" in hf:
        params.setdefault("rope_theta", hf["rope_theta"])
    return params


def rope_scaling_from_hf(params: dict[str, Any]) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        return _yarn_from_hf(params)
    raise ValueError(
        f"config.json rope_scaling type {rope_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _yarn_from_hf(params: dict[str, Any]) -> RopeScaling:
    """HF's yarn parameters: its attention factor given, or from mscale and mscale_all_dim where
    both are set (their ratio of 0.1 m ln(factor) + 1), else YaRN's default (None here)."""
    if params.get("original_max_position_embeddings") is None:
        raise ValueError("config.json rope_scaling type 'yarn' needs original_max_position_embeddings")
    factor = float(params["factor"])
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:

        def scaled(m):
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        attention_factor = scaled(mscale) / scaled(mscale_all_dim)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


# ---------------------------------------------------------------------------------------------
# Checkpoint tensor names: HF's per-layer names -> ours (checkpoint layout, see llama.py)

# (our name, HF's name under model.layers.{i}.) for weights every family names the same way. HF
# keeps matrices [out, in]; ours are [in, out] (transposed when read, see hf_loader).
ATTENTION_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "sinks": "self_attn.sinks",
    "o_bias": "self_attn.o_proj.bias",
}
DENSE_MLP_TENSORS = {
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def norm_tensors(config: LlamaConfig) -> dict[str, str]:
    """Our layer norms -> HF's names: Gemma 3 has four per layer, and its post_attention_layernorm
    is the norm of the attention's output, where Llama's is the MLP's input norm."""
    if config.sandwich_norms:
        return {
            "attn_out_norm": "post_attention_layernorm.weight",
            "mlp_norm": "pre_feedforward_layernorm.weight",
            "mlp_out_norm": "post_feedforward_layernorm.weight",
        }
    return {"mlp_norm": "post_attention_layernorm.weight"}


def expert_tensors(config: LlamaConfig) -> tuple[str, dict[str, str]]:
    """(the router's HF name, our expert weight -> HF's name with {j} for the expert) of an MoE
    layer: Mixtral's w1 (gate), w3 (up) and w2 (down), or Qwen3-MoE's named projections."""
    if config.model_type == "mixtral":
        prefix = "block_sparse_moe"
        names = {"expert_gate": "w1", "expert_up": "w3", "expert_down": "w2"}
    else:
        prefix = "mlp"
        names = {"expert_gate": "gate_proj", "expert_up": "up_proj", "expert_down": "down_proj"}
    experts = {ours: f"{prefix}.experts.{{j}}.{theirs}.weight" for ours, theirs in names.items()}
    return f"{prefix}.gate.weight", experts
