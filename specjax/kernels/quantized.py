"""The CPU decoding kernel for quantized weights: int8 and 4-bit values in column panels.

Decoding on the CPU is bound by the bytes of weight it streams per step. A QuantizedWeight (its
layout below; specjax/models/quantized.py maps each format onto it) is a quarter of a float32
weight at 8 bits and an eighth at 4 (plus its scales and offsets); `quant_matmul.cc` reads it in
panels of 16 output columns, front to back, as `panel_matmul.cc` reads float32 panels, and never
writes a float copy: each 16-byte row of a panel widens to floats in registers and is multiplied
into every row of x.

`QuantizedPanelWeight` is that layout; `pack_quantized` makes it from a QuantizedWeight and
`unpack_quantized` gives the QuantizedWeight back. The kernels load with the float32 ones
(specjax.kernels.available); the backend seam sends a QuantizedPanelWeight to
`quantized_panel_matmul`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import kernels

PANEL = kernels.PANEL

BITS = (8, 4)


@flax.struct.dataclass
class QuantizedWeight:
    """A weight [D_in, D_out] as integers with per-group scales along D_in: W[i, o] = q[i, o] *
    scales[i // group, o] + offsets[i // group, o] (specjax/models/quantized.py maps each format
    onto it). The layout lives here, beside the kernel that packs it, so that every layer may
    hold one."""

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


@flax.struct.dataclass
class QuantizedPanelWeight:
    """A QuantizedWeight [D_in, D_out] as column panels, P = ceil(D_out / 16): panel p holds
    columns 16p .. 16p+15 (the last one padded with zero values, scales and offsets).

    values: bits 8: int8 [P, D_in, 16], one 16-byte row per input row; bits 4: uint8
    [P, D_in // 2, 16], one 16-byte row per pair of input rows (2i in the low nibble, 2i + 1 in
    the high one, as in QuantizedWeight). scales and offsets: float32 [P, D_in // group, 16]."""

    values: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    bits: int = flax.struct.field(pytree_node=False)
    group: int = flax.struct.field(pytree_node=False)
    d_out: int = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[1] * (8 // self.bits), self.d_out)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype its products run in."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))


def pack_quantized(w: QuantizedWeight) -> QuantizedPanelWeight:
    """A QuantizedWeight [D_in, D_out] as panels (a copy; see QuantizedPanelWeight). Scales and
    offsets become float32."""
    if w.bits not in (8, 4) or len(w.values.shape) != 2:
        raise ValueError(
            f"pack_quantized: a 2-D weight of 8 or 4 bits is needed, got bits {w.bits} and values "
            f"of shape {tuple(w.values.shape)}"
        )
    d_in, d_out = w.shape
    if w.group < 1 or d_in % w.group or (w.bits == 4 and w.group % 2):
        raise ValueError(
            f"pack_quantized: group {w.group} does not divide D_in {d_in} into groups"
            + (" of an even size (4-bit values pair input rows)" if w.bits == 4 else "")
        )
    num_panels = -(-d_out // PANEL)

    def panels(a, dtype):  # [rows, D_out] -> [P, rows, 16]
        a = jnp.pad(jnp.asarray(a, dtype), ((0, 0), (0, num_panels * PANEL - d_out)))
        return a.reshape(a.shape[0], num_panels, PANEL).transpose(1, 0, 2)

    values_dtype = jnp.int8 if w.bits == 8 else jnp.uint8
    return QuantizedPanelWeight(
        values=panels(w.values, values_dtype),
        scales=panels(w.scales, jnp.float32),
        offsets=None if w.offsets is None else panels(w.offsets, jnp.float32),
        bits=w.bits,
        group=w.group,
        d_out=d_out,
    )


def unpack_quantized(w: QuantizedPanelWeight) -> QuantizedWeight:
    """The QuantizedWeight back from its panels (float32 scales and offsets)."""

    def columns(a):  # [P, rows, 16] -> [rows, D_out]
        return a.transpose(1, 0, 2).reshape(a.shape[1], -1)[:, : w.d_out]

    offsets = None if w.offsets is None else columns(w.offsets)
    return QuantizedWeight(columns(w.values), columns(w.scales), offsets, bits=w.bits, group=w.group)


def quantized_panel_matmul(x: jax.Array, w: QuantizedPanelWeight) -> jax.Array:
    """x [..., D_in] @ w: [..., D_out], through the kernel; computed and returned in float32."""
    kernels._require()
    d_in = w.shape[0]
    if x.shape[-1] != d_in:
        raise ValueError(f"quantized_panel_matmul: x has {x.shape[-1]} features, the weight {d_in}")
    rows = x.reshape(-1, d_in).astype(jnp.float32)
    target = f"specjax_quant_matmul_int{w.bits}" + ("" if w.offsets is None else "_offsets")
    operands = [rows, w.values, w.scales] + ([] if w.offsets is None else [w.offsets])
    out_type = jax.ShapeDtypeStruct((rows.shape[0], w.values.shape[0] * PANEL), jnp.float32)
    out = jax.ffi.ffi_call(target, out_type, vmap_method="sequential")(*operands)
    return out[:, : w.d_out].reshape(*x.shape[:-1], w.d_out)
