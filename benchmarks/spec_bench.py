"""Speculative decoding on Spec-Bench: specjax proposers against plain decoding and HF transformers.

    .venv/bin/python benchmarks/spec_bench.py [--per-category 2] [--max-new-tokens 128]
        [--methods plain,ngram,selfdraft,medusa,medusa-tree,eagle,eagle-tree] [--categories mt_bench]
        [--heads heads]

A fixed subset of Spec-Bench (the first --per-category questions of each category, MT-bench's
eight sub-categories taken round-robin as one "mt_bench" category; see common.py), first turn
only, chat template on, batch 1, greedy, float32, the built-in model. For each category: tokens/s
(new tokens over the wall time of a whole generate call, prefill included, median of --repeats
after a warm-up), speedup over specjax plain decoding, and mean acceptance length (tokens per
target forward pass, counting the bonus token). HF transformers runs its prompt lookup
(`prompt_lookup_num_tokens`) and its early-exit self-draft (`assistant_early_exit`) on the same
prompts and token ids. Every speculative output is checked against plain greedy output.

Trained heads (`make heads`) are read from --heads: `medusa/head` and `eagle/head` there. They
were trained on Spec-Bench's other categories, so only the mt_bench rows are held out for them
(see the README's training section); the per-position table gives each head's conditional
acceptance (EAGLE's definition: accepted at position i among the drafts that reached it).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from common import (
    EAGLE_TREE,
    SPEC_BENCH_CATEGORIES,
    common_arguments,
    data_dir,
    load_hf_reference,
    machine,
    markdown_table,
    median_time,
    spec_bench_prompts,
)

import specjax

METHODS = ("plain", "ngram", "selfdraft", "medusa", "medusa-tree", "eagle", "eagle-tree")


def widths(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in text.split(","))


def make_methods(args, model) -> dict:
    """The proposers to run, by display name (None: plain decoding)."""
    wanted = args.methods.split(",")
    unknown = sorted(set(wanted) - set(METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {', '.join(METHODS)}")
    heads = Path(args.heads)
    medusa = eagle = None
    if any(m.startswith("medusa") for m in wanted):
        if not (heads / "medusa" / "head").is_dir():
            raise SystemExit(f"no Medusa head in {heads}/medusa/head: run `make heads` or pass --heads")
        medusa = specjax.train.load_head(heads / "medusa" / "head", model)
    if any(m.startswith("eagle") for m in wanted):
        if not (heads / "eagle" / "head").is_dir():
            raise SystemExit(f"no EAGLE head in {heads}/eagle/head: run `make heads` or pass --heads")
        eagle = specjax.train.load_head(heads / "eagle" / "head", model)
    tree = specjax.TokenTree.top_k(widths(args.medusa_tree))
    every = {
        "plain": ("plain", None),
        "ngram": (f"NGram(k={args.ngram_k})", lambda: specjax.NGram(k=args.ngram_k, n_max=4, n_min=1)),
        "selfdraft": (
            f"SelfDraft(layers={args.self_draft_layers}, k={args.self_draft_k})",
            lambda: specjax.SelfDraft(layers=args.self_draft_layers, k=args.self_draft_k),
        ),
        "medusa": ("Medusa chain", lambda: specjax.Medusa(medusa)),
        "medusa-tree": (
            f"Medusa tree top_k{widths(args.medusa_tree)}",
            lambda: specjax.Medusa(medusa, tree=tree),
        ),
        "eagle": (f"EAGLE chain k={args.eagle_k}", lambda: specjax.Eagle(eagle, k=args.eagle_k)),
        "eagle-tree": (
            f"EAGLE tree ({len(EAGLE_TREE)} nodes)",
            lambda: specjax.Eagle(eagle, tree=EAGLE_TREE),
        ),
    }
    methods = {"plain": None}  # always: the speedups are over it
    for m in wanted:
        name, make = every[m]
        if make is not None:
            methods[name] = make()
    return methods


def main() -> None:
    parser = common_arguments(__doc__)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}"
    )
    parser.add_argument("--categories", default=",".join(SPEC_BENCH_CATEGORIES), help="comma-separated")
    parser.add_argument(
        "--heads", default="heads", help="folder with medusa/head and eagle/head (make heads)"
    )
    parser.add_argument("--ngram-k", type=int, default=5)
    parser.add_argument("--self-draft-layers", type=int, default=8)
    parser.add_argument("--self-draft-k", type=int, default=3)
    parser.add_argument("--medusa-tree", default="3,2", help="top-k widths per depth (default 3,2)")
    parser.add_argument("--eagle-k", type=int, default=4)
    args = parser.parse_args()

    categories = args.categories.split(",")
    prompts = [p for p in spec_bench_prompts(data_dir(args.data), args.per_category) if p[0] in categories]
    if not prompts:
        raise SystemExit(
            f"--categories: none of {categories} is a Spec-Bench category {SPEC_BENCH_CATEGORIES}"
        )
    model = specjax.load("smollm2-135m")
    methods = make_methods(args, model)
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
    # per_position[category][method] = [accepted_at, reached_at] summed over the prompts
    per_position: dict[str, dict[str, list]] = {}
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
            if proposer is not None:
                m = warm.metrics
                counts = per_position.setdefault(category, {}).setdefault(name, [0, 0])
                counts[0] = counts[0] + m.accepted_at.sum(0)
                counts[1] = counts[1] + m.reached_at.sum(0)
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
    speculative = list(methods)[1:]
    header = ["category"] + [f"{n} tok/s" for n in names] + [f"{n} speedup" for n in names[1:]]
    header += [f"{n} tau" for n in speculative]
    rows = []
    for category, by_method in results.items():
        speed = {n: statistics.mean(v[0] for v in by_method[n]) for n in names}
        tau = {n: statistics.mean(v[1] for v in by_method[n]) for n in speculative}
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
    print("\nconditional acceptance per draft position (accepted / reached), summed over the prompts:\n")
    position_rows = []
    for category, by_method in per_position.items():
        for name, (accepted, reached) in by_method.items():
            rates = np.where(reached > 0, accepted / np.maximum(reached, 1), np.nan)
            position_rows.append([category, name, " ".join(f"{r:.2f}" for r in rates)])
    print(markdown_table(["category", "method", "position 1, 2, ..."], position_rows))
    print(f"\nspeculative outputs that differ from plain greedy: {mismatches or 'none'}")


if __name__ == "__main__":
    main()
