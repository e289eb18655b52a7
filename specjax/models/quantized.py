"""Weight-only quantization: a projection weight kept as small integers with per-group scales.

One layout serves every format specjax reads or makes (`QuantizedWeight`): a weight W [D_in, D_out]
(the `x @ W` orientation of every projection here) is split along D_in into groups of `group`
consecutive input rows, and

    W[i, o] = q[i, o] * scales[i // group, o] + offsets[i // group, o]      (offsets None: 0)

- bits 8: q is int8 [D_in, D_out], signed, no offsets (symmetric). GGUF Q8_0 (groups of 32),
  GGUF Q6_K (q - 32 in -32..31, groups of 16, each group's scale the block's d times its 8-bit
  sub-scale) and "int8" (one group: a scale per output channel).
- FP8 (bits 8, values float8_e4m3fn [D_in, D_out], no offsets): checkpoints as released with
  `weight_scale_inv` (DeepSeek-V3, the Qwen3 FP8 releases), and "fp8" made at load. Their scales
  are 2-D, one per block of 128 x 128 weights; here each block's scale is repeated for its columns
  (groups of 128 input rows, a scale per output column: 4 bytes per 128 weights, 3% beside the
  values), so that the columns of a block may be fused (qkv, kv head by kv head), split over a
  mesh, or sliced like any other quantized weight's.
- bits 4: q is 0..15, two input rows per byte, `values` uint8 [D_in // 2, D_out]: row 2i in the
  low nibble, row 2i + 1 in the high one; offsets always set. GGUF Q4_0 (scale d, offset -8 d),
  Q4_1 (scale d, offset m), Q4_K (groups of 32, scale d * sc, offset -dmin * m) and "int4" (groups
  of 32 or 128, offset -zero * scale).

The integers are the file's own; the scales of a two-level format (K-quants) are multiplied out at
load, exactly in float32 (a float16 times a 6- or 8-bit integer). Activations, norms, softmax and
sampling stay in float: only the products read the integers (specjax/kernels/backend.py).

A stacked layer (models/params.py, LayerStack) carries a leading axis on every field.

Here: the layout and `dequantize`; `xla_product`, the product the backend's seam runs for a
QuantizedWeight (measured against a grouped form); `quantize` ("int8", "int4", "fp8") and
`quantize_params` for float weights; `from_fp8`, an FP8 checkpoint's weight and block scales
(`check_fp8_config` reads its quantization_config); `from_gguf`, a GGUF tensor's blocks (Q8_0,
Q4_0, Q4_1, Q4_K, Q6_K) decoded as the format defines them, without gguf-py. Loading
(`specjax.load(quantization=)`) is models/checkpoint.py's, models/hf_loader.py's (FP8) and
models/gguf_loader.py's; sharding splits scales with their weights
(sharding/specs.py, `quantized_spec`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from specjax.checks import is_int
from specjax.kernels.quantized import QuantizedWeight, dequantize

# ---------------------------------------------------------------------------------------------
# Weights as arrays


def columns(w, index) -> QuantizedWeight | jax.Array:
    """Columns `index` of w [..., D_in, D_out] (an array, or quantized: every field's columns)."""
    if isinstance(w, QuantizedWeight):
        return jax.tree.map(lambda a: a[..., index], w)
    return w[..., index]


def as_array(w, dtype=None) -> jax.Array:
    """w as a float array: dequantized where it is quantized, else as it is (cast to `dtype`)."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w, dtype)
    return w if dtype is None else w.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Quantizing float weights ("int8", "int4")

QUANTIZATIONS = ("gguf", "int8", "int4", "fp8")  # what `specjax.load(quantization=...)` accepts
INT4_GROUPS = (32, 128)


def check_quantization(quantization, group_size) -> int | None:
    """The group size `quantization` runs with (int4: `group_size`, default 32; None for the
    others), or ValueError naming the bad argument."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization == "int4":
        group_size = 32 if group_size is None else group_size
        if isinstance(group_size, bool) or group_size not in INT4_GROUPS:
            raise ValueError(f"group_size for int4 must be one of {INT4_GROUPS}, got {group_size!r}")
        return group_size
    if group_size is not None:
        what = {"int8": "one group per output channel", "fp8": "blocks of 128 x 128"}.get(
            quantization, "the file's own blocks"
        )
        raise ValueError(
            f"group_size is for quantization='int4' only ({quantization!r} has {what}), got {group_size!r}"
        )
    return None


def quantize(w, kind: str, group: int | None = None) -> QuantizedWeight:
    """Float weights w [..., D_in, D_out] as a QuantizedWeight of numpy arrays (host memory).

    "int8": symmetric, one group (a scale per output channel: max |w| / 127), q in -127..127.
    "int4": groups of `group` (32 or 128) consecutive inputs, each with a scale and a zero point:
    the group's range widened to hold 0, split in 15 steps; q = round(w / scale) + zero in 0..15,
    stored as offset -zero * scale. Either reconstructs each weight within half a step (scale / 2).
    "fp8": blocks of 128 x 128 (`from_fp8`), as FP8 checkpoints are released: each block's scale
    max |w| / 448, the values w / scale rounded to the nearest float8_e4m3fn.
    """
    group = check_quantization(kind, group) if kind == "int4" else group
    if kind not in ("int8", "int4", "fp8"):
        raise ValueError(f"quantize: kind must be 'int8', 'int4' or 'fp8', got {kind!r}")
    if kind == "fp8":
        return _quantize_fp8(w, group)
    if kind == "int8" and group is not None:
        raise ValueError(f"quantize: int8 has one group per output channel, got group={group!r}")
    w = np.asarray(w, np.float32)
    if w.ndim < 2:
        raise ValueError(f"quantize: a weight [..., D_in, D_out] is needed, got shape {w.shape}")
    *lead, d_in, d_out = w.shape
    group = d_in if kind == "int8" else group
    if d_in % group or (kind == "int4" and d_in % 2):
        raise ValueError(f"quantize: {kind} groups of {group} do not divide the weight's {d_in} inputs")
    grouped = w.reshape(*lead, d_in // group, group, d_out)
    if kind == "int8":
        scales = np.abs(grouped).max(axis=-2) / np.float32(127)  # [..., 1, O]
        safe = np.where(scales > 0, scales, np.float32(1))
        q = np.clip(np.rint(grouped / safe[..., None, :]), -127, 127).astype(np.int8)
        return QuantizedWeight(q.reshape(w.shape), scales.astype(np.float32), None, bits=8, group=group)
    low = np.minimum(grouped.min(axis=-2), 0)  # [..., G, O]: the range holds 0 (an exact zero point)
    high = np.maximum(grouped.max(axis=-2), 0)
    scales = np.where(high > low, (high - low) / np.float32(15), np.float32(1)).astype(np.float32)
    zeros = np.clip(np.rint(-low / scales), 0, 15)
    q = np.clip(np.rint(grouped / scales[..., None, :]) + zeros[..., None, :], 0, 15).astype(np.uint8)
    return QuantizedWeight(
        pack_nibbles(q.reshape(w.shape)), scales, (-zeros * scales).astype(np.float32), bits=4, group=group
    )


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [..., D_in, D_out] in 0..15 -> uint8 [..., D_in // 2, D_out]: row 2i low, 2i + 1 high."""
    q = np.asarray(q, np.uint8)
    return (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).astype(np.uint8)


def quantize_params(params, kind: str, group: int | None = None):
    """A model's params (LlamaParams) with every decoder layer's projections (qkv, o, gate, up,
    down, the experts') and the LM head quantized (`quantize`): a tied head gets a quantized copy
    in `lm_head`, the embedding staying float for token lookups. Norms, biases, the router and the
    embedding stay float. Weights already quantized are left as they are."""

    def q(w):
        if w is None or isinstance(w, QuantizedWeight):
            return w
        return jax.tree.map(jnp.asarray, quantize(jax.device_get(w), kind, group))

    layers = tuple(
        layer.replace(**{name: q(getattr(layer, name)) for name in PROJECTIONS}) for layer in params.layers
    )
    head = params.embed.T if params.lm_head is None else params.lm_head
    return params.replace(layers=layers, lm_head=q(head), head_panels=None)


# The fields of a decoder layer (models/params.py, LayerParams) that quantization applies to.
PROJECTIONS = ("qkv", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down")


def is_quantized(tree) -> bool:
    """Whether any weight of a params tree is quantized."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)


def nbytes(tree) -> int:
    """Bytes of every array in a params tree, quantized weights at their stored size."""
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


# ---------------------------------------------------------------------------------------------
# GGUF blocks (llama.cpp's ggml-common.h defines each block; gguf-py's quants.py decodes them)

QK_K = 256  # values per K-quant super-block
# type name -> (values per block, bytes per block)
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (QK_K, 144), "Q6_K": (QK_K, 210)}
GGUF_FORMATS = tuple(GGUF_BLOCKS)  # the GGUF types kept as blocks


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (`GGUFReader` tensor data, bytes) as a QuantizedWeight of numpy
    arrays in our layout. `shape`: the tensor as HF lays it out, [..., out, in] (ggml's dims
    reversed), its blocks running along `in`; the result is [..., in, out], as every projection
    here is applied (x @ W)."""
    if type_name not in GGUF_BLOCKS:
        raise ValueError(f"from_gguf: type {type_name!r} is not kept as blocks; kept: {GGUF_FORMATS}")
    block, size = GGUF_BLOCKS[type_name]
    *lead, n_out, n_in = shape
    if n_in % block:
        raise ValueError(f"from_gguf: {type_name} blocks of {block} do not divide the {n_in} inputs")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    if blocks.shape[0] != math.prod(shape) // block:
        raise ValueError(f"from_gguf: {blocks.shape[0]} {type_name} blocks for a tensor of shape {shape}")
    q, scales, offsets, bits = _DECODERS[type_name](blocks)  # q [n, block]; scales [n, groups]
    group = block // scales.shape[1]

    def ours(a, columns):  # [n, ...] in [..., out, in] order -> [..., in', out]
        return np.ascontiguousarray(np.swapaxes(a.reshape(*lead, n_out, columns), -1, -2))

    values = ours(q, n_in)
    values = pack_nibbles(values) if bits == 4 else values
    scales = ours(scales, n_in // group)
    offsets = None if offsets is None else ours(offsets, n_in // group)
    return QuantizedWeight(values, scales, offsets, bits=bits, group=group)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at bytes start, start + 1 of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [n, m] -> [n, 2m]: the low nibbles of the m bytes, then their high nibbles (the
    order of Q4_0 and Q4_1 blocks, and of each 64 values of a Q4_K block)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _q8_0(blocks):  # d (f16), then 32 int8 values: w = d * q
    return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None, 8


def _q4_0(blocks):  # d, then 32 4-bit values: w = d * (q - 8)
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:]), d, -8 * d, 4


def _q4_1(blocks):  # d, m, then 32 4-bit values: w = d * q + m
    return _nibbles(blocks[:, 4:]), _f16(blocks, 0), _f16(blocks, 2), 4


def _q4_k(blocks):
    """d, dmin (f16), 12 bytes of eight 6-bit scales and mins, 128 bytes of 256 4-bit values in
    four runs of 64 (32 bytes: low nibbles first); sub-block j (32 values): w = d sc_j q - dmin m_j.
    Scales and mins 0..3 are the low 6 bits of bytes 0..3 and 4..7; 4..7 take their low 4 bits
    from bytes 8..11 (scales low nibble, mins high) and their top 2 from the top bits of bytes
    0..3 (scales) and 4..7 (mins)."""
    d, dmin, packed = _f16(blocks, 0), _f16(blocks, 2), blocks[:, 4:16]
    first, second, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([first & 63, (low & 0xF) | ((first >> 6) << 4)], axis=-1)
    m = np.concatenate([second & 63, (low >> 4) | ((second >> 6) << 4)], axis=-1)
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, QK_K)
    return q, d * sc.astype(np.float32), -dmin * m.astype(np.float32), 4


def _q6_k(blocks):
    """128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, d (f16); sub-block j (16
    values): w = d sc_j (q - 32). Each half of 128 values reads 64 low-bit bytes and 32 high-bit
    bytes: value 32k + l (k 0..3, l 0..31) takes the low (k < 2) or high nibble of low-bit byte
    l + 32 (k % 2) and bits 2k, 2k + 1 of high-bit byte l."""
    low = blocks[:, :128].reshape(-1, 2, 1, 2, 32)  # [n, half, ., k % 2, l]
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [n, half, ., l]
    low = np.concatenate([low & 0xF, low >> 4], axis=2).reshape(-1, 2, 4, 32)  # nibble k // 2
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (low | (((high >> shifts) & 3) << 4)).astype(np.int8) - np.int8(32)
    d = _f16(blocks, 208)
    return q.reshape(-1, QK_K), d * blocks[:, 192:208].view(np.int8).astype(np.float32), None, 8


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}


# ---------------------------------------------------------------------------------------------
# FP8 blocks (transformers' FineGrainedFP8Config: integrations/finegrained_fp8.py dequantizes them)

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_BLOCK = (128, 128)  # [out, in] weights per scale, as DeepSeek-V3 and Qwen3 FP8 ship them


def check_fp8_config(quantization_config: dict) -> tuple[int, int] | None:
    """The weight block [out, in] of an FP8 checkpoint's `quantization_config` (config.json), or
    None for one scale per tensor; ValueError naming what specjax does not read: FP8 weights other
    than e4m3, static activation scales, power-of-two (ue8m0) scales, FP4 experts, a quantized
    embedding."""
    refusals = {
        "fmt": ("e4m3", "e4m3 weights (float8_e4m3fn)"),
        "activation_scheme": ("dynamic", "activations in float (dynamic: no stored activation scales)"),
        "scale_fmt": ("float", "float32 scales"),
        "expert_dtype": ("fp8", "FP8 experts"),
    }
    for key, (allowed, what) in refusals.items():
        value = quantization_config.get(key, allowed)
        if value != allowed:
            raise ValueError(f"quantization_config {key}={value!r}: specjax reads {what}, {key}={allowed!r}")
    if quantization_config.get("modules_to_convert"):
        raise ValueError(
            f"quantization_config modules_to_convert={quantization_config['modules_to_convert']!r}: "
            "specjax reads FP8 linear layers only, not FP8 embeddings"
        )
    block = quantization_config.get("weight_block_size", FP8_BLOCK)
    if block is None:
        return None
    if len(block) != 2 or not all(is_int(b) and b > 0 for b in block):
        raise ValueError(
            f"quantization_config weight_block_size must be two positive integers, got {block!r}"
        )
    return tuple(block)


def from_fp8(values: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] | None) -> QuantizedWeight:
    """An FP8 checkpoint's weight as a QuantizedWeight of numpy arrays in our layout.

    values: float8_e4m3fn [..., out, in] (HF's layout); scale_inv: float32 [..., ceil(out / bo),
    ceil(in / bi)] for `block` (bo, bi), or one scale (shape () or (1,)) for block None. The
    weight is values * scale_inv, each scale over its block (transformers' Fp8Dequantize). Ours:
    values [..., in, out], still float8; scales [..., in / group, out], float32, each block's
    scale repeated for its columns, in groups of gcd(in, bi) input rows (bi where the blocks divide
    `in`, as in every release; a smaller group that does where a last block is partial)."""
    values = np.asarray(values)
    if values.dtype != FP8_DTYPE or values.ndim < 2:
        raise ValueError(
            f"from_fp8: values must be float8_e4m3fn [..., out, in], got {values.dtype} {values.shape}"
        )
    *lead, n_out, n_in = values.shape
    scale_inv = np.asarray(scale_inv, np.float32)
    if block is None:
        if scale_inv.size != 1:
            raise ValueError(
                f"from_fp8: one scale per tensor is needed (no weight_block_size), got {scale_inv.shape}"
            )
        scales = np.full((*lead, 1, n_out), scale_inv.reshape(()), np.float32)
        return QuantizedWeight(np.swapaxes(values, -1, -2), scales, None, bits=8, group=n_in)
    bo, bi = block
    want = (*lead, -(-n_out // bo), -(-n_in // bi))
    if scale_inv.shape != want:
        raise ValueError(
            f"from_fp8: a weight {values.shape} in blocks of {bo} x {bi} has scales {want}, "
            f"got {scale_inv.shape}"
        )
    group = math.gcd(n_in, bi)
    scales = np.repeat(scale_inv, bi // group, axis=-1)[..., : n_in // group]  # [..., out blocks, in / group]
    scales = np.repeat(scales, bo, axis=-2)[..., :n_out, :]  # [..., out, in / group]
    return QuantizedWeight(
        np.ascontiguousarray(np.swapaxes(values, -1, -2)),
        np.ascontiguousarray(np.swapaxes(scales, -1, -2)),
        None,
        bits=8,
        group=group,
    )


def _quantize_fp8(w, group) -> QuantizedWeight:
    """`quantize(w, "fp8")`: w [..., D_in, D_out] in FP8_BLOCK blocks of [out, in] (partial ones at
    the edges), as a checkpoint would store it, then `from_fp8`."""
    if group is not None:
        raise ValueError(f"quantize: fp8 has blocks of {FP8_BLOCK[0]} x {FP8_BLOCK[1]}, got group={group!r}")
    w = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., out, in]
    if w.ndim < 2:
        raise ValueError(f"quantize: a weight [..., D_in, D_out] is needed, got shape {w.shape[::-1]}")
    *lead, n_out, n_in = w.shape
    (bo, bi), blocks = FP8_BLOCK, (-(-n_out // FP8_BLOCK[0]), -(-n_in // FP8_BLOCK[1]))
    padded = np.zeros((*lead, blocks[0] * bo, blocks[1] * bi), np.float32)
    padded[..., :n_out, :n_in] = w
    amax = np.abs(padded.reshape(*lead, blocks[0], bo, blocks[1], bi)).max(axis=(-3, -1))
    scale_inv = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, bo, axis=-2), bi, axis=-1)[..., :n_out, :n_in]
    values = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return from_fp8(values, scale_inv, FP8_BLOCK)
