"""The online softmax that every blocked attention here runs: fold one block of scores at a time
into a running max m, a running sum l of exp(score - m) and an unnormalized output acc."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

# A finite stand-in for minus infinity in dropped scores: the running max then never computes
# inf - inf. Dropped scores also get weight 0 explicitly, so a block with nothing visible adds
# nothing whatever the running max is.
NEG = -0.7 * float(np.finfo(np.float32).max)
LANES = 128  # TPU vector lane width: TPU kernels keep m and l replicated across one row of lanes


def precision(dtype):
    """Float32 operands multiply at full float32 precision (not TF32 or one bfloat16 pass), so
    that every implementation computes what the CPU kernel does; bfloat16 ones as they are."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _matmul(probs, values):
    return jnp.dot(probs, values, precision=precision(values.dtype), preferred_element_type=jnp.float32)


def online_softmax(m, l, acc, scores, keep, values, *, lanes: bool = False, product=_matmul):
    """One block: scores [..., M, C] float32, kept where `keep` (broadcasts against them),
    values [..., C, E]; m and l [..., M] (or [..., M, LANES] lane-replicated, `lanes`), acc
    [..., M, E] float32. Returns the updated (m, l, acc). `product(probs, values)` multiplies
    probabilities (cast to the values' dtype) by values with float32 accumulation."""
    column = (lambda x: x[..., :1]) if lanes else (lambda x: x[..., None])  # noqa: E731
    scores = jnp.where(keep, scores, NEG)
    m_next = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=lanes))
    probs = jnp.where(keep, jnp.exp(scores - column(m_next)), 0.0)
    alpha = jnp.exp(m - m_next)  # rescales what was summed under the old max
    l_next = alpha * l + jnp.sum(probs, axis=-1, keepdims=lanes)
    return m_next, l_next, column(alpha) * acc + product(probs.astype(values.dtype), values)


def normalized(l, acc, *, lanes: bool = False):
    """acc / l, with 0 where a row kept nothing (l = 0); l [..., M] (or lane-replicated
    [..., M, LANES], `lanes`), acc [..., M, E]."""
    column = l[..., :1] if lanes else l[..., None]
    return jnp.where(column > 0, acc / jnp.where(column > 0, column, 1.0), 0.0)
