"""IBM's MLP speculator (Wertheimer et al. 2024, arXiv 2404.19124; vLLM's `mlp_speculator`) as
pure functions over a params pytree.

A chain of n_predict stages, each a small MLP step over a running state. The first state is the
target's final-normed hidden state h_t (the input of its LM head) and the first token x_{t+1},
the one the target predicted from h_t; stage i drafts token t + 2 + i and hands its state and its
token to stage i + 1:

    s_0 = h_t                       (scale_input: s_0 = rms_norm(h_t) / sqrt(2), no weights)
    s_{i+1} = gelu(norm_i(proj_i(s_i) + (emb_weight / state_weight) * emb_i[x_{t+1+i}]))
    logits_i = head_i(s_{i+1})

norm_i is what the authors call a layer norm: y / sqrt(mean(y^2) + 1e-6) * w_i + b_i, an RMS
norm with a bias (no mean is subtracted). gelu is the exact (erf) one. state_weight =
0.5^(0.5 / n_predict) and emb_weight = sqrt((1 - state_weight^2) * inner_dim / 2) are fixed by
the config, not learned. proj_0 maps the target's width (emb_dim) to the speculator's
(inner_dim); the others are inner_dim square. With tie_weights every stage shares emb, head and
norm, and stages 1.. share one proj (proj_0 stays apart: its input is the target's width).

Einsum letters: B batch, E the target's hidden size (emb_dim), I inner_dim, V vocab, S stored
stages (n_predict, or 1 when tied).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.checks import check_int
from specjax.models.model import Model
from specjax.models.signature import check_signature, target_signature

NORM_EPS = 1e-6  # the authors' MLPSpeculatorLayerNorm default, for ln0 and every stage's norm


@dataclasses.dataclass(frozen=True)
class MLPSpeculatorConfig:
    """Static shape of an MLP speculator (the published config.json's fields of the same names;
    inner_dim 0 there means emb_dim)."""

    emb_dim: int  # the target's hidden size
    inner_dim: int
    vocab_size: int
    n_predict: int
    tie_weights: bool = False
    scale_input: bool = False

    def __post_init__(self):
        for name in ("emb_dim", "inner_dim", "vocab_size", "n_predict"):
            check_int(f"MLPSpeculatorConfig {name}", getattr(self, name), 1)
        for name in ("tie_weights", "scale_input"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MLPSpeculatorConfig {name} must be a bool, got {getattr(self, name)!r}")
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("MLPSpeculatorConfig tie_weights needs n_predict >= 2 (stages to tie), got 1")

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight**2) * (self.inner_dim / 2))

    @property
    def stored_stages(self) -> int:
        """Stages with weights of their own (emb, head, norm): 1 when tied."""
        return 1 if self.tie_weights else self.n_predict

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        S, E, I, V = self.stored_stages, self.emb_dim, self.inner_dim, self.vocab_size
        later = 1 if self.tie_weights else self.n_predict - 1
        return {
            "emb": (S, V, I),
            "proj_first": (E, I),
            "proj": (later, I, I),
            "head": (S, I, V),
            "ln_weight": (S, I),
            "ln_bias": (S, I),
        }


@flax.struct.dataclass
class MLPSpeculatorParams:
    emb: jax.Array  # [S, V, I]
    proj_first: jax.Array  # [E, I]: stage 0's projection from the target's width
    proj: jax.Array  # [n_predict - 1 (1 when tied), I, I]: later stages'
    head: jax.Array  # [S, I, V]
    ln_weight: jax.Array  # [S, I]
    ln_bias: jax.Array  # [S, I]


def init_mlp_speculator(config: MLPSpeculatorConfig, key: jax.Array) -> MLPSpeculatorParams:
    """Fresh params as the authors initialise them: embeddings and projections N(0, 1/inner_dim),
    norm weights 1 and biases 0."""
    shapes = config.param_shapes()
    keys = dict(zip(("emb", "proj_first", "proj", "head"), jax.random.split(key, 4), strict=True))
    scale = 1 / math.sqrt(config.inner_dim)
    arrays = {name: scale * jax.random.normal(k, shapes[name], jnp.float32) for name, k in keys.items()}
    arrays["ln_weight"] = jnp.ones(shapes["ln_weight"], jnp.float32)
    arrays["ln_bias"] = jnp.zeros(shapes["ln_bias"], jnp.float32)
    return MLPSpeculatorParams(**arrays)


def _rms(x: jax.Array) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, statistics in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS)


def first_state(config: MLPSpeculatorConfig, hidden: jax.Array) -> jax.Array:
    """The target's hidden states [..., E] -> stage 0's input state (ln0 and 1/sqrt(2) with
    scale_input)."""
    return _rms(hidden) / math.sqrt(2) if config.scale_input else hidden


def mlp_stage(
    params: MLPSpeculatorParams, config: MLPSpeculatorConfig, i: int, state: jax.Array, tokens: jax.Array
) -> jax.Array:
    """Stage i (static): state [..., E] (i = 0) or [..., I] and the tokens [...] that followed it ->
    the next state [..., I] (float32)."""
    s = 0 if config.tie_weights else i
    proj = params.proj_first if i == 0 else params.proj[0 if config.tie_weights else i - 1]
    projected = jnp.einsum(
        "...e,ei->...i", state.astype(proj.dtype), proj, preferred_element_type=jnp.float32
    )
    embedded = params.emb[s][tokens].astype(jnp.float32)  # [..., I]
    mixed = projected + (config.emb_weight / config.state_weight) * embedded
    normed = _rms(mixed) * params.ln_weight[s].astype(jnp.float32) + params.ln_bias[s].astype(jnp.float32)
    return jax.nn.gelu(normed, approximate=False)


def mlp_stage_logits(
    params: MLPSpeculatorParams, config: MLPSpeculatorConfig, i: int, state: jax.Array
) -> jax.Array:
    """Stage i's head: its output state [..., I] -> logits [..., V], float32."""
    head = params.head[0 if config.tie_weights else i]
    return jnp.einsum("...i,iv->...v", state.astype(head.dtype), head, preferred_element_type=jnp.float32)


