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

import math

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

    # bits 8: int8 [..., D_in, D_out], or float8_e4m3fn (FP8, `is_fp8`); bits 4: uint8
    # [..., D_in // 2, D_out]
    values: jax.Array
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


def is_fp8(w) -> bool:
    """Whether w is a QuantizedWeight of FP8 values (float8_e4m3fn, scaled like int8's)."""
    return isinstance(w, QuantizedWeight) and w.values.dtype == jnp.float8_e4m3fn


def unpack_values(w: QuantizedWeight) -> jax.Array:
    """q [..., D_in, D_out] as int8 (4-bit values unpacked, 0..15), or FP8's float8 values."""
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
    groups = w.scales.shape[-2]  # (from the shapes: a device's slice of a row split has fewer)
    q = q.reshape(*lead, groups, d_in // groups, d_out)
    out = q * w.scales[..., :, None, :]
    if w.offsets is not None:
        out = out + w.offsets[..., :, None, :]
    out = out.reshape(*lead, d_in, d_out)
    return out if dtype is None else out.astype(dtype)


PRODUCT_FORMS = ("dequantize", "grouped", "in_product")


def xla_product(x: jax.Array, w: QuantizedWeight, out_dtype=None, form: str = "dequantize") -> jax.Array:
    """x [..., D_in] @ W [D_in, D_out]: [..., D_out] in `out_dtype` (default x's dtype),
    accumulated in float32. Three ways to write it for XLA, equal up to float32 summation order:

    - "dequantize": W = q * scales + offsets in float, then one product (`dequantize`).
    - "grouped": per group g the product with the integers, scaled after: out = sum_g
      scales[g] * (x_g @ q_g) + (sum_i x_g) @ offsets. Its intermediate is [N, D_in / group,
      D_out]: larger than the weight itself from `group` rows on (a prefill).
    - "in_product": the integers converted inside the product, the scaling outside it or on
      half as many values. A weight with one group along D_in (int8 with a scale per output
      channel, FP8 likewise) is (x @ q) * scales; a 4-bit weight is two products, the low
      nibbles (the even inputs) against x's even inputs and the high nibbles against its odd
      ones, each half dequantized without interleaving the nibbles. Other weights (int8 in
      groups, as GGUF's Q8_0 and Q6_K) are dequantized as "dequantize" does.

    Measured on an H200 (XLA:GPU, jax 0.11.2, bfloat16 inputs, a [4096, 14336] product chained
    over 8 distinct weights, microseconds at 1 / 8 rows; benchmarks/accelerator_step.py --parts
    products): bfloat16 weights 56 / 71; int8 "dequantize" 159 / 158, "grouped" 106 / 57,
    "in_product" 78 / 54; int4 (groups of 32) "dequantize" 244 / 237, "grouped" 177 / 262,
    "in_product" 143 / 129. XLA:GPU fuses the conversion of the integers into the product but
    not the dequantization's interleaving and scaling, which then writes W in bfloat16 and reads
    it again; hence "in_product" on accelerators (the backend seam's choice). Even so a 4-bit
    product ran at about half the speed of a bfloat16 one there: reading 4 bits a weight at the
    memory's speed needs a kernel of its own.
    Measured on this project's 2-core CPU (XLA:CPU, float32, a [576, 1536] weight, best of 7
    under a shared load; microseconds at 1 / 2 / 6 / 64 / 512 rows): int8 (one group) grouped
    918 / 720 / 1241 / 3858 / 46818, dequantize-then-dot 244 / 352 / 456 / 4025 / 30990; int4
    (groups of 32) grouped 447 / 4341 / 2904 / 6651 / 208262, dequantize-then-dot 332 / 511 / 576 /
    2000 / 26278 (a float32 product: 148 / 319 / 312 / 5129 / 33000). XLA:CPU fuses neither:
    it converts the integers to float first, and the grouped form then runs G small products.
    Dequantize-then-dot is the faster at every size but one there, hence XLA:CPU's form (the
    CPU's own quantized kernels are specjax.kernels', not this).
    """
    if form not in PRODUCT_FORMS:
        raise ValueError(f"xla_product: form must be one of {PRODUCT_FORMS}, got {form!r}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    d_in, d_out = w.shape[-2:]
    if x.shape[-1] != d_in:
        raise ValueError(f"xla_product: x has {x.shape[-1]} features, the weight {d_in} inputs")
    rows = math.prod(x.shape[:-1])
    compute = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    one_group = w.scales.shape[-2] == 1
    if form == "in_product" and w.bits == 8 and one_group and w.offsets is None:
        product = jnp.matmul(x.astype(compute), w.values.astype(compute), preferred_element_type=jnp.float32)
        return (product * w.scales[..., 0, :].astype(jnp.float32)).astype(out_dtype)
    if form == "in_product" and w.bits == 4:
        return _nibble_halves(x.astype(compute), w).astype(out_dtype)
    if form != "grouped":
        product = jnp.matmul(x, dequantize(w, compute), preferred_element_type=jnp.float32)
        return product.astype(out_dtype)
    groups = w.scales.shape[-2]
    flat = x.reshape(rows, groups, d_in // groups).astype(compute)  # [N, G, g]
    q = unpack_values(w).astype(compute).reshape(groups, d_in // groups, d_out)  # [G, g, O]
    partial = jnp.einsum("ngi,gio->ngo", flat, q, preferred_element_type=jnp.float32)  # [N, G, O]
    out = jnp.einsum("ngo,go->no", partial, w.scales.astype(jnp.float32))
    if w.offsets is not None:
        sums = jnp.sum(flat.astype(jnp.float32), axis=-1)  # [N, G]
        out = out + sums @ w.offsets.astype(jnp.float32)
    return out.reshape(*x.shape[:-1], d_out).astype(out_dtype)


FP8_MAX = 448.0  # the largest float8_e4m3fn


def fp8_product(x: jax.Array, w: QuantizedWeight, out_dtype=None) -> jax.Array:
    """x [..., D_in] @ W for FP8 values (`is_fp8`) as FP8 products: [..., D_out] in `out_dtype`
    (default x's dtype), accumulated in float32. The activations are scaled to e4m3 at run time
    per row and per group of the weight's inputs (the "dynamic" activation scheme of the FP8
    releases, DeepSeek-V3's 1 x 128 activation tiles beside its 128 x 128 weight blocks): each
    group of a row divided by max |x| / 448 and rounded to float8_e4m3fn. Then one f8 x f8
    product per group with float32 accumulation (a batched dot_general over the groups, or a
    plain one for a weight with one group), each group's partial product times its row's scale
    and the weight's column scales, summed over the groups. XLA:GPU gives f8 dots to cuBLASLt's
    FP8 matmuls on GPUs that have them (the backend seam asks for this form there only,
    `Backend.fp8_products`); it differs from the dequantized product by the rounding of x to
    e4m3 (3 mantissa bits)."""
    if not is_fp8(w):
        raise ValueError(f"fp8_product: FP8 values are needed, got {w.values.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    d_in, d_out = w.shape[-2:]
    if x.shape[-1] != d_in or len(w.values.shape) != 2:
        raise ValueError(
            f"fp8_product: x [..., {d_in}] and a 2-D weight are needed, got x {x.shape}, values "
            f"{w.values.shape}"
        )
    groups = w.scales.shape[-2]
    rows = math.prod(x.shape[:-1])
    grouped = x.reshape(rows, groups, d_in // groups).astype(jnp.float32)  # [N, G, g]
    amax = jnp.max(jnp.abs(grouped), axis=-1)  # [N, G]
    row_scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = (grouped / row_scales[..., None]).astype(jnp.float8_e4m3fn)
    values = w.values.reshape(groups, d_in // groups, d_out)  # [G, g, O]
    if groups == 1:
        partial = jnp.matmul(q[:, 0], values[0], preferred_element_type=jnp.float32)[:, None]
    else:
        partial = jnp.einsum("ngi,gio->ngo", q, values, preferred_element_type=jnp.float32)  # [N, G, O]
    scaled = partial * row_scales[..., None] * w.scales.astype(jnp.float32)[None]
    return jnp.sum(scaled, axis=1).reshape(*x.shape[:-1], d_out).astype(out_dtype)


def _nibble_halves(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x @ W (float32) for a 4-bit W: row 2i of W is the low nibble of packed row i, row 2i + 1
    its high nibble, so x @ W = x[even] @ W_low + x[odd] @ W_high; a group of g inputs is g / 2
    rows of each half, whose scales and offsets it shares."""
    *lead, half, d_out = w.values.shape
    groups = w.scales.shape[-2]

    def dequantized(nibbles):  # [..., D_in / 2, D_out] in x's dtype
        q = nibbles.astype(x.dtype).reshape(*lead, groups, half // groups, d_out)
        out = q * w.scales[..., :, None, :].astype(x.dtype)
        if w.offsets is not None:
            out = out + w.offsets[..., :, None, :].astype(x.dtype)
        return out.reshape(*lead, half, d_out)

    low = jnp.matmul(x[..., 0::2], dequantized(w.values & 0xF), preferred_element_type=jnp.float32)
    return low + jnp.matmul(x[..., 1::2], dequantized(w.values >> 4), preferred_element_type=jnp.float32)


@flax.struct.dataclass
class QuantizedPanelWeight:
    """A QuantizedWeight [D_in, D_out] as column panels, P = ceil(D_out / 16): panel p holds
    columns 16p .. 16p+15 (the last one padded with zero values, scales and offsets).

    values: bits 8: int8 [P, D_in, 16], one 16-byte row per input row; bits 4: uint8
    [P, D_in // 2, 16], one 16-byte row per pair of input rows (2i in the low nibble, 2i + 1 in
    the high one, as in QuantizedWeight). scales and offsets: [P, D_in // group, 16], float16
    where every one of them is a float16 exactly (GGUF's Q8_0, Q4_0 and Q4_1 store theirs so),
    else float32: decoding reads every byte once per step, and a Q4_1 weight's float32 scales and
    offsets were a third of its bytes (24 per 32 values, 20 with float16, as in the file)."""

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
    offsets become float16 where each of them is one exactly (checked on concrete arrays; traced
    ones stay float32), else float32. FP8 values have no kernel here (specjax/kernels/layouts.py,
    `pack_panels`)."""
    if is_fp8(w):
        raise ValueError("pack_quantized: FP8 values have no quantized CPU kernel; pack them dequantized")
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
    meta = [a for a in (w.scales, w.offsets) if a is not None]
    meta_dtype = jnp.float16 if all(_exactly_float16(a) for a in meta) else jnp.float32
    return QuantizedPanelWeight(
        values=panels(w.values, values_dtype),
        scales=panels(w.scales, meta_dtype),
        offsets=None if w.offsets is None else panels(w.offsets, meta_dtype),
        bits=w.bits,
        group=w.group,
        d_out=d_out,
    )


def _exactly_float16(a) -> bool:
    """Whether every value of `a` is a float16 exactly (False for a traced array)."""
    if isinstance(a, jax.core.Tracer):
        return False
    a = np.asarray(a, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def unpack_quantized(w: QuantizedPanelWeight) -> QuantizedWeight:
    """The QuantizedWeight back from its panels (float32 scales and offsets)."""

    def columns(a):  # [P, rows, 16] -> [rows, D_out]
        return a.transpose(1, 0, 2).reshape(a.shape[1], -1)[:, : w.d_out]

    offsets = None if w.offsets is None else columns(w.offsets).astype(jnp.float32)
    scales = columns(w.scales).astype(jnp.float32)
    return QuantizedWeight(columns(w.values), scales, offsets, bits=w.bits, group=w.group)


def quantized_panel_matmul(
    x: jax.Array,
    w: QuantizedPanelWeight,
    norm: tuple[jax.Array, float] | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """x [..., D_in] @ w: [..., D_out], through the kernel; computed and returned in float32.
    `norm` (weight [D_in], eps) and `residual` [..., D_out]: see `specjax.kernels.around`."""
    kernels.require()
    d_in = w.shape[0]
    if x.shape[-1] != d_in:
        raise ValueError(f"quantized_panel_matmul: x has {x.shape[-1]} features, the weight {d_in}")
    rows = x.reshape(-1, d_in).astype(jnp.float32)
    target = f"specjax_quant_matmul_int{w.bits}" + ("" if w.offsets is None else "_offsets")
    extra, eps = kernels.around(rows.shape[0], d_in, w.d_out, norm, residual)
    operands = [rows, w.values, w.scales] + ([] if w.offsets is None else [w.offsets]) + extra
    out_type = jax.ShapeDtypeStruct((rows.shape[0], w.values.shape[0] * PANEL), jnp.float32)
    out = jax.ffi.ffi_call(target, out_type, vmap_method="sequential")(*operands, eps=eps)
    return out[:, : w.d_out].reshape(*x.shape[:-1], w.d_out)
