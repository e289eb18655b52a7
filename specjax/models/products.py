"""The products model code makes, asked of the backend seam (specjax/kernels/backend.py).

Model code multiplies weights only through these, so it never knows how a weight is stored: an
array, a quantized weight, or panels for the CPU kernels (specjax/kernels/layouts.py). It says
what the maths is (the norm before a product, the residual and the tensor-parallel sum after it);
the active backend decides how to compute it, a kernel doing the norm and the residual inside
its call where it can.

Einsum letters: N rows, D_in and D_out a product's input and output features, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from specjax.kernels import backend
from specjax.models.norms import Norm


def project(
    x: jax.Array,
    w,
    norm: Norm | None = None,
    residual: jax.Array | None = None,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """residual + reduce(norm(x) @ w): x [..., D_in], w [D_in, D_out], the residual [..., D_out];
    `reduce` the sum over a tensor-parallel split of the partial products (None: no split).
    Each part optional (`Backend.project`)."""
    return backend.active().project(x, w, norm, residual, reduce)


def gated_projections(x: jax.Array, gate, up, norm: Norm | None = None) -> tuple[jax.Array, jax.Array]:
    """(norm(x) @ gate, norm(x) @ up): a gated MLP's two products over x [..., D]
    (`Backend.gated_projections`)."""
    return backend.active().gated_projections(x, gate, up, norm)


def head_logits(rows: jax.Array, params) -> jax.Array:
    """rows [N, D] times the LM head of `params` (a LlamaParams: its own head, or the tied
    embedding): [N, V] float32 (`Backend.logits`)."""
    return backend.active().logits(rows, params)