def mlp_speculator_logits(
    params: MLPSpeculatorParams, config: MLPSpeculatorConfig, hidden: jax.Array, tokens: jax.Array
) -> jax.Array:
    """Every stage fed given tokens (teacher forcing): hidden [..., E] (h_t), tokens [..., n] with
    n <= n_predict (x_{t+1} .. x_{t+n}) -> logits [..., n, V] float32, stage i's for x_{t+2+i}."""
    state = first_state(config, hidden)
    logits = []
    for i in range(tokens.shape[-1]):
        state = mlp_stage(params, config, i, state, tokens[..., i])
        logits.append(mlp_stage_logits(params, config, i, state))
    return jnp.stack(logits, axis=-2)


@dataclasses.dataclass(frozen=True, eq=False)
class MLPSpeculatorHead:
    """An MLP speculator and the target it belongs to: `target` is `target_signature` of that
    model for one trained here ({} for a published one, checked by its widths only); `meta`
    records how it was made."""

    config: MLPSpeculatorConfig
    params: MLPSpeculatorParams
    target: dict = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        shapes = self.config.param_shapes()
        for name, shape in shapes.items():
            got = tuple(getattr(self.params, name).shape)
            if got != shape:
                raise ValueError(f"MLPSpeculatorHead params.{name} has shape {got}, the config needs {shape}")

    @classmethod
    def init(
        cls,
        target: Model,
        n_predict: int = 3,
        inner_dim: int | None = None,
        tie_weights: bool = False,
        scale_input: bool = False,
        key: jax.Array | None = None,
        **meta: Any,
    ) -> MLPSpeculatorHead:
        """A fresh speculator for `target` (random, as the authors initialise one); inner_dim
        defaults to the target's hidden size."""
        c = target.config
        inner_dim = c.hidden_size if inner_dim is None else inner_dim
        config = MLPSpeculatorConfig(
            c.hidden_size, inner_dim, c.vocab_size, n_predict, tie_weights, scale_input
        )
        key = jax.random.key(0) if key is None else key
        return cls(config, init_mlp_speculator(config, key), target_signature(target), dict(meta))

    def check_target(self, model: Model) -> None:
        """Refuse a model the speculator does not belong to, naming both widths."""
        c = model.config
        if (c.hidden_size, c.vocab_size) != (self.config.emb_dim, self.config.vocab_size):
            raise ValueError(
                f"MLP speculator is for hidden size (emb_dim) {self.config.emb_dim} and vocab "
                f"{self.config.vocab_size}, the target {model.name!r} has {c.hidden_size} and {c.vocab_size}"
            )
        if self.target:
            check_signature("MLP speculator", self.target, model, "specjax.train.train_mlp_speculator")
