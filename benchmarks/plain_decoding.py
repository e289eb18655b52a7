"""Plain greedy decoding: specjax against HF transformers, same weights, same prompts, one run.

    .venv/bin/python benchmarks/plain_decoding.py [--per-category 2] [--max-new-tokens 128]

Batch 1, greedy, chat template on, float32. Tokens/s counts the new tokens over the wall time of
a whole generate call (prefill included), median of --repeats runs after a warm-up; specjax's
compile time is reported apart. The roofline is the float32 weight bytes over the machine's
measured read bandwidth: the faster of a 1-row XLA product and a 1-row product of the CPU panel
kernel (specjax.kernels, what decoding runs) over a 453 MB matrix. The roofline models decoding
steps, not the prefill, so the table also gives specjax's decoding rate apart from it: the new
tokens after the first over (whole call - a call for one new token).

The bandwidth is measured twice, because a shared host's moves with its other load (27-53 GB/s
within minutes here):
- beside every timed specjax call (`Probe`: a few reads by each product just before and after
  it), so that each call's rate is set against the bandwidth of its own moment; the "of
  roofline" columns are the medians over repeats of those per-call ratios;
- once at the end, the best of 20 reads by each product (the peak), for the last column, the
  decoding rate's median over the peak's roofline: a bound no moment's load can flatter.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    common_arguments,
    data_dir,
    load_hf_reference,
    machine,
    markdown_table,
    median_time,
    spec_bench_prompts,
)

import specjax
from specjax import kernels

BANDWIDTH_SHAPE = (576, 196608)  # a 453 MB float32 matrix, read by a 1-row product


def bandwidth_products() -> dict[str, tuple]:
    """The 1-row products that measure read bandwidth, each as (jitted product, its matrix, x):
    XLA's `x @ w` and, where the kernels load, the panel kernel over the same matrix packed."""
    w = jax.random.normal(jax.random.key(0), BANDWIDTH_SHAPE, jnp.float32)
    x = jnp.ones((1, BANDWIDTH_SHAPE[0]), jnp.float32)
    products = {"XLA product": (jax.jit(lambda w, x: x @ w), w, x)}
    if kernels.enabled():  # the packed copy holds the same bytes (196608 columns fill whole panels)
        products["panel kernel"] = (jax.jit(lambda w, x: kernels.panel_matmul(x, w)), kernels.pack(w), x)
    for product, w, x in products.values():
        product(w, x).block_until_ready()
    return products


def read_rates_gbs(products: dict[str, tuple], reads: int) -> dict[str, list[float]]:
    """GB/s of `reads` timed reads by each product, taken in turn."""
    nbytes = 4 * BANDWIDTH_SHAPE[0] * BANDWIDTH_SHAPE[1]
    rates = {name: [] for name in products}
    for _ in range(reads):
        for name, (product, w, x) in products.items():
            start = time.perf_counter()
            product(w, x).block_until_ready()
            rates[name].append(nbytes / (time.perf_counter() - start) / 1e9)
    return rates


class Probe:
    """The read bandwidth around timed calls: `around(call)` runs `call` between two sets of
    `reads` reads by each product and returns (the call's wall time, the bandwidth of that
    moment: the faster product's median rate over the reads before and after)."""

    def __init__(self, products: dict[str, tuple], reads: int = 3):
        self.products, self.reads = products, reads

    def around(self, call) -> tuple[float, float]:
        before = read_rates_gbs(self.products, self.reads)
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
        after = read_rates_gbs(self.products, self.reads)
        return seconds, max(statistics.median(before[name] + after[name]) for name in self.products)


def main() -> None:
    parser = common_arguments(__doc__)
    args = parser.parse_args()

    prompts = spec_bench_prompts(data_dir(args.data), args.per_category)
    model = specjax.load("smollm2-135m")
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    probe = Probe(bandwidth_products())

    hf = None if args.no_hf else load_hf_reference()
    if hf is not None:
        import torch

    results = []  # one dict per prompt
    compile_times = []
    for category, text in prompts:

        def run(text=text):
            return specjax.generate(model, [text], max_new_tokens=args.max_new_tokens, chat=True)

        def prefill(text=text):
            return specjax.generate(model, [text], max_new_tokens=1, chat=True)

        warm = run()
        compile_times.append(warm.metrics.compile_time_s)
        prefill()
        n_new = len(warm.tokens[0])
        wholes, ones, of_roofline, decoding_of_roofline, bandwidths = [], [], [], [], []
        for _ in range(args.repeats):
            whole, bandwidth = probe.around(run)
            one, _ = probe.around(prefill)
            roofline = bandwidth * 1e9 / weight_bytes  # tok/s at this moment's bandwidth
            wholes.append(whole)
            ones.append(one)
            bandwidths.append(bandwidth)
            of_roofline.append(n_new / whole / roofline)
            decoding_of_roofline.append((n_new - 1) / (whole - one) / roofline)
        theirs = float("nan")
        if hf is not None:
            ids = torch.tensor([warm.prompt_tokens[0]])

            def hf_run(ids=ids):
                with torch.no_grad():
                    return hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)

            hf_tokens = hf_run()[0, ids.shape[1] :].tolist()
            theirs = len(hf_tokens) / median_time(hf_run, args.repeats)
            if hf_tokens[: len(warm.tokens[0])] != warm.tokens[0]:
                print(f"note: greedy tokens differ from HF on a {category} prompt")
        results.append(
            {
                "category": category,
                "prompt tokens": len(warm.prompt_tokens[0]),
                "ours": n_new / statistics.median(wholes),
                "theirs": theirs,
                "of roofline": statistics.median(of_roofline),
                "decoding": (n_new - 1) / (statistics.median(wholes) - statistics.median(ones)),
                "decoding of roofline": statistics.median(decoding_of_roofline),
                "bandwidth": statistics.median(bandwidths),
            }
        )

    peak_rates = read_rates_gbs(probe.products, reads=20)
    peak = max(max(rates) for rates in peak_rates.values())
    peak_roofline = peak * 1e9 / weight_bytes

    def row(label: str, group: list[dict]) -> list:
        def mean(key):
            return statistics.mean(r[key] for r in group)

        return [
            label,
            len(group),
            round(mean("prompt tokens")) if label != "all" else "",
            mean("ours"),
            mean("theirs"),
            mean("ours") / mean("theirs"),
            mean("bandwidth"),
            mean("of roofline"),
            mean("decoding"),
            mean("decoding of roofline"),
            mean("decoding") / peak_roofline,
        ]

    categories = list(dict.fromkeys(r["category"] for r in results))
    rows = [row(c, [r for r in results if r["category"] == c]) for c in categories]
    rows.append(row("all", results))
    print(f"\nmachine: {machine()}")
    print(
        f"weights: {weight_bytes / 1e6:.0f} MB float32; peak read bandwidth {peak:.1f} GB/s "
        f"({', '.join(f'{name} {max(rates):.1f}' for name, rates in peak_rates.items())}, best of 20); "
        f"peak roofline {peak_roofline:.1f} tok/s; compile {np.median(compile_times):.1f} s per prompt "
        "bucket (median)"
    )
    print(f"batch 1, greedy, chat template, {args.max_new_tokens} new tokens, median of {args.repeats}\n")
    print(
        markdown_table(
            [
                "category",
                "prompts",
                "prompt tokens",
                "specjax tok/s",
                "HF tok/s",
                "specjax / HF",
                "GB/s around the calls",
                "specjax / roofline",
                "decoding tok/s (prefill apart)",
                "decoding / roofline",
                "decoding / peak roofline",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
