"""The model families an HF checkpoint folder may hold: each is a config mapping (its
`config.json` onto `LlamaConfig`) and a tensor name map (its checkpoint names onto ours), not a
model of its own.

What each family's model_type changes from Llama:

- llama: nothing (rope types default, linear, llama3 and yarn);
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
- glm4_moe (GLM-4.5, 4.6): partial rotary (the first half of each head, half-split), q/k norms
  with use_qk_norm, q/k/v biases, dense MLPs in the first first_k_dense_replace layers, then
  experts routed by sigmoid scores with a correction bias, group-limited top-k and routed scaling,
  and shared experts. Its MTP layers (model.layers.{num_hidden_layers + i}) are skipped at load;
- deepseek_v3: multi-head latent attention (q and kv low-rank projections with their norms,
  decoupled rotary dims, interleaved with rope_interleave, yarn's mscale_all_dim on the
  softmax scale; models/mla.py) and GLM-4.5's mixture of experts. MTP layers skipped likewise;
- gpt_oss: attention sinks, q/k/v and o biases, sliding and full layers alternating, yarn rotary,
  a mixture of experts in every layer with a biased router (softmax over the top k logits) and
  biased experts whose SwiGLU is clamped (gate * sigmoid(alpha * gate) * (up + 1)).

Anything else, or an option of these that the forward does not compute (an unknown rope type,
attention logit soft-capping, Qwen2-MoE's gated shared expert, ...), is a ValueError naming the field.
"""

from __future__ import annotations

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
    "glm4_moe",
    "deepseek_v3",
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


def _sigmoid_experts(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture of GLM-4.5 and DeepSeek-V3: sigmoid scores with a correction bias, the top
    topk_group of n_group expert groups, routed scaling, n_shared_experts shared experts, dense
    MLPs in the first first_k_dense_replace layers; and the checkpoint's MTP layers."""
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(
            f"config.json topk_method {hf.get('topk_method')!r} / scoring_func {hf.get('scoring_func')!r} "
            "is not supported; supported: noaux_tc with sigmoid scores"
        )
    first_dense = min(hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"])
    return dict(
        num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        dense_layers=tuple(range(first_dense)),
        router_scoring="sigmoid",
        router_score_bias=True,
        num_expert_groups=hf.get("n_group") or 1,
        topk_expert_groups=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        num_mtp_layers=hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0,
    )


def _glm4_moe(hf):
    factor = float(rope_parameters(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dict(
        rotary_dim=int(head_dim * factor),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        **_sigmoid_experts(hf),
    )


def _deepseek_v3(hf):
    if hf.get("attention_bias"):
        raise ValueError("config.json attention_bias=True is not supported for deepseek_v3")
    rope, nope = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    return dict(
        num_kv_heads=1,  # the cache's one entry per token: latent and rotary key (models/mla.py)
        head_dim=nope + rope,
        rotary_dim=rope,
        v_head_dim=hf["v_head_dim"],
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank") or None,
        rope_interleave=bool(hf.get("rope_interleave", True)),
        **_sigmoid_experts(hf),
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
    "glm4_moe": _glm4_moe,
    "deepseek_v3": _deepseek_v3,
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
    """The config's rope scaling (`rope_parameters`' flattened entries), None for "default"."""
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
    """HF's yarn parameters as given; what transformers derives from them (the attention factor,
    from mscale and mscale_all_dim or from factor) is derived where used (RopeScaling)."""
    if params.get("original_max_position_embeddings") is None:
        raise ValueError("config.json rope_scaling type 'yarn' needs original_max_position_embeddings")
    attention_factor = params.get("attention_factor")
    return RopeScaling(
        rope_type="yarn",
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


# ---------------------------------------------------------------------------------------------
# Checkpoint tensor names: HF's per-layer names -> ours (checkpoint layout, see params.py)

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
# A latent-attention layer's (deepseek_v3): see models/mla.py.
LATENT_ATTENTION_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "q_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b": "self_attn.q_b_proj.weight",
    "kv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "kv_b": "self_attn.kv_b_proj.weight",
    "o": "self_attn.o_proj.weight",
}
DENSE_MLP_TENSORS = {
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}


def attention_tensors(config: LlamaConfig) -> dict[str, str]:
    """Our attention weights -> HF's names: latent attention's where the config has it (its
    query projection is q_proj without a q_lora_rank), else the q/k/v projections'."""
    if not config.kv_lora_rank:
        return dict(ATTENTION_TENSORS)
    names = dict(LATENT_ATTENTION_TENSORS)
    if not config.q_lora_rank:
        del names["q_a"], names["q_a_norm"]
        names["q_b"] = "self_attn.q_proj.weight"
    return names


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


def moe_extra_tensors(config: LlamaConfig) -> dict[str, str]:
    """Our name -> HF's (under model.layers.{i}.) of an MoE layer's weights besides the router
    and the routed experts: the score correction bias and the shared experts (GLM-4.5,
    DeepSeek-V3), where the config has them."""
    names = {}
    if config.router_score_bias:
        names["router_score_bias"] = "mlp.gate.e_score_correction_bias"
    if config.shared_expert_size:
        for ours in ("gate", "up", "down"):
            names[f"shared_{ours}"] = f"mlp.shared_experts.{ours}_proj.weight"
    return names
