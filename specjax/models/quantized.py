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

from specjax.kernels.quantized import BITS, QuantizedWeight, dequantize, unpack_values

__all__ = ["BITS", "QuantizedWeight", "dequantize", "unpack_values"]
