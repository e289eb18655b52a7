r"""Microseconds per weight product and the bandwidth it reads at, for SmolLM2-135M's projection
shapes at a decoding step's few rows: the float32 panel kernel, the quantized panel kernels (int8 and
4-bit with offsets) and XLA's dequantize-then-dot of the same quantized weight.

    .venv/bin/python benchmarks/quantized_products.py [--rows 1 2 6] [--group 32] [--repeats 20]
        [--scales float32|float16]

A decoding step streams every weight once, from memory rather than from cache: the model's weights
are several times the L3 cache even at 4 bits. So each measurement multiplies by enough distinct
copies of the weight (about --footprint MB of them) that they cannot stay in cache, one after the
other in one jitted call, each product's input depending on the one before (as in a forward pass);
the time per product is the call's median over --repeats, divided by the copies. The methods take
turns, one call each per round, so that a busy machine's slow spells fall on all of them alike.
GB/s counts the bytes the product reads: the values, and the scales and offsets (float32, one per
column and group).
The weights are random: their values do not change the time.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table, median_time

from specjax import kernels
from specjax.kernels.quantized import QuantizedWeight, dequantize, pack_quantized, quantized_panel_matmul

SHAPES = {  # SmolLM2-135M: [D_in, D_out] of each product
    "qkv": (576, 960),
    "o": (576, 576),
    "gate/up": (576, 1536),
    "down": (1536, 576),
    "head": (576, 49152),
}
METHODS = ("float32 panels", "int8 panels", "4-bit panels", "int8 XLA", "4-bit XLA")


def random_quantized(
    rng, d_in: int, d_out: int, bits: int, group: int, scales_dtype=np.float32
) -> QuantizedWeight:
    """A QuantizedWeight of random values: int8 without offsets, 4-bit with; its scales and
    offsets rounded to `scales_dtype` (float16: as GGUF's Q8_0 and Q4_1 store them, which the
    panels then keep in 2 bytes; float32 values keep 4)."""
    groups = d_in // group

    def meta(low, high):
        return jnp.asarray(rng.uniform(low, high, (groups, d_out)).astype(scales_dtype), jnp.float32)

    scales = meta(0.001, 0.01)
    if bits == 8:
        values = jnp.asarray(rng.integers(-127, 128, (d_in, d_out)), jnp.int8)
        return QuantizedWeight(values, scales, None, bits=8, group=group)
    values = jnp.asarray(rng.integers(0, 256, (d_in // 2, d_out)), jnp.uint8)
    return QuantizedWeight(values, scales, meta(-0.08, 0.0), bits=4, group=group)


def weight_and_product(method: str, rng, d_in: int, d_out: int, group: int, scales_dtype=np.float32):
    """(one copy of the weight as `method` stores it, the product x @ w it runs)."""
    if method == "float32 panels":
        w = jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.float32)
        return kernels.pack(w), kernels.panel_matmul
    bits = 8 if method.startswith("int8") else 4
    w = random_quantized(rng, d_in, d_out, bits, group, scales_dtype)
    if method.endswith("panels"):
        return pack_quantized(w), quantized_panel_matmul
    return w, lambda x, w: x @ dequantize(w)


def nbytes(w) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))


def chained(method: str, rows: int, d_in: int, d_out: int, args):
    """(a call that runs x @ w over enough copies of the weight to leave the cache, the number of
    copies, bytes per copy)."""
    rng = np.random.default_rng(0)
    scales_dtype = np.dtype(getattr(args, "scales", "float32"))
    first, product = weight_and_product(method, rng, d_in, d_out, args.group, scales_dtype)
    copies = max(1, -(-args.footprint * 2**20 // nbytes(first)))
    weights = [first] + [
        weight_and_product(method, rng, d_in, d_out, args.group, scales_dtype)[0] for _ in range(copies - 1)
    ]

    @jax.jit
    def chain(x, weights):
        y = x
        for w in weights:
            # Each input depends on the product before, so the products run one after the other.
            y = product(x + 0.0 * y[:, :1], w)
        return y

    x = jnp.asarray(rng.standard_normal((rows, d_in)), jnp.float32)
    chain(x, weights).block_until_ready()  # compile and warm up
    return (lambda: chain(x, weights).block_until_ready()), copies, nbytes(first)


def time_products(methods, rows: int, d_in: int, d_out: int, args) -> dict[str, tuple[float, int]]:
    """method: (seconds per product, bytes per weight), the methods timed in turn in each of
    --repeats rounds, so that a busy machine's slow spells fall on all of them alike."""
    calls = {method: chained(method, rows, d_in, d_out, args) for method in methods}
    times = {method: [] for method in methods}
    for _ in range(args.repeats):
        for method, (call, copies, _) in calls.items():
            times[method].append(median_time(call, 1) / copies)
    return {method: (float(np.median(times[method])), calls[method][2]) for method in methods}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 6], help="rows per product")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--group", type=int, default=32, help="input rows per scale (default %(default)s)")
    parser.add_argument(
        "--scales",
        default="float32",
        choices=["float32", "float16"],
        help="the random scales' and offsets' values: float16 ones (as GGUF's Q8_0 and Q4_1 store them) "
        "are packed in 2 bytes each (default %(default)s)",
    )
    parser.add_argument("--footprint", type=int, default=96, help="MB of weight copies per measurement")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement (median)")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the CPU kernels did not build (see the warning above)")

    print(machine())
    header = ["shape", "rows"] + [f"{m} us (GB/s)" for m in args.methods]
    table = []
    for name in args.shapes:
        d_in, d_out = SHAPES[name]
        for rows in args.rows:
            timed = time_products(args.methods, rows, d_in, d_out, args)
            cells = [f"{seconds * 1e6:.1f} ({size / seconds / 1e9:.1f})" for seconds, size in timed.values()]
            table.append([f"{name} [{d_in}, {d_out}]", rows, *cells])
            print(markdown_table(header, table[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
