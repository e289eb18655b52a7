"""RMSNorm in each family's form, and `Norm`: a norm handed to the backend seam with the product
that follows it, which may compute it inside its kernel (specjax/kernels/backend.py, `project`).

Einsum letters: D the normed axis (hidden, or a head dim).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.models.config import LlamaConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, form: str = "rms") -> jax.Array:
    """RMSNorm over the last axis, its statistics in float32. `form` "rms" (Llama) casts the
    normalized x back to x's dtype and then scales by w; "gemma" scales by 1 + w in float32 and
    casts after, each as its family's reference does (the two round differently in bfloat16)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if form == "gemma":
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    if form == "rms_float32":
        return (normed * weight.astype(jnp.float32)).astype(x.dtype)
    return (weight * normed.astype(x.dtype)).astype(x.dtype)


def apply_norm(config: LlamaConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., D] normed by `weight` [D] in the config's form and epsilon."""
    return rms_norm(x, weight, config.rms_norm_eps, config.norm)


@dataclasses.dataclass(frozen=True, eq=False)
class Norm:
    """An RMSNorm to apply to a product's input: what model code hands the backend seam with the
    product (`products.project`), so that a kernel that computes it inside its call may (the CPU's
    panel kernels, for the forms `specjax.kernels.AROUND_NORMS` names); otherwise the seam calls
    it before the product."""

    weight: jax.Array  # [D]
    eps: float
    form: str = "rms"  # as `rms_norm` takes it

    @classmethod
    def of(cls, config: LlamaConfig, weight: jax.Array) -> Norm:
        """The config's norm with `weight`."""
        return cls(weight, config.rms_norm_eps, config.norm)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight, self.eps, self.form)
