"""Weight-only quantized products for accelerators: Pallas kernels that read a QuantizedWeight's
integers once and unpack them in registers, for TPU (Mosaic) and GPU (Triton).

A decoding step is bound by the bytes of weight it reads. XLA:GPU converts int8 inside a product
but writes a 4-bit weight's unpacked, scaled copy to memory and reads it again
(specjax/kernels/quantized.py, `xla_product`, measured there); these kernels never do. Each
program loads a tile of the stored values (int8 [block_in, block_out], or for 4 bits the packed
bytes of 2 x block_in inputs), widens them to float32, applies each group's scale (and offset)
to the tile, and multiplies it into its rows of x with float32 accumulation. Only x, the scales
and the output beside the weight cross memory.

Layouts read (the QuantizedWeight's own, specjax/models/quantized.py; nothing is repacked):

- bits 8: int8 values [D_in, D_out]; scales [G, D_out], G = D_in / group: one group (int8, a scale
  per output channel: applied once to the accumulated product) or groups of `group` inputs (GGUF
  Q8_0: 32, Q6_K: 16, as they load; each tile scaled before its product).
- bits 4: packed row i holds input 2i in its low nibble and 2i + 1 in its high one (GGUF Q4_0,
  Q4_1 and Q4_K load into it, as do "int4"'s groups of 32 and 128); scales and offsets [G, D_out].
  The kernels do not interleave the nibbles back: x is split into its even and odd inputs outside
  the kernel (x is a few rows; the split is a strided copy of them), and each tile gives two
  products, x_even @ (low nibbles) + x_odd @ (high nibbles), the two halves of a group sharing its
  scale and offset. The packed bytes arrive as int8 (a bitcast of the stored uint8, no copy):
  Mosaic's unsigned 8-bit support is narrower than its signed one; the nibbles are masked after
  an arithmetic shift, so the sign never reaches them.

Rows: up to DECODE_ROWS (a decoding step, a verify pass of batch x (k + 1) tokens) one block of
rows, padded to the smallest tile the platform multiplies; more (a prefill) in blocks of
PREFILL_ROWS, x padded to a whole number of blocks. TPU grid (row blocks, column blocks, input
blocks), the last a reduction into a float32 VMEM accumulator. GPU grid (row blocks, column
blocks, splits of the inputs): each program loops over its split's input blocks and the splits'
partial sums (float32, [splits, rows, D_out]) are added after the call, so that a product with few
column blocks (a down projection at one row) still keeps every multiprocessor busy. Triton wants
power-of-two tiles: weights whose shapes have none (`unsupported` names why) run XLA's form.

Block sizes are not tuned on hardware yet: no GPU or TPU timing of these kernels exists. The
prepared device run (benchmarks/accelerator_step.py) times the default tiles and others
(`quantized_matmul(tile=)`) against bfloat16 products, to choose them from.

Letters: M rows of x, D_in and D_out the weight's inputs and outputs, G groups along D_in, P the
packed (stored) rows: D_in at 8 bits, D_in / 2 at 4.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from specjax.kernels.quantized import QuantizedWeight, is_fp8

IMPLEMENTATIONS = ("tpu", "cuda")
DECODE_ROWS = 64  # up to this many rows: one row block (decoding and verify passes)
PREFILL_ROWS = {"tpu": 128, "cuda": 64}  # rows per block above DECODE_ROWS
# Candidate tiles, largest first: stored rows per input block, output columns per block.
INPUT_BLOCKS = {"tpu": (512, 256, 128), "cuda": (128, 64, 32, 16)}
OUTPUT_BLOCKS = {"tpu": (512, 256, 128), "cuda": (64, 32, 16)}
GPU_PROGRAMS = 256  # the GPU's grid is split along D_in until it has about this many programs
MIN_ROWS = {"tpu": 8, "cuda": 16}  # the smallest row tile: TPU's sublanes, Triton's dot


def quantized_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    *,
    implementation: str,
    interpret=False,
    out_dtype=None,
    tile: tuple[int, int] | None = None,
) -> jax.Array:
    """x [..., D_in] @ W [D_in, D_out] (W a 2-D QuantizedWeight of int8 or 4-bit values) through
    the `implementation`'s kernel ("tpu" or "cuda"; `interpret`: in Pallas' interpreter, which
    is how a CPU host checks them): [..., D_out] in `out_dtype` (default x's dtype), accumulated
    in float32. Float32 x multiplies at float32 precision; bfloat16 or float16 x multiplies the
    tile dequantized to its dtype, as XLA's "in_product" form does. `tile` (stored rows,
    output columns) replaces the largest candidate that fits (`tiles`): how
    benchmarks/accelerator_step.py compares tiles on a device."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"quantized_matmul: implementation is {implementation!r}; allowed: {IMPLEMENTATIONS}"
        )
    reason = unsupported(w, implementation, interpret)
    if reason is not None:
        raise ValueError(f"quantized_matmul: the weight does not fit the {implementation} kernel: {reason}")
    blocks = tiles(w, implementation, tile)
    if blocks is None:
        raise ValueError(
            f"quantized_matmul: tile={tile!r} does not fit values {w.values.shape} in "
            f"{w.scales.shape[0]} groups on {implementation}: {tile_rule(implementation)}"
        )
    d_in, d_out = w.shape
    if x.shape[-1] != d_in:
        raise ValueError(f"quantized_matmul: x has {x.shape[-1]} features, the weight {d_in} inputs")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"quantized_matmul: x must be floating point, got {x.dtype}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    rows = math.prod(x.shape[:-1])
    flat = x.reshape(rows, d_in).astype(compute)
    padded, block_rows = padded_rows(rows, implementation)
    flat = jnp.pad(flat, ((0, padded - rows), (0, 0)))
    if w.bits == 4:
        inputs = [flat[:, 0::2], flat[:, 1::2]]  # [M, P] each: the low and the high nibbles' inputs
        values = lax.bitcast_convert_type(w.values, jnp.int8)
    else:
        inputs, values = [flat], w.values
    run = _tpu_product if implementation == "tpu" else _gpu_product
    out = run(inputs, values, w.scales, w.offsets, block_rows=block_rows, blocks=blocks, interpret=interpret)
    return out[:rows].reshape(*x.shape[:-1], d_out).astype(out_dtype)


