"""Sampling options and logit warping: the one place where temperature, top-k, top-p and min-p
turn logits into the distribution a token is drawn from. Target and draft use the same code, so
a draft's `q` and the target's `p` are warped alike, as lossless verification requires.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick tokens. temperature 0 is greedy (argmax); the filters then do nothing.

    Filters apply in HF transformers' order: temperature, then top-k (0 = off), then top-p
    (nucleus; 1.0 = off), then min-p (drop tokens below min_p times the top probability; 0 = off).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"Sampling temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"Sampling top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"Sampling top_p must be in (0, 1] (1 disables it), got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m <= 1:
            raise ValueError(f"Sampling min_p must be in [0, 1] (0 disables it), got {m!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class WarpSpec:
    """The static part of sampling: which code paths the compiled program needs."""

    greedy: bool = True
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False

    @classmethod
    def of(cls, sampling: Sampling) -> WarpSpec:
        if sampling.greedy:
            return cls(greedy=True)
        return cls(greedy=False, top_k=sampling.top_k > 0, top_p=sampling.top_p < 1, min_p=sampling.min_p > 0)


@flax.struct.dataclass
class SamplingParams:
    """The dynamic part, one value per row ([B] arrays): changing a value never recompiles."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def of(cls, sampling: Sampling, batch_size: int) -> SamplingParams:
        def full(value, dtype):
            return jnp.full((batch_size,), value, dtype)

        return cls(
            temperature=full(sampling.temperature, jnp.float32),
            top_k=full(sampling.top_k, jnp.int32),
            top_p=full(sampling.top_p, jnp.float32),
            min_p=full(sampling.min_p, jnp.float32),
        )


def _per_row(values: jax.Array, like: jax.Array) -> jax.Array:
    """Reshape [B] values to broadcast against `like` [B, ..., V]."""
    return values.reshape(values.shape + (1,) * (like.ndim - 1))


def warp_logits(logits: jax.Array, params: SamplingParams, spec: WarpSpec) -> jax.Array:
    """Log-probabilities [B, ..., V] of the warped distribution; filtered tokens get -inf.

    Not for greedy decoding (there the argmax of the raw logits is the token).
    """
    logits = logits.astype(jnp.float32) / _per_row(params.temperature, logits)
    if spec.top_k or spec.top_p:
        sorted_desc = -jnp.sort(-logits, axis=-1)
        rank = jnp.arange(logits.shape[-1])
        keep_sorted = jnp.ones(sorted_desc.shape, bool)
        if spec.top_k:
            k = _per_row(params.top_k, logits)
            keep_sorted = (k == 0) | (rank < k)
        if spec.top_p:
            probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_desc, -jnp.inf), axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            # Keep the smallest prefix holding top_p of the mass; the top token always stays.
            keep_sorted &= (mass_before < _per_row(params.top_p, logits)) | (rank == 0)
        # The smallest kept logit is the threshold; ties with it stay in, as in HF transformers.
        threshold = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    if spec.min_p:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        top = jnp.max(log_probs, axis=-1, keepdims=True)
        min_p = _per_row(params.min_p, logits)
        logits = jnp.where(log_probs >= top + jnp.log(min_p), logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def sample_tokens(key: jax.Array, logits: jax.Array, params: SamplingParams, spec: WarpSpec) -> jax.Array:
    """Draw one token per position: logits [B, ..., V] -> int32 [B, ...]."""
    if spec.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp_logits(logits, params, spec), axis=-1).astype(jnp.int32)
