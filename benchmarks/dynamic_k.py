"""Dynamic speculation length against the best fixed k, and tokens/s against forced acceptance.

    .venv/bin/python benchmarks/dynamic_k.py --per-category 1 --max-new-tokens 128

Part "dynamic": for NGram and SelfDraft, every fixed k in --ks against Dynamic(...) at the
largest k with HF's heuristic schedule and with the goodput controller (its draft and verify costs
measured first on this machine by GoodputSchedule.measure). Spec-Bench prompts, batch 1, greedy,
chat template: every configuration emits plain greedy decoding's tokens (the script does not check
this; tests/test_dynamic.py does, on tiny models).

Part "forced": ForcedAcceptance at the --rates with free drafts (the loop's own ceiling) and with
SelfDraft's drafts (plus its drafting cost), k = 4, the first question of each category, EOS
banned so every row runs to max_new_tokens. Shows how much of a speedup system overhead leaves at
each acceptance.

Both parts run through specjax.ablate (speedup over plain decoding measured in the same sweep),
print their tables and write them as CSV files to --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import specjax  # noqa: E402
from specjax.bench import (  # noqa: E402
    SPEC_BENCH_CATEGORIES,
    data_dir,
    machine,
    parse_categories,
    spec_bench_by_category,
)


def table(df, columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    for _, row in df.iterrows():
        cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dynamic_part(model, prompts, args) -> None:
    K = max(args.ks)
    plain_prompts = [p for rows in prompts.values() for p in rows][:2]
    families = {"NGram": lambda k: specjax.NGram(k=k), "SelfDraft(8)": lambda k: specjax.SelfDraft(8, k=k)}
    proposers = {}
    for family, make in families.items():
        costs = specjax.GoodputSchedule.measure(model, make(K), plain_prompts, max_new_tokens=64)
        print(
            f"{family}: measured draft_cost {costs.draft_cost:.3f}, verify_cost {costs.verify_cost:.3f} "
            "(per token, in plain decoding steps)",
            file=sys.stderr,
        )
        for k in args.ks:
            proposers[f"{family} k={k}"] = make(k)
        proposers[f"{family} dynamic heuristic (K={K})"] = specjax.Dynamic(
            make(K), specjax.HeuristicSchedule()
        )
        proposers[f"{family} dynamic goodput (K={K})"] = specjax.Dynamic(make(K), costs)
    df = specjax.ablate(model, prompts, proposers, max_new_tokens=args.max_new_tokens, chat=True)
    df.to_csv(args.out / "dynamic_k.csv", index=False)
    overall = df.groupby("proposer", sort=False)[["num_emitted_tokens", "run_time_s"]].sum()
    plain = overall.loc["plain"]
    overall["tok/s"] = overall["num_emitted_tokens"] / overall["run_time_s"]
    overall["speedup"] = overall["tok/s"] / (plain["num_emitted_tokens"] / plain["run_time_s"])
    drafts = df.groupby("proposer", sort=False)[["num_accepted_tokens", "num_drafts"]].sum()
    overall["tau"] = 1 + drafts["num_accepted_tokens"] / drafts["num_drafts"]
    print("\nAll categories together (tokens over run time):\n")
    print(table(overall.reset_index(), ["proposer", "tok/s", "speedup", "tau"]))
    print("\nPer category (speedup over plain):\n")
    wide = df.pivot_table(index="proposer", columns="category", values="speedup", sort=False)
    print(table(wide.reset_index(), ["proposer", *wide.columns]))


def forced_part(model, prompts, args) -> None:
    eos = {int(t) for t in model.config.eos_token_ids} | {int(model.tokenizer.eos_token_id)}
    sampling = specjax.Sampling(logit_bias={t: -1e9 for t in eos})
    proposers = {}
    for rate in args.rates:
        proposers[f"free drafts, rate {rate}"] = specjax.ForcedAcceptance(rate, k=4)
        proposers[f"SelfDraft(8) drafts, rate {rate}"] = specjax.ForcedAcceptance(
            rate, specjax.SelfDraft(8, k=4)
        )
    first = {category: rows[:1] for category, rows in prompts.items()}
    df = specjax.ablate(model, first, proposers, samplings=[sampling], max_new_tokens=args.max_new_tokens)
    df.to_csv(args.out / "forced_acceptance.csv", index=False)
    overall = df.groupby("proposer", sort=False)[["num_emitted_tokens", "run_time_s", "steps"]].sum()
    overall["tok/s"] = overall["num_emitted_tokens"] / overall["run_time_s"]
    plain = overall.loc["plain"]
    overall["speedup"] = overall["tok/s"] / plain["tok/s"]
    overall["tokens per step"] = overall["num_emitted_tokens"] / overall["steps"]
    print("\nForced acceptance, k = 4 (all categories together):\n")
    print(table(overall.reset_index(), ["proposer", "tokens per step", "tok/s", "speedup"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data",
        default=None,
        help="folder of spec_bench_question.jsonl (default: $SPECJAX_DATA or ../shared/data)",
    )
    parser.add_argument(
        "--per-category", type=int, default=1, help="the first N questions of each category (default 1)"
    )
    parser.add_argument(
        "--categories",
        default=",".join(SPEC_BENCH_CATEGORIES),
        help=f"comma-separated, of: {', '.join(SPEC_BENCH_CATEGORIES)} (default: all)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--ks", default="1,2,4,8", help="fixed k values; dynamic runs at the largest")
    parser.add_argument("--rates", default="0,0.25,0.5,0.75,1", help="forced acceptance rates")
    parser.add_argument("--parts", default="dynamic,forced", help="comma-separated, of: dynamic, forced")
    parser.add_argument("--out", default="/tmp/specjax_dynamic_k", help="folder for the CSV tables")
    args = parser.parse_args()
    args.parts = [part.strip() for part in args.parts.split(",")]
    if not args.parts or set(args.parts) - {"dynamic", "forced"}:
        parser.error(f"--parts must be comma-separated, of: dynamic, forced; got {','.join(args.parts)!r}")
    args.ks = [int(k) for k in args.ks.split(",")]
    args.rates = [float(r) for r in args.rates.split(",")]
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    model = specjax.load("smollm2-135m")
    prompts = spec_bench_by_category(
        data_dir(args.data), args.per_category, parse_categories(args.categories)
    )
    print(f"Machine: {machine()}", file=sys.stderr)
    if "dynamic" in args.parts:
        dynamic_part(model, prompts, args)
    if "forced" in args.parts:
        forced_part(model, prompts, args)


if __name__ == "__main__":
    main()
