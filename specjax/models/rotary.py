"""Rotary position embeddings: each layer's inverse frequencies (its base; HF's "linear",
"llama3" and YaRN scalings) and the rotation of queries and keys by them.

Einsum letters: B batch, T new tokens, N heads, E head dim, R rotary dims (E, or fewer for a
partial rotary).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import LlamaConfig


def rope_inverse_frequencies(config: LlamaConfig, layer: int = 0) -> np.ndarray:
    """[R/2] float64 inverse frequencies of layer `layer` (R = config.rotary_dim), with its base and
    HF's "linear" or "llama3" scaling applied (see LlamaConfig.layer_rope)."""
    R = config.rotary_dim
    theta, scaling = config.layer_rope(layer)
    inv_freq = 1.0 / (theta ** (np.arange(0, R, 2, dtype=np.float64) / R))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(inv_freq, theta, R, scaling)
    # llama3: leave high frequencies alone, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(middle, blended, out)


def _yarn_inverse_frequencies(inv_freq: np.ndarray, theta: float, R: int, scaling) -> np.ndarray:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor`, those that turn more than `beta_fast` times are kept, and a
    linear ramp over the dimension index blends the two in between, as transformers'
    `_compute_yarn_parameters`. (Its attention factor scales cos and sin: `apply_rope`.)"""

    def dimension(turns):  # the index whose frequency turns `turns` times over the original context
        original = scaling.original_max_position_embeddings
        return R * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / scaling.factor * ramp + inv_freq * (1.0 - ramp)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> jax.Array:
    """Rotate x [B, T, N, E] by positions [B, T], in HF's half-split (rotate_half) layout, cos and
    sin times `factor` (YaRN's attention factor, config.rotary_factor: as transformers does, so
    that only the rotated dims are scaled). With fewer frequencies than E/2 (a partial rotary),
    only the first 2 * len(inv_freq) dims turn."""
    R = 2 * len(inv_freq)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [B, T, R/2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    # (x1 cos - x2 sin, x2 cos + x1 sin) written as x cos' + roll(x) sin': XLA:CPU ran the
    # concatenation of the two computed halves 13 times slower (60 small fusions in a decoding
    # step: 1.4 ms of an 8-row step of SmolLM2, 0.15 ms this way). The same products and sums,
    # though XLA may contract them into FMAs differently: within a rounding of the other form.
    cos, sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
    turning = x[..., :R].astype(jnp.float32)
    rotated = (turning * cos + jnp.roll(turning, R // 2, axis=-1) * sin).astype(x.dtype)
    return rotated if R == x.shape[-1] else jnp.concatenate([rotated, x[..., R:]], axis=-1)