def padded_rows(rows: int, implementation: str) -> tuple[int, int]:
    """(rows padded, rows per block) for a product of `rows` rows."""
    if rows <= DECODE_ROWS:
        small = max(MIN_ROWS[implementation], rows)
        block = pl.next_power_of_2(small) if implementation == "cuda" else -(-small // 8) * 8
        return block, block
    block = PREFILL_ROWS[implementation]
    return -(-rows // block) * block, block


def unsupported(w, implementation: str, interpret=False) -> str | None:
    """Why the `implementation`'s kernel cannot multiply w (None: it can). The backend seam runs
    XLA's form for such weights."""
    if not isinstance(w, QuantizedWeight):
        return f"a QuantizedWeight is needed, got {type(w).__name__}"
    if is_fp8(w):
        return "FP8 values run as XLA's FP8 product (Backend.fp8_products) or dequantized"
    if w.bits not in (8, 4) or len(w.values.shape) != 2:
        return f"2-D int8 or 4-bit values are needed, got bits {w.bits} and values of shape {w.values.shape}"
    if (w.bits == 8) != (w.values.dtype == jnp.int8) or (w.bits == 4 and w.values.dtype != jnp.uint8):
        return f"bits {w.bits} with values of dtype {w.values.dtype}"
    packed, d_out = w.values.shape
    groups = w.scales.shape[0]
    if packed % groups:
        return f"{groups} groups do not divide the {packed} stored rows"
    if tiles(w, implementation) is None:
        allowed = (
            f"inputs in blocks of {INPUT_BLOCKS[implementation]} stored rows holding whole groups, "
            f"outputs in blocks of {OUTPUT_BLOCKS[implementation]} columns"
        )
        return f"no tile fits values {w.values.shape} in {groups} groups (allowed: {allowed})"
    return None


def tile_rule(implementation: str) -> str:
    """What a tile asked for by name (`quantized_matmul(tile=)`) must be on `implementation`."""
    shape = "powers of two of at least 16" if implementation == "cuda" else "multiples of 128 or whole axes"
    return (
        f"a tile is (stored rows, output columns), {shape}, dividing the values' axes, its rows "
        "holding whole groups"
    )


@functools.cache
def _tiles(packed: int, d_out: int, groups: int, offsets: bool, implementation: str, tile=None):
    """(stored rows, columns, groups) per tile, or None; see `tiles`."""
    per_group = packed // groups
    scaled_after = groups == 1 and not offsets  # a scale per output channel, applied once at the end
    on_tpu = implementation == "tpu"
    input_blocks, output_blocks = INPUT_BLOCKS[implementation], OUTPUT_BLOCKS[implementation]
    if tile is not None:
        legal = (_legal_block(b, axis, implementation) for b, axis in zip(tile, (packed, d_out), strict=True))
        if not all(legal):
            return None
        input_blocks, output_blocks = (tile[0],), (tile[1],)

    def fits(block):
        if packed % block:
            return False
        if scaled_after:
            return True
        if block % per_group:
            return False
        # TPU: a block of scales [groups per tile, columns] has a multiple of 8 rows, or all of them
        return not on_tpu or (block // per_group) % 8 == 0 or block == packed

    whole = tile is None and on_tpu  # a whole axis is always a legal TPU block
    inputs = next((b for b in input_blocks if fits(b)), packed if whole and fits(packed) else None)
    outputs = next((b for b in output_blocks if d_out % b == 0), d_out if whole else None)
    if inputs is None or outputs is None:
        return None
    return inputs, outputs, (1 if scaled_after else inputs // per_group)


def _legal_block(block: int, axis: int, implementation: str) -> bool:
    """Whether a block of `block` along an axis of `axis` is one `tile_rule` allows."""
    if implementation == "cuda":
        return block >= 16 and block & (block - 1) == 0
    return block % 128 == 0 or block == axis


def tiles(w: QuantizedWeight, implementation: str, tile: tuple[int, int] | None = None):
    """(stored rows, output columns, groups) of one tile of w on `implementation`, or None where
    no tile fits: TPU tiles are multiples of (8, 128) or whole axes (a whole axis is always a
    legal block), Triton's powers of two; a tile holds whole groups unless w has one group and no
    offsets (its scale then applies after the product). The largest candidate of INPUT_BLOCKS x
    OUTPUT_BLOCKS that fits, or `tile` (stored rows, columns) where it fits (`tile_rule`)."""
    packed, d_out = w.values.shape
    if tile is not None:
        tile = tuple(tile)
        if len(tile) != 2 or not all(isinstance(b, int) and b > 0 for b in tile):
            raise ValueError(f"tile must be (stored rows, output columns), two positive ints; got {tile!r}")
    return _tiles(packed, d_out, w.scales.shape[0], w.offsets is not None, implementation, tile)


def _precision(dtype):
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dequantized(values, scales, offsets, half: int | None, dtype):
    """One tile of stored values [P_b, C] widened in registers: the int8 values, or for 4 bits
    (`half` 0: low nibbles, 1: high ones) the nibbles of the packed bytes; times the tile's
    scales [G_b, C] (each group's rows; None: scaled after the product) plus its offsets; in
    `dtype`, the product's."""
    q = values.astype(jnp.int32)
    if half is not None:
        q = (q >> 4) & 0xF if half else q & 0xF
    q = q.astype(jnp.float32)
    if scales is None:
        return q.astype(dtype)
    rows, columns = q.shape
    groups = scales.shape[0]
    q = q.reshape(groups, rows // groups, columns) * scales[:, None, :]
    if offsets is not None:
        q = q + offsets[:, None, :]
    return q.reshape(rows, columns).astype(dtype)


def _tile_product(xs, values, scales, offsets):
    """sum over the tile's halves of x_half [M_b, P_b] @ its dequantized values [P_b, C], float32."""
    halves = (None,) if len(xs) == 1 else (0, 1)
    out = None
    for x, half in zip(xs, halves, strict=True):
        w = _dequantized(values, scales, offsets, half, x.dtype)
        part = jnp.dot(x, w, precision=_precision(x.dtype), preferred_element_type=jnp.float32)
        out = part if out is None else out + part
    return out


# ----------------------------------------------------------------------------------------------
# TPU


def _tpu_product(inputs, values, scales, offsets, *, block_rows, blocks, interpret):
    """Grid (row blocks, column blocks, input blocks); the input axis accumulates in VMEM."""
    rows = inputs[0].shape[0]
    packed, d_out = values.shape
    block_in, block_out, block_groups = blocks
    scaled_after = block_groups == 1 and offsets is None and scales.shape[0] == 1
    grid = (rows // block_rows, d_out // block_out, packed // block_in)
    x_spec = pl.BlockSpec((block_rows, block_in), lambda i, j, k: (i, k))
    if scaled_after:
        meta_spec = pl.BlockSpec((1, block_out), lambda i, j, k: (0, j))
    else:
        meta_spec = pl.BlockSpec((block_groups, block_out), lambda i, j, k: (k, j))
    in_specs = [x_spec] * len(inputs) + [
        pl.BlockSpec((block_in, block_out), lambda i, j, k: (k, j)),
        meta_spec,
    ]
    operands = [*inputs, values, scales]
    if offsets is not None:
        in_specs.append(meta_spec)
        operands.append(offsets)
    kernel = functools.partial(
        _tpu_kernel, halves=len(inputs), with_offsets=offsets is not None, scaled_after=scaled_after
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block_rows, block_out), lambda i, j, k: (i, j)),
            scratch_shapes=[pltpu.VMEM((block_rows, block_out), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((rows, d_out), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="specjax_quantized_matmul",
    )(*operands)


def _tpu_kernel(*refs, halves, with_offsets, scaled_after):
    x_refs, (w_ref, s_ref, *rest) = refs[:halves], refs[halves:]
    o_ref = rest.pop(0) if with_offsets else None
    out_ref, acc_ref = rest
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    scales = None if scaled_after else s_ref[...]
    offsets = None if o_ref is None else o_ref[...]
    acc_ref[...] += _tile_product([r[...] for r in x_refs], w_ref[...], scales, offsets)

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        out_ref[...] = acc_ref[...] * s_ref[...] if scaled_after else acc_ref[...]


# ----------------------------------------------------------------------------------------------
# GPU (Triton)


def gpu_splits(programs: int, input_blocks: int) -> int:
    """How many splits of the input blocks the GPU grid takes: the largest divisor of
    `input_blocks` that keeps programs x splits at most about GPU_PROGRAMS (1 where `programs`
    already fills it)."""
    want = max(1, GPU_PROGRAMS // max(programs, 1))
    return max(d for d in range(1, min(want, input_blocks) + 1) if input_blocks % d == 0)


def _gpu_product(inputs, values, scales, offsets, *, block_rows, blocks, interpret):
    """Grid (row blocks, column blocks, splits); each program loops over its split's input
    blocks, loading a tile of each operand per block (the refs are the whole input axis)."""
    rows, packed_x = inputs[0].shape
    packed, d_out = values.shape
    block_in, block_out, block_groups = blocks
    groups = scales.shape[0]
    scaled_after = block_groups == 1 and offsets is None and groups == 1
    input_blocks = packed // block_in
    splits = gpu_splits((rows // block_rows) * (d_out // block_out), input_blocks)
    in_specs = [pl.BlockSpec((block_rows, packed_x), lambda i, j, s: (i, 0))] * len(inputs)
    in_specs += [
        pl.BlockSpec((packed, block_out), lambda i, j, s: (0, j)),
        pl.BlockSpec((groups, block_out), lambda i, j, s: (0, j)),
    ]
    operands = [*inputs, values, scales]
    if offsets is not None:
        in_specs.append(pl.BlockSpec((groups, block_out), lambda i, j, s: (0, j)))
        operands.append(offsets)
    kernel = functools.partial(
        _gpu_kernel,
        halves=len(inputs),
        with_offsets=offsets is not None,
        scaled_after=scaled_after,
        block_in=block_in,
        block_groups=block_groups,
        per_split=input_blocks // splits,
    )
    partial = pl.pallas_call(
        kernel,
        grid=(rows // block_rows, d_out // block_out, splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, block_rows, block_out), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, d_out), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="specjax_quantized_matmul",
    )(*operands)
    return partial[0] if splits == 1 else jnp.sum(partial, axis=0)


def _gpu_kernel(*refs, halves, with_offsets, scaled_after, block_in, block_groups, per_split):
    x_refs, (w_ref, s_ref, *rest) = refs[:halves], refs[halves:]
    o_ref = rest.pop(0) if with_offsets else None
    (out_ref,) = rest
    first = pl.program_id(2) * per_split

    def visit(b, acc):
        xs = [r[:, pl.ds(b * block_in, block_in)] for r in x_refs]
        values = w_ref[pl.ds(b * block_in, block_in), :]
        scales = None if scaled_after else s_ref[pl.ds(b * block_groups, block_groups), :]
        offsets = None if o_ref is None else o_ref[pl.ds(b * block_groups, block_groups), :]
        return acc + _tile_product(xs, values, scales, offsets)

    acc = lax.fori_loop(first, first + per_split, visit, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc * s_ref[...] if scaled_after else acc
