"""MXFP4 expert weights (gpt-oss as released), dequantized when they are read.

MXFP4 is the OCP microscaling format with FP4 elements: each group of 32 consecutive values along
a row shares one scale, an E8M0 byte (the power of two 2^(byte - 127)), and each value is a 4-bit
E2M1 float (a sign bit, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives), two to a byte, the even element in the low nibble. gpt-oss stores an expert tensor of
logical shape [X, out, in] as `<name>_blocks` [X, out, in / 32, 16] uint8 and `<name>_scales`
[X, out, in / 32] uint8.

specjax does not compute in MXFP4: `mxfp4_tensor` turns the pair into one float32 LazyTensor in
our [X, in, out] layout, which the loader converts to the model's dtype like any other weight.
Every FP4 value times a power of two is exact in float32 and in bfloat16 (an E2M1 value has 2
significant bits), so nothing rounds unless the scales leave bfloat16's exponent range.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.models.tensors import LazyTensor, normalize_index

# The 16 E2M1 values by their 4-bit code: bit 3 the sign, bits 2-1 the exponent, bit 0 the mantissa.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
GROUP = 32  # values per scale
SCALE_BIAS = 127  # E8M0: 2^(byte - 127)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., rows, groups * 32] float32 from blocks [..., rows, groups, 16] uint8 and scales
    [..., rows, groups] uint8."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4: blocks {blocks.shape} and scales {scales.shape} do not match "
            f"(expected blocks [..., groups, {GROUP // 2}] and scales [..., groups])"
        )
    values = np.empty((*blocks.shape[:-1], GROUP), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32) - SCALE_BIAS
    values = np.ldexp(values, exponents[..., None])
    return values.reshape(*scales.shape[:-1], -1)


def mxfp4_tensor(blocks: LazyTensor, scales: LazyTensor, source: str) -> LazyTensor:
    """The expert tensor [X, in, out] float32 that blocks [X, out, in / 32, 16] and scales
    [X, out, in / 32] hold (gpt-oss's `<name>_blocks`, `<name>_scales`), read and dequantized
    when asked. A slice reads the experts and output rows it covers, whole along `in`."""
    X, rows, groups, _ = blocks.shape
    shape = (X, groups * GROUP, rows)

    def read():
        return dequantize(blocks.read(), scales.read()).transpose(0, 2, 1)

    def read_slice(index):
        experts, inputs, outputs = normalize_index(index, shape)
        whole = slice(None)
        values = dequantize(
            blocks.read_index((experts, outputs, whole, whole)), scales.read_index((experts, outputs, whole))
        )
        return np.ascontiguousarray(values[:, :, inputs].transpose(0, 2, 1))

    return dataclasses.replace(
        blocks, shape=shape, dtype=np.dtype(np.float32), read=read, read_slice=read_slice, source=source
    )


def quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) holding `values` [..., rows, in] (in a multiple of 32) in MXFP4, each
    group's scale the least power of two that brings its largest magnitude to 6 or below, each
    value rounded to the nearest E2M1 value. For tests and tools: what a released checkpoint
    stores, from float weights."""
    *lead, width = values.shape
    if width % GROUP:
        raise ValueError(f"MXFP4: rows of {width} values do not split into groups of {GROUP}")
    groups = values.reshape(*lead, width // GROUP, GROUP).astype(np.float64)
    peak = np.max(np.abs(groups), axis=-1)
    exponents = np.ceil(np.log2(np.where(peak > 0, peak, 1.0) / 6.0)).astype(np.int32)
    exponents = np.clip(exponents, -SCALE_BIAS, 255 - SCALE_BIAS)
    scaled = groups / np.ldexp(1.0, exponents)[..., None]
    codes = np.argmin(np.abs(scaled[..., None] - FP4_VALUES.astype(np.float64)), axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # (C order: a transposed input's layout would otherwise carry through to the results)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponents + SCALE_BIAS, np.uint8)
