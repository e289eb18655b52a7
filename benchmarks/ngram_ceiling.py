"""How fast could prompt lookup be? Ceilings on NGram's speedup from plain greedy outputs.

    .venv/bin/python benchmarks/ngram_ceiling.py [--categories summarization,rag] [--per-category 80]
        [--outputs ngram_outputs.json]

Greedy speculative output equals plain greedy output, so one plain run per prompt fixes every
step a lookup proposer would take (specjax.speculate.replay replays them on the host, checked
against the compiled loop in tests/test_replay.py). For each category this prints plain decoding
steps over NGram steps, pooled over the prompts, for a sweep of k and n_min, and for the copy
oracle, which drafts from whichever earlier position agrees longest with the output: from the
positions that follow an earlier occurrence of the last token, no NGram setting or occurrence
rule needs fewer steps; from every position, no drafter that copies from the context does.

Each ratio bounds the wall-time speedup over plain decoding as long as a speculative step costs
at least a plain one (it scores more tokens; docs/benchmarks.md measures both) and the prefill,
the same in both, is left out; with the prefill in, as in spec_bench.py's tokens/s, the speedup
is lower still. With --verify-costs (a k+1-token verify step's time over a plain step's, from
`benchmarks/step_time.py --proposers plain verify-k1 ...`) it also predicts each setting's
decoding speedup: a step that drafts costs one verify pass, a step without a draft a plain step
(at batch 1 the loop then takes its one-token pass). Spec-Bench subset: the first
--per-category questions of each category (80 is all of a Spec-Bench category), chat template,
--max-new-tokens new tokens, batch 1 unless --batch-size says otherwise (all 160 summarization
and RAG prompts took about 10 minutes at batch 8 on the 2-core CPU of docs/benchmarks.md; batch 1
went several times slower).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from common import common_arguments, data_dir

import specjax
from specjax.bench import machine, markdown_table, parse_categories, spec_bench_prompts
from specjax.speculate.proposers import MAX_SPECULATIVE_TOKENS
from specjax.speculate.replay import copy_oracle_accepts, ngram_replay


def plain_outputs(args) -> list[dict]:
    """[{category, prompt, output}] token ids, from --outputs when it holds this very subset."""
    prompts = spec_bench_prompts(data_dir(args.data), args.per_category, args.categories)
    wanted = {
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "prompts": [text for _, text in prompts],
    }
    saved = Path(args.outputs) if args.outputs else None
    if saved and saved.exists():
        stored = json.loads(saved.read_text())
        if {k: stored[k] for k in wanted} == wanted:
            print(f"plain outputs read from {saved}", file=sys.stderr)
            return stored["rows"]
        print(f"{saved} holds another subset; generating again", file=sys.stderr)
    model = specjax.load("smollm2-135m")
    # Longest first, in batches of --batch-size rows of similar length (batch 1, the benchmarks'
    # setting, unless asked: a wider batch can break a near-tie of two logits differently).
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i][1]))
    rows: list[dict | None] = [None] * len(prompts)
    for first in range(0, len(order), args.batch_size):
        batch = order[first : first + args.batch_size]
        texts = [prompts[i][1] for i in batch]
        result = specjax.generate(model, texts, max_new_tokens=args.max_new_tokens, chat=True)
        for row, i in enumerate(batch):
            rows[i] = {
                "category": prompts[i][0],
                "prompt": result.prompt_tokens[row],
                "output": result.tokens[row],
            }
        print(f"{first + len(batch)}/{len(prompts)} generated", file=sys.stderr)
    if saved:
        saved.write_text(json.dumps(wanted | {"rows": rows}))
    return rows


def main() -> None:
    parser = common_arguments(__doc__, timed=False)  # nothing is timed: steps are counted
    parser.set_defaults(per_category=80)
    parser.add_argument(
        "--categories",
        default="summarization,rag",
        type=parse_categories,
        help="comma-separated Spec-Bench categories (default summarization,rag)",
    )
    parser.add_argument("--ks", default="1,2,3,4,5,6,8,10,12,16", help="NGram k values to sweep")
    parser.add_argument("--n-max", type=int, default=4, help="NGram n_max; n_min runs 1..n_max")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    parser.add_argument(
        "--verify-costs",
        type=parse_costs,
        help="k:cost,... a k+1-token verify step's time over a plain step's (benchmarks/step_time.py "
        "--proposers plain verify-k1 ...); adds predicted speedups",
    )
    parser.add_argument("--outputs", help="a JSON file to keep the plain outputs in (read back if present)")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    bad = [k for k in ks if not 1 <= k <= MAX_SPECULATIVE_TOKENS]
    if bad:
        raise SystemExit(f"--ks: k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {bad[0]}")
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.n_max < 1:
        raise SystemExit(f"--n-max must be >= 1, got {args.n_max}")
    rows = plain_outputs(args)

    settings = [(k, n_min) for n_min in range(1, args.n_max + 1) for k in ks]
    table, predicted_table = [], []
    for category in args.categories:
        chosen = [r for r in rows if r["category"] == category]
        plain_steps = sum(len(r["output"]) - 1 for r in chosen)

        def ceiling(steps: list[int], chosen=chosen, plain_steps=plain_steps):
            """Pooled plain steps over replayed steps (one count per prompt), and how many prompts
            reach 2 on their own."""
            at_two = sum(2 * s <= len(r["output"]) - 1 for s, r in zip(steps, chosen, strict=True))
            return plain_steps / sum(steps), at_two

        replays = {
            (k, n_min): [ngram_replay(r["prompt"], r["output"], k, args.n_max, n_min) for r in chosen]
            for k, n_min in settings
        }
        lookup = {setting: ceiling([len(r.accepted) for r in rs])[0] for setting, rs in replays.items()}
        best = max(lookup, key=lookup.get)
        any_ngram, any_ngram_at_two = ceiling(
            [len(copy_oracle_accepts(r["prompt"], r["output"], MAX_SPECULATIVE_TOKENS, 1)) for r in chosen]
        )
        any_copy, any_copy_at_two = ceiling(
            [len(copy_oracle_accepts(r["prompt"], r["output"])) for r in chosen]
        )
        table.append(
            [
                category,
                len(chosen),
                plain_steps,
                _cell(lookup, (5, 1)),
                _cell(lookup, (5, 3)),
                f"{lookup[best]:.2f} (k={best[0]}, n_min={best[1]})",
                f"{any_ngram:.2f} ({any_ngram_at_two})",
                f"{any_copy:.2f} ({any_copy_at_two})",
            ]
        )
        print(
            f"{category}: " + ", ".join(f"k={k}/n_min={n}: {v:.2f}" for (k, n), v in lookup.items()),
            file=sys.stderr,
        )
        if args.verify_costs:
            # A drafting step costs one verify pass over k + 1 tokens; a step without a draft
            # takes the one-token pass, a plain step's cost.
            predicted = {
                (k, n_min): plain_steps
                / sum(np.where(r.drafted > 0, args.verify_costs[k], 1.0).sum() for r in rs)
                for (k, n_min), rs in replays.items()
                if k in args.verify_costs
            }
            best_predicted = max(predicted, key=predicted.get)
            predicted_table.append(
                [
                    category,
                    _cell(predicted, (5, 1)),
                    _cell(predicted, (5, 3)),
                    f"{predicted[best_predicted]:.2f} (k={best_predicted[0]}, n_min={best_predicted[1]})",
                ]
            )
    print(machine())
    print(
        f"plain decoding steps / NGram steps (n_max={args.n_max}), pooled over each category's "
        f"prompts; in parentheses, prompts whose own ratio is 2 or more. Any NGram: the copy oracle\n"
        f"over starts that follow the last token (bounds every n_max, n_min, k <= {MAX_SPECULATIVE_TOKENS} "
        "and occurrence rule);\nany copy: over every start, any k (bounds every drafter copying from "
        "the context)\n"
    )
    print(
        markdown_table(
            [
                "category",
                "prompts",
                "plain steps",
                "NGram k=5 n_min=1",
                "NGram k=5 n_min=3",
                "best NGram setting",
                "any NGram (oracle)",
                "any copy (oracle)",
            ],
            table,
        )
    )
    if predicted_table:
        print(
            "\npredicted decoding speedup (prefill apart): plain steps over the replayed steps "
            "weighted by --verify-costs\n"
        )
        header = ["category", "NGram k=5 n_min=1", "NGram k=5 n_min=3", "best NGram setting"]
        print(markdown_table(header, predicted_table))


def _cell(values: dict, setting: tuple[int, int]) -> str:
    return f"{values[setting]:.2f}" if setting in values else "-"


def parse_costs(text: str) -> dict[int, float]:
    """--verify-costs "1:1.2,5:1.9" -> {1: 1.2, 5: 1.9}."""
    costs = {}
    for item in text.split(","):
        k, _, cost = item.partition(":")
        try:
            costs[int(k)] = float(cost)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected k:cost pairs like 1:1.2,5:1.9, got {item!r}"
            ) from None
        if not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS or costs[int(k)] < 1:
            raise argparse.ArgumentTypeError(
                f"k must be in 1..{MAX_SPECULATIVE_TOKENS} and a cost at least 1 (a plain step), got {item!r}"
            )
    return costs


if __name__ == "__main__":
    main()
