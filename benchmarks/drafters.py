r"""The trained drafters side by side: head accuracy, drafting cost, and the loop on held-out prompts.

    .venv/bin/python benchmarks/drafters.py [--mt-bench 8] [--code 3] [--per-category 2] \
        [--max-new-tokens 128] [--repeats 2] [--heads heads] [--cache /tmp/mt_bench_val.npz]

Every head here (`make heads`) was distilled from the same set, Spec-Bench's questions without
MT-bench's, with the same budget (400 steps of 8 sequences). Three parts, one table each:

1. Head accuracy, teacher-forced on the validation set of benchmarks/head_accuracy.py (the target's
   answers to MT-bench questions 8:48): how often the draft at positions 1..3 equals the target's
   next token. EAGLE-1 and EAGLE-3: pass p feeds the head its own outputs p - 1 times; DFlash: slot p
   of a block; Medusa: head p.
2. Drafting cost per step, in plain decoding steps (specjax.measure_step_costs: every draft of a
   step, EOS banned, forced acceptance 0 so every run takes the same steps), and what one verify
   pass of k + 1 tokens costs.
3. The loop: plain decoding, NGram, Medusa, EAGLE-1, EAGLE-3, DFlash, their chains of one draft
   (eagle-k1, eagle3-k1) and Hybrid(NGram, EAGLE-3) with a head chain of 4 (hybrid) or of 1
   (hybrid-k1), each Hybrid also gated (a GoodputSchedule with its head's costs, measured in part
   2 or here: the head drafts only where its acceptance pays) and with its n-gram part alone
   (NGram(k=4, n_min=3)), and the chains of 4 and of one verifying only their confident drafts
   (eagle-conf, eagle3-conf, eagle-k1-conf, eagle3-k1-conf: the product of the drafts'
   probabilities under the head at least --confidence-threshold), greedy, batch 1, chat template,
   on prompts no head trained on: MT-bench
   first turns 0..N-1 (the validation questions are 8:48), HumanEval functions to complete and
   InstructCoder code edits (not in the distillation set); and on Spec-Bench's other categories,
   marked "(trained)": the heads were distilled from those very questions, so their cells
   overstate a head. Tokens/s are whole generate calls (prefill included), the median of
   --repeats after a warm-up; the timed calls run in rounds, every method in turn on the same
   prompt, and the held-out summary gives each speedup's range over the rounds (the run's noise).
   Speedup is over plain decoding of the same prompts in the same run; tau is the mean acceptance
   length. Every output is checked against plain greedy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import numpy as np
from common import data_dir, spec_bench_prompts
from head_accuracy import validation_set

import specjax
from specjax import bench
from specjax.models import DFlashHead, Eagle3Head
from specjax.models.eagle import EagleHead
from specjax.train import evaluate_dflash, evaluate_eagle, evaluate_eagle3, evaluate_medusa, load_head

HEADS = {"EAGLE-1": "eagle", "EAGLE-3": "eagle3", "DFlash": "dflash", "Medusa": "medusa"}
METHODS = (
    "ngram,medusa,eagle,eagle-tree,eagle3,eagle3-tree,dflash,hybrid,eagle-k1,eagle3-k1,hybrid-k1,"
    "eagle-conf,eagle3-conf,eagle-k1-conf,eagle3-k1-conf"
)
TRAINED = bench.HEADS_SPLIT.trained_categories  # the heads' distillation set: marked, not held out


def code_prompts(folder: Path, count: int) -> list[tuple[str, str]]:
    """(category, prompt) pairs: the first `count` HumanEval functions to complete and the first
    `count` InstructCoder edits, phrased as a user would ask."""

    def rows(name):
        with (folder / name).open() as f:
            return [json.loads(line) for line in f if line.strip()][:count]

    prompts = [
        ("humaneval", "Complete this Python function. Return the whole function.\n\n" + r["prompt"])
        for r in rows("humaneval.jsonl")
    ]
    prompts += [
        ("code_edit", f"{r['instruction'].strip()} Return the whole edited code.\n\n{r['input']}")
        for r in rows("instructcoder_edit_eval.jsonl")
    ]
    return prompts


def head_accuracy(model, heads: Path, cache: Path | None, data: Path) -> dict[str, list[float]]:
    order = [text for _, text in spec_bench_prompts(data, 80, ["mt_bench"])]
    validation, starts = validation_set(model, order[8:48], cache)
    positions = np.arange(validation.tokens.shape[1])[None, :]
    answers = dataclasses.replace(validation, mask=validation.mask & (positions >= starts[:, None] - 1))
    scores = {}
    for label, kind in HEADS.items():
        head = load_head(str(heads / kind / "head"), model)
        if isinstance(head, EagleHead | Eagle3Head):
            evaluate = evaluate_eagle if isinstance(head, EagleHead) else evaluate_eagle3
            m = evaluate(head, model, answers, unroll=3)
            scores[label] = [m["accuracy"], m["accuracy_2"], m["accuracy_3"]]
        elif isinstance(head, DFlashHead):
            m = evaluate_dflash(head, model, answers)
            scores[label] = [m["accuracy"], m["accuracy_2"], m["accuracy_3"]]
        else:
            scores[label] = list(evaluate_medusa(head, model, answers)["head_accuracy"][:3])
    return scores


def drafting_costs(model, methods: dict, prompts: list[str]) -> dict[str, dict]:
    """measure_step_costs of every chain proposer with a k (not trees, Hybrid or a Medusa chain,
    whose draft count is its heads')."""
    costs = {}
    for name, proposer in methods.items():
        if proposer is None or "tree" in name or "Hybrid" in name or getattr(proposer, "k", None) is None:
            continue
        costs[name] = specjax.measure_step_costs(model, proposer, prompts, max_new_tokens=64)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", help="folder with the prompt sets (default: $SPECJAX_DATA or ../shared/data)"
    )
    parser.add_argument("--heads", default="heads", type=Path, help="folder of the heads (default heads)")
    parser.add_argument("--mt-bench", type=int, default=8, help="held-out MT-bench questions (default 8)")
    parser.add_argument(
        "--code", type=int, default=3, help="HumanEval and InstructCoder prompts each (default 3)"
    )
    parser.add_argument(
        "--per-category", type=int, default=2, help="prompts of each trained-on category (default 2; 0: none)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls after a warm-up (default 2)")
    parser.add_argument("--cache", type=Path, help="an .npz to keep the validation set in between runs")
    parser.add_argument(
        "--parts", default="accuracy,costs,loop", help="comma-separated, of: accuracy, costs, loop"
    )
    parser.add_argument(
        "--gate-costs",
        help="DRAFT,VERIFY: the gated Hybrid's costs per token, in plain steps (default: measured "
        "here, as part 2 does; give another run's to compare runs)",
    )
    parser.add_argument(
        "--methods",
        default=METHODS,
        help=f"comma-separated, of: {METHODS} (default all; a hybrid adds its gated form and n-gram part)",
    )
    parser.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.2,
        help="the *-conf methods' threshold on a draft's path probability (default 0.2)",
    )
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    if not parts or parts - {"accuracy", "costs", "loop"}:
        parser.error(f"--parts must be comma-separated, of: accuracy, costs, loop; got {args.parts!r}")
    gate_costs = None
    if args.gate_costs is not None:
        try:
            gate_costs = dict(
                zip(["draft_cost", "verify_cost"], map(float, args.gate_costs.split(",")), strict=True)
            )
        except ValueError:
            parser.error(
                f"--gate-costs must be two numbers, DRAFT,VERIFY (e.g. 0.113,0.126); got {args.gate_costs!r}"
            )
    if not 1 <= args.mt_bench <= 8:
        parser.error(
            f"--mt-bench must be in 1..8 (questions 8:48 are the validation set), got {args.mt_bench}"
        )
    try:
        data = data_dir(args.data)
        wanted = {m.strip() for m in args.methods.split(",")}
        if not wanted or wanted - set(METHODS.split(",")):
            raise ValueError(f"--methods must be comma-separated, of: {METHODS}; got {args.methods!r}")
        descriptions = bench.method_descriptions(
            args.methods, heads=args.heads, confidence_threshold=args.confidence_threshold
        )
    except ValueError as error:
        raise SystemExit(f"drafters.py: error: {error}") from None

    model = specjax.load("smollm2-135m")
    print(f"machine: {bench.machine()}\n")
    if "accuracy" in parts:
        scores = head_accuracy(model, args.heads, args.cache, data)
        print("head accuracy, teacher-forced, MT-bench 8:48 (positions 1, 2, 3):\n")
        rows = [[label, *[f"{s:.3f}" for s in values]] for label, values in scores.items()]
        print(bench.markdown_table(["head", "1", "2", "3"], rows) + "\n", flush=True)

    methods = bench.make_methods(model, descriptions)
    mt_bench = spec_bench_prompts(data, args.mt_bench, ["mt_bench"])
    costs = {}
    if "costs" in parts:
        costs = drafting_costs(model, methods, [text for _, text in mt_bench[:2]])
        print("cost per step in plain steps (measure_step_costs, 2 MT-bench prompts, 64 tokens):\n")
        rows = [
            [name, c["k"], c["k"] * c["draft_cost"], 1 + c["k"] * c["verify_cost"], c["plain_step_s"] * 1e3]
            for name, c in costs.items()
        ]
        header = ["method", "k", "drafting / plain step", "verify pass / plain step", "plain step ms"]
        print(bench.markdown_table(header, rows) + "\n", flush=True)

    hybrids = [name for name in methods if name.startswith("Hybrid")]
    for hybrid in hybrids if "loop" in parts else []:
        head = methods[hybrid].then
        head_k = f"EAGLE-3 chain k={head.k}"
        head_costs = (
            gate_costs
            or costs.get(head_k)
            or specjax.measure_step_costs(model, head, [text for _, text in mt_bench[:2]], max_new_tokens=64)
        )
        gate = specjax.GoodputSchedule(
            draft_cost=head_costs["draft_cost"], verify_cost=head_costs["verify_cost"]
        )
        print(
            f"{hybrid}, gated: GoodputSchedule(draft_cost={gate.draft_cost:.3f}, "
            f"verify_cost={gate.verify_cost:.3f}) per token "
            f"({head_k}'s costs{', given' if gate_costs else ''})\n",
            flush=True,
        )
        first = methods[hybrid].first
        # Its parts alone, as it holds them: the bar "at least the better of its parts" is set by these.
        methods[f"NGram(k={first.k}, n_min={first.n_min})"] = first
        methods.setdefault(head_k, head)
        methods[f"{hybrid}, gated"] = specjax.Hybrid(first, head, gate=gate)
    if "loop" in parts:
        prompts = mt_bench + code_prompts(data, args.code)
        if args.per_category:
            prompts += spec_bench_prompts(data, args.per_category, TRAINED)

        def progress(tick: bench.Tick) -> None:
            if tick.method == "plain" and tick.done % (args.repeats + 1) == 1:
                print(f"[{tick.prompt_index + 1}/{tick.num_prompts}] {tick.category}", flush=True)

        result = bench.run_spec_bench(
            model,
            prompts,
            methods,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            progress=progress,
        )
        print(result.report("markdown"))
        # Each category, then the held-out ones together: each method's mean speedup and tau over
        # their prompts, and its speedup per round with the rounds' range (the run's noise).
        held = [c for c in result.speeds if not bench.HEADS_SPLIT.trained_on(c)]
        for categories in [[c] for c in result.speeds] + ([held] if len(held) > 1 else []):
            rows = []
            for name in result.speculative:
                ratios = [
                    s / p
                    for c in categories
                    for s, p in zip(result.speeds[c][name], result.speeds[c]["plain"], strict=True)
                ]
                taus = [t for c in categories for t in result.taus[c][name]]
                rounds = result.round_speedups(categories, name)
                spread = f"{min(rounds):.3f}-{max(rounds):.3f}"
                rows.append(
                    [name, statistics.mean(ratios), statistics.median(rounds), spread, statistics.mean(taus)]
                )
            label = " + ".join(result.label(c) for c in categories)
            print(
                f"\n{label}: per-prompt mean speedup; per round (every prompt's tokens "
                "over its seconds in that round), the median and range; tau:\n"
            )
            header = ["method", "speedup", "per round, median", "per round, range", "tau"]
            print(bench.markdown_table(header, rows), flush=True)


if __name__ == "__main__":
    main()
