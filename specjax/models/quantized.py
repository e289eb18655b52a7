"""Weight-only quantization: a projection weight kept as small integers with per-group scales.

One layout serves every format specjax reads or makes (`QuantizedWeight`): a weight W [D_in, D_out]
(the `x @ W` orientation of every projection here) is split along D_in into groups of `group`
consecutive input rows, and

    W[i, o] = q[i, o] * scales[i // group, o] + offsets[i // group, o]      (offsets None: 0)

- bits 8: q is int8 [D_in, D_out], signed, no offsets (symmetric). GGUF Q8_0 (groups of 32),
  GGUF Q6_K (q - 32 in -32..31, groups of 16, each group's scale the block's d times its 8-bit
  sub-scale) and "int8" (one group: a scale per output channel).
- bits 4: q is 0..15, two input rows per byte, `values` uint8 [D_in // 2, D_out]: row 2i in the
  low nibble, row 2i + 1 in the high one; offsets always set. GGUF Q4_0 (scale d, offset -8 d),
  Q4_1 (scale d, offset m), Q4_K (groups of 32, scale d * sc, offset -dmin * m) and "int4" (groups
  of 32 or 128, offset -zero * scale).

The integers are the file's own; the scales of a two-level format (K-quants) are multiplied out at
load, exactly in float32 (a float16 times a 6- or 8-bit integer). Activations, norms, softmax and
sampling stay in float: only the products read the integers (specjax/kernels/backend.py).

A stacked layer (models/llama.py, LayerStack) carries a leading axis on every field.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

BITS = (8, 4)


@flax.struct.dataclass
class QuantizedWeight:
    """A weight [D_in, D_out] as integers with per-group scales (see the module docstring)."""

    values: jax.Array  # bits 8: int8 [..., D_in, D_out]; bits 4: uint8 [..., D_in // 2, D_out]
    scales: jax.Array  # float32 [..., D_in // group, D_out]
    offsets: jax.Array | None  # float32 [..., D_in // group, D_out], or None (bits 8 only)
    bits: int = flax.struct.field(pytree_node=False)
    group: int = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape, [..., D_in, D_out]."""
        *lead, rows, d_out = self.values.shape
        return (*lead, rows * (8 // self.bits), d_out)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype its products run in: its scales'."""
        return self.scales.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(self))


def unpack_values(w: QuantizedWeight) -> jax.Array:
    """q [..., D_in, D_out] as int8 (4-bit values unpacked, 0..15)."""
    if w.bits == 8:
        return w.values
    low = (w.values & 0xF).astype(jnp.int8)
    high = (w.values >> 4).astype(jnp.int8)
    *lead, half, d_out = w.values.shape
    return jnp.stack([low, high], axis=-2).reshape(*lead, 2 * half, d_out)


def dequantize(w: QuantizedWeight, dtype=None) -> jax.Array:
    """W [..., D_in, D_out] in float (its scales' dtype unless `dtype` is given)."""
    q = unpack_values(w).astype(w.scales.dtype)
    *lead, d_in, d_out = q.shape
    q = q.reshape(*lead, d_in // w.group, w.group, d_out)
    out = q * w.scales[..., :, None, :]
    if w.offsets is not None:
        out = out + w.offsets[..., :, None, :]
    out = out.reshape(*lead, d_in, d_out)
    return out if dtype is None else out.astype(dtype)
