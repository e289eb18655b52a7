"""Plain greedy decoding: specjax against HF transformers, same weights, same prompts, one run.

    .venv/bin/python benchmarks/plain_decoding.py [--per-category 2] [--max-new-tokens 128]

Batch 1, greedy, chat template on, float32. Tokens/s counts the new tokens over the wall time of
a whole generate call (prefill included), median of --repeats runs after a warm-up; specjax's
compile time is reported apart. The roofline is the float32 weight bytes over the machine's
measured read bandwidth: the faster of a 1-row XLA product and a 1-row product of the CPU panel
kernel (specjax.kernels, what decoding runs) over a 453 MB matrix. The roofline models decoding
steps, not the prefill, so the table also gives specjax's decoding rate apart from it: the new
tokens after the first over (whole call - a call for one new token), medians both.
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


def read_bandwidth_gbs(repeats: int = 20) -> dict[str, float]:
    """Bytes per second read by a 1-row float32 product with a [576, 196608] matrix: by XLA
    (`x @ w`) and, where it loads, by the panel kernel over the same matrix packed."""

    w = jax.random.normal(jax.random.key(0), (576, 196608), jnp.float32)
    x = jnp.ones((1, 576), jnp.float32)
    nbytes = w.nbytes  # the packed copy holds the same bytes (196608 columns fill whole panels)

    def best_rate(product, w, x):
        product(w, x).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            product(w, x).block_until_ready()
            best = min(best, time.perf_counter() - start)
        return nbytes / best / 1e9

    rates = {"XLA product": best_rate(jax.jit(lambda w, x: x @ w), w, x)}
    if kernels.enabled():
        packed = kernels.pack(w)
        del w
        rates["panel kernel"] = best_rate(jax.jit(lambda w, x: kernels.panel_matmul(x, w)), packed, x)
    return rates


def main() -> None:
    parser = common_arguments(__doc__)
    args = parser.parse_args()

    prompts = spec_bench_prompts(data_dir(args.data), args.per_category)
    model = specjax.load("smollm2-135m")
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))

    hf = None if args.no_hf else load_hf_reference()
    if hf is not None:
        import torch

    per_category: dict[str, list] = {}
    compile_times = []
    for category, text in prompts:

        def run(text=text):
            return specjax.generate(model, [text], max_new_tokens=args.max_new_tokens, chat=True)

        warm = run()
        compile_times.append(warm.metrics.compile_time_s)
        n_new = len(warm.tokens[0])
        whole = median_time(run, args.repeats)
        ours = n_new / whole

        def prefill(text=text):
            return specjax.generate(model, [text], max_new_tokens=1, chat=True)

        prefill()
        decoding = (n_new - 1) / (whole - median_time(prefill, args.repeats))
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
        per_category.setdefault(category, []).append(
            (ours, theirs, len(warm.prompt_tokens[0]), n_new, decoding)
        )

    rates = read_bandwidth_gbs()
    bandwidth = max(rates.values())
    roofline = bandwidth * 1e9 / weight_bytes
    rows = []
    for category, values in per_category.items():
        ours = statistics.mean(v[0] for v in values)
        theirs = statistics.mean(v[1] for v in values)
        decoding = statistics.mean(v[4] for v in values)
        rows.append(
            [
                category,
                len(values),
                round(statistics.mean(v[2] for v in values)),
                ours,
                theirs,
                ours / theirs,
                ours / roofline,
                decoding,
                decoding / roofline,
            ]
        )
    all_ours = [v[0] for vs in per_category.values() for v in vs]
    all_theirs = [v[1] for vs in per_category.values() for v in vs]
    all_decoding = [v[4] for vs in per_category.values() for v in vs]
    rows.append(
        [
            "all",
            len(all_ours),
            "",
            statistics.mean(all_ours),
            statistics.mean(all_theirs),
            statistics.mean(all_ours) / statistics.mean(all_theirs),
            statistics.mean(all_ours) / roofline,
            statistics.mean(all_decoding),
            statistics.mean(all_decoding) / roofline,
        ]
    )
    print(f"\nmachine: {machine()}")
    print(
        f"weights: {weight_bytes / 1e6:.0f} MB float32; read bandwidth {bandwidth:.1f} GB/s "
        f"({', '.join(f'{name} {rate:.1f}' for name, rate in rates.items())}); "
        f"roofline {roofline:.1f} tok/s; compile {np.median(compile_times):.1f} s per prompt bucket (median)"
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
                "specjax / roofline",
                "specjax decoding tok/s (prefill apart)",
                "decoding / roofline",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
