"""Speculative decoding on Spec-Bench: specjax proposers against plain decoding and HF transformers.

    .venv/bin/python benchmarks/spec_bench.py [--per-category 2] [--max-new-tokens 128]

A fixed subset of Spec-Bench (the first --per-category questions of each category, MT-bench's
eight sub-categories taken round-robin as one "mt_bench" category; see common.py), first turn
only, chat template on, batch 1, greedy, float32, the built-in model. For each category: tokens/s
(new tokens over the wall time of a whole generate call, prefill included, median of --repeats
after a warm-up), speedup over specjax plain decoding, and mean acceptance length (tokens per
target forward pass, counting the bonus token). HF transformers runs its prompt lookup
(`prompt_lookup_num_tokens`) and its early-exit self-draft (`assistant_early_exit`) on the same
prompts and token ids. Every speculative output is checked against plain greedy output.
"""

from __future__ import annotations

import statistics

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


def main() -> None:
    parser = common_arguments(__doc__)
    parser.add_argument("--ngram-k", type=int, default=5)
    parser.add_argument("--self-draft-layers", type=int, default=8)
    parser.add_argument("--self-draft-k", type=int, default=3)
    args = parser.parse_args()

    prompts = spec_bench_prompts(data_dir(args.data), args.per_category)
    model = specjax.load("smollm2-135m")
    methods = {
        "plain": None,
        f"NGram(k={args.ngram_k})": specjax.NGram(k=args.ngram_k, n_max=4, n_min=1),
        f"SelfDraft(layers={args.self_draft_layers}, k={args.self_draft_k})": specjax.SelfDraft(
            layers=args.self_draft_layers, k=args.self_draft_k
        ),
    }
    hf = None if args.no_hf else load_hf_reference()
    if hf is not None:
        import torch

        hf_methods = {
            "HF plain": {},
            f"HF prompt lookup ({args.ngram_k})": {"prompt_lookup_num_tokens": args.ngram_k},
            f"HF early exit ({args.self_draft_layers})": {"assistant_early_exit": args.self_draft_layers},
        }

    # results[category][method] = list of (tokens/s, mean acceptance length)
    results: dict[str, dict[str, list]] = {}
    mismatches = []
    for i, (category, text) in enumerate(prompts):
        print(f"[{i + 1}/{len(prompts)}] {category}", flush=True)
        plain_tokens = None
        for name, proposer in methods.items():

            def run(proposer=proposer, text=text):
                return specjax.generate(
                    model, [text], proposer=proposer, max_new_tokens=args.max_new_tokens, chat=True
                )

            warm = run()
            if proposer is None:
                plain_tokens, prompt_ids = warm.tokens[0], warm.prompt_tokens[0]
            elif warm.tokens[0] != plain_tokens:
                mismatches.append((category, name))
            speed = len(warm.tokens[0]) / median_time(run, args.repeats)
            tau = warm.metrics.mean_acceptance_length if proposer is not None else 1.0
            results.setdefault(category, {}).setdefault(name, []).append((speed, tau))
        if hf is not None:
            ids = torch.tensor([prompt_ids])
            for name, kwargs in hf_methods.items():

                def hf_run(ids=ids, kwargs=kwargs):
                    with torch.no_grad():
                        return hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)

                n_new = hf_run().shape[1] - ids.shape[1]
                results[category].setdefault(name, []).append(
                    (n_new / median_time(hf_run, args.repeats), float("nan"))
                )

    names = list(results[prompts[0][0]])
    header = ["category"] + [f"{n} tok/s" for n in names] + [f"{n} speedup" for n in names[1:]]
    header += [f"{n} tau" for n in list(methods)[1:]]
    rows = []
    for category, by_method in results.items():
        speed = {n: statistics.mean(v[0] for v in by_method[n]) for n in names}
        tau = {n: statistics.mean(v[1] for v in by_method[n]) for n in list(methods)[1:]}
        rows.append(
            [category]
            + [speed[n] for n in names]
            + [speed[n] / speed["plain"] for n in names[1:]]
            + [tau[n] for n in tau]
        )
    print(f"\nmachine: {machine()}")
    print(
        f"batch 1, greedy, chat template, {args.max_new_tokens} new tokens, {args.per_category} prompts per "
        f"category, median of {args.repeats}; speedup is over specjax plain decoding; tau = mean acceptance "
        "length (tokens per target forward, bonus included)\n"
    )
    print(markdown_table(header, rows))
    print(f"\nspeculative outputs that differ from plain greedy: {mismatches or 'none'}")


if __name__ == "__main__":
    main()
