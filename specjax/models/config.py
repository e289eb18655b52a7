"""The static description of a decoder-only transformer of the Llama lineage.

One config class covers every supported family (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, Mixtral,
Qwen3-MoE, GLM-4.5, DeepSeek-V3, gpt-oss): a family is a setting of the fields below
(specjax/models/families.py maps each HF `model_type` onto them), not a model of its own. The
forward (models/llama.py) picks each piece from the config: the norm's form, query/key norms,
rotary variant and bases, full, sliding-window or latent attention per layer, attention sinks, a
gated MLP or a mixture of experts per layer.

A config is frozen and hashable: it is passed to jitted functions as a static argument, so two
models with equal configs share compiled programs.
"""

from __future__ import annotations

import dataclasses
import math

from specjax.checks import is_int

# Activations of the gated MLP: "silu" (SwiGLU, most families), "gelu_tanh" (GeGLU, Gemma) and
# "clamped_swiglu" (gpt-oss: gate clamped above and up on both sides at `swiglu_limit`, then
# gate * sigmoid(swiglu_alpha * gate) * (up + 1)).
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
# Forms of RMSNorm: "rms" scales by w (Llama: normalize in float32, cast, then times w), "gemma" by
# 1 + w (in float32, then cast), "rms_float32" by w in float32, then cast (gpt-oss).
NORMS = ("rms", "gemma", "rms_float32")
LAYER_TYPES = ("full_attention", "sliding_attention")
# How a router turns its logits into expert scores: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid"
# (GLM-4.5, DeepSeek-V3: each expert scored on its own); see mlp.py `route`.
ROUTER_SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling, as in HF's `rope_scaling` (types "linear", "llama3" and "yarn").

    YaRN (arXiv 2309.00071) as transformers' `_compute_yarn_parameters`: the frequencies between
    beta_fast and beta_slow turns over the original context ramp from kept to divided by `factor`
    (rotary.py `_yarn_inverse_frequencies`), and cos and sin are multiplied by `rotary_factor`
    (rotary.py `apply_rope`): attention_factor where given, else the ratio of mscale's and
    mscale_all_dim's corrections where both are set, else YaRN's 0.1 ln(factor) + 1. DeepSeek-V3's
    latent attention also multiplies its softmax scale by the square of mscale_all_dim's
    correction (LlamaConfig.attention_scale).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # --- yarn only ---
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0  # 0: not given
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # as config.json gives it; None: derived (rotary_factor)

    @property
    def rotary_factor(self) -> float:
        """What cos and sin are multiplied by: yarn's attention factor, resolved as transformers
        does (1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.mscale) / self.yarn_mscale(self.mscale_all_dim)
        return self.yarn_mscale(1.0)

    def yarn_mscale(self, mscale: float) -> float:
        """YaRN's magnitude correction for `factor`: 1 + 0.1 * mscale * ln(factor), 1 when unscaled."""
        return 1.0 if self.factor <= 1 else 0.1 * mscale * math.log(self.factor) + 1.0


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2-style biases on the q, k and v projections
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"  # the HF family it came from (for messages and the GGUF cache)
    # --- the pieces other families choose (defaults: Llama's) ---
    hidden_act: str = "silu"  # ACTIVATIONS
    norm: str = "rms"  # NORMS
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 3)
    embed_scale: bool = False  # token embeddings times sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim's
    rotary_dim: int | None = None  # rotated dims of each head (Phi-3's partial rotary); None: all
    sliding_window: int | None = None  # a sliding layer's query sees the last `sliding_window` positions
    layer_types: tuple[str, ...] | None = None  # per layer, LAYER_TYPES; None: all sliding with a window
    local_rope_theta: float | None = None  # rotary base of sliding layers (Gemma 3); None: rope_theta
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # --- mixture of experts (num_experts 0: every layer has a dense MLP) ---
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None  # each expert's ffw size; None: intermediate_size
    norm_topk_prob: bool = True  # renormalize the chosen experts' router probabilities to sum to 1
    dense_layers: tuple[
        int, ...
    ] = ()  # layers of an MoE model with a dense MLP (Qwen3-MoE's mlp_only_layers)
    # The router (mlp.py `route`): its logits x @ router (plus a bias with moe_bias) scored by
    # router_scoring, the experts chosen by score (plus a correction with router_score_bias)
    # among the best topk_expert_groups of num_expert_groups groups, weighted by score.
    router_scoring: str = "softmax"  # ROUTER_SCORINGS
    # A learned per-expert bias added to the sigmoid scores to choose the experts, not to weigh
    # them (DeepSeek-V3's and GLM-4.5's e_score_correction_bias); sigmoid scoring only.
    router_score_bias: bool = False
    num_expert_groups: int = 1  # experts split into groups; a token picks among its best groups'
    topk_expert_groups: int = 1  # ... this many groups (DeepSeek-V3's n_group, topk_group)
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this, after renormalizing
    moe_bias: bool = False  # biases on the router's logits and each expert's gate, up, down (gpt-oss)
    shared_expert_size: int = 0  # ffw size of an MLP every token goes through too in an MoE layer
    swiglu_alpha: float = 1.702  # "clamped_swiglu"'s sigmoid gain
    swiglu_limit: float = 7.0  # "clamped_swiglu"'s clamp
    # --- attention's extras (gpt-oss; defaults: off) ---
    attention_sinks: bool = False  # a learned logit per query head joins each softmax, with no value
    o_bias: bool = False  # a bias on the attention's output projection
    # --- multi-head latent attention (DeepSeek-V3; kv_lora_rank 0: none) ---
    # Keys and values come from a per-token latent of kv_lora_rank dims (normed) and one rotated
    # key of rotary_dim dims shared by all heads; a query head is head_dim = nope + rotary_dim
    # wide (nope: the dims scored against the latent's keys), a value head v_head_dim. The cache
    # holds the latent and the rotary key (one "kv head", num_kv_heads 1): see models/mla.py.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # queries through a normed latent of this rank; None: directly
    v_head_dim: int | None = None  # None: head_dim
    rope_interleave: bool = False  # rotary dims stored as interleaved pairs (DeepSeek's layout)
    # Multi-token-prediction layers the checkpoint carries after the decoder's (GLM-4.5,
    # DeepSeek-V3: model.layers.{num_layers + i}); the forward does not run them.
    num_mtp_layers: int = 0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LlamaConfig.hidden_size ({self.hidden_size}) must divide by num_heads "
                    f"({self.num_heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"LlamaConfig.rotary_dim must be even and in 2..head_dim ({self.head_dim}), "
                f"got {self.rotary_dim}"
            )
        self._check_choice("hidden_act", ACTIVATIONS)
        self._check_choice("norm", NORMS)
        self._check_choice("router_scoring", ROUTER_SCORINGS)
        self._check_latent_attention()
        self._check_layers()
        self._check_experts()
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "yarn" and self.local_rope_theta is not None:
            # rotary_factor is one value for every layer; unscaled local layers would have 1
            raise ValueError("LlamaConfig: yarn rope_scaling with local_rope_theta is not supported")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    def _check_latent_attention(self) -> None:
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if not self.kv_lora_rank:
            return
        if self.num_kv_heads != 1 or self.rotary_dim >= self.head_dim or self.layer_types is not None:
            raise ValueError(
                "LlamaConfig: latent attention (kv_lora_rank > 0) has num_kv_heads 1, rotary_dim "
                f"below head_dim and no sliding layers; got {self.num_kv_heads}, {self.rotary_dim}, "
                f"{self.head_dim}, {self.layer_types}"
            )
        if self.attention_sinks or self.o_bias:
            raise ValueError("LlamaConfig: latent attention has no attention_sinks or o_bias")

    def _check_choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(
                f"LlamaConfig.{name} {value!r} is not supported; supported: {', '.join(allowed)}"
            )

    def _check_layers(self) -> None:
        window = self.sliding_window
        if window is not None and (not is_int(window) or window < 1):
            raise ValueError(f"LlamaConfig.sliding_window must be a positive integer or None, got {window!r}")
        if self.layer_types is None:
            return
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"LlamaConfig.layer_types must give one of {LAYER_TYPES} for each of the "
                f"{self.num_layers} layers, got {types!r}"
            )
        if "sliding_attention" in types and window is None:
            raise ValueError("LlamaConfig.layer_types has sliding layers but sliding_window is None")

    def _check_experts(self) -> None:
        if self.num_experts == 0:
            if self.num_experts_per_tok or self.dense_layers or self.moe_bias:
                raise ValueError(
                    "LlamaConfig: num_experts_per_tok, dense_layers and moe_bias need num_experts > 0"
                )
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"LlamaConfig.num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"LlamaConfig.dense_layers must be layer indices, got {self.dense_layers}")
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        self._check_expert_groups()

    def _check_expert_groups(self) -> None:
        groups, chosen = self.num_expert_groups, self.topk_expert_groups
        if groups < 1 or self.num_experts % groups or not 1 <= chosen <= groups:
            raise ValueError(
                f"LlamaConfig: num_expert_groups ({groups}) must divide num_experts "
                f"({self.num_experts}) and topk_expert_groups ({chosen}) be in 1..num_expert_groups"
            )
        if groups > 1 and self.num_experts // groups < 2:
            raise ValueError(
                "LlamaConfig: an expert group is scored by its best two experts; groups need two or more"
            )
        if chosen * (self.num_experts // groups) < self.num_experts_per_tok:
            raise ValueError(
                f"LlamaConfig: topk_expert_groups ({chosen}) groups hold fewer experts than "
                f"num_experts_per_tok ({self.num_experts_per_tok})"
            )
        if self.router_score_bias and self.router_scoring != "sigmoid":
            raise ValueError("LlamaConfig.router_score_bias needs router_scoring 'sigmoid'")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """What the scores q . k are multiplied by before the softmax; for latent attention with
        YaRN, times the square of its mscale_all_dim correction (as DeepSeek-V3 does). (YaRN's
        attention factor is not here: it scales the rotated dims only, in rotary.py `apply_rope`.)"""
        scale = 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)
        rope = self.rope_scaling
        if self.kv_lora_rank and rope is not None and rope.rope_type == "yarn" and rope.mscale_all_dim:
            scale *= rope.yarn_mscale(rope.mscale_all_dim) ** 2
        return scale

    @property
    def rotary_factor(self) -> float:
        """What cos and sin are multiplied by in every layer: yarn's attention factor, else 1 (one
        value for all layers: yarn with local_rope_theta is refused)."""
        return 1.0 if self.rope_scaling is None else self.rope_scaling.rotary_factor

    @property
    def cache_key_dim(self) -> int:
        """Width of one cached key entry: head_dim, or latent attention's latent and rotary key."""
        return self.kv_lora_rank + self.rotary_dim if self.kv_lora_rank else self.head_dim

    @property
    def cache_value_dim(self) -> int:
        """Width of one cached value entry: head_dim, or 0 under latent attention, whose values
        are read from the latent in the key entries."""
        return 0 if self.kv_lora_rank else self.head_dim

    @property
    def cache_token_size(self) -> int:
        """Cached numbers per token and layer: 2 * kv_size, or latent + rotary key (one copy)."""
        return self.num_kv_heads * (self.cache_key_dim + self.cache_value_dim)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None where it attends to every earlier position."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(rotary base, scaling) of `layer`: sliding layers of a model with `local_rope_theta`
        (Gemma 3) use that base unscaled, every other layer `rope_theta` and `rope_scaling`."""
        if self.local_rope_theta is not None and self.layer_window(layer) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def has_window(self) -> bool:
        return any(self.layer_window(i) is not None for i in range(self.num_layers))
