r"""Per-position acceptance of an MTP layer trained here beside the other trained drafters, on
held-out prompts.

    .venv/bin/python benchmarks/mtp_acceptance.py [--heads heads] [--mt-bench 16] \
        [--max-new-tokens 128] [--batch-size 8] [--methods mtp,with-ngram,mlp-speculator,eagle3]

The built-in model has no MTP layers of its own; `make heads` trains one (`specjax train-mtp`,
DeepSeek-V3's module distilled on the target's own continuations) and an MLP speculator
(`specjax train-mlp-speculator`) on the same set as the other heads, Spec-Bench less MT-bench
(specjax.bench.HEADS_SPLIT). Each method drafts k = 3 a step, greedy, chat template, on MT-bench's
first turns 0..N-1 (held out: no head trained on them): MTP(k=3) over the model with the trained
layer, the MLP speculator's 3 stages, an EAGLE-3 chain of 3 (heads/eagle3, where it exists) and
WithNGram(MTP(k=1)) (the layer drafts one, prompt lookup over prompt, output and that draft two
more). Per draft position i: the conditional acceptance (accepted at i among the drafts that
reached i, EAGLE's definition) and the unconditional one (accepted at i per drafting step). Every
output is checked against plain greedy decoding. Batches of --batch-size prompts: acceptance does
not depend on the batch (greedy output is the same), only the time does, which is not reported.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import data_dir, machine, markdown_table, spec_bench_prompts

import specjax

METHODS = ("mtp", "with-ngram", "mlp-speculator", "eagle3")


def methods(model, heads: Path, names) -> dict:
    """The proposers compared, by label (of `names`, from METHODS): those whose heads exist under
    `heads`."""
    found = {}
    if (heads / "mtp" / "head").is_dir():
        with_mtp = model.with_mtp(specjax.load_head(heads / "mtp" / "head", model))
        if "mtp" in names:
            found["MTP k=3"] = (with_mtp, specjax.MTP(k=3))
        if "with-ngram" in names:
            found["WithNGram(MTP k=1, NGram k=2)"] = (with_mtp, specjax.WithNGram(specjax.MTP(k=1)))
    if "mlp-speculator" in names and (heads / "mlp_speculator" / "head").is_dir():
        head = specjax.load_head(heads / "mlp_speculator" / "head", model)
        found["MLP speculator k=3"] = (model, specjax.MLPSpeculator(head, k=3))
    if "eagle3" in names and (heads / "eagle3" / "head").is_dir():
        head = specjax.load_head(heads / "eagle3" / "head", model)
        found["EAGLE-3 chain k=3"] = (model, specjax.Eagle3(head, k=3))
    return found


def run(model, proposer, prompts: list[str], max_new_tokens: int, batch_size: int):
    """The new tokens of every prompt and, with a proposer, its counts summed over the batches:
    drafts that reached and were accepted at each position [k], and the drafting steps."""
    tokens, counts = [], {"reached": 0, "accepted": 0, "drafting_steps": 0}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        result = specjax.generate(model, chunk, proposer=proposer, max_new_tokens=max_new_tokens, chat=True)
        tokens += result.tokens
        if proposer is not None:
            m = result.metrics
            counts["reached"] = counts["reached"] + m.reached_at.sum(0)
            counts["accepted"] = counts["accepted"] + m.accepted_at.sum(0)
            counts["drafting_steps"] += int(m.drafting_steps.sum())
    return tokens, counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", default="heads", type=Path, help="folder of the heads (default heads)")
    parser.add_argument("--mt-bench", type=int, default=16, help="held-out MT-bench questions (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    parser.add_argument("--data", help="folder with spec_bench_question.jsonl")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)} (default all)"
    )
    args = parser.parse_args()
    model = specjax.load("smollm2-135m")
    prompts = [text for _, text in spec_bench_prompts(data_dir(args.data), args.mt_bench, ["mt_bench"])]
    print(
        f"machine: {machine()}\n{len(prompts)} held-out MT-bench first turns, {args.max_new_tokens} tokens\n"
    )
    plain, _ = run(model, None, prompts, args.max_new_tokens, args.batch_size)
    rows = []
    for label, (target, proposer) in methods(model, args.heads, args.methods.split(",")).items():
        tokens, c = run(target, proposer, prompts, args.max_new_tokens, args.batch_size)
        lossless = "yes" if tokens == plain else "NO"
        conditional = [a / r if r else float("nan") for a, r in zip(c["accepted"], c["reached"], strict=True)]
        unconditional = [a / c["drafting_steps"] for a in c["accepted"]]
        tau = 1 + c["accepted"].sum() / c["drafting_steps"]
        rows.append(
            [
                label,
                " / ".join(f"{x:.3f}" for x in conditional),
                " / ".join(f"{x:.3f}" for x in unconditional),
                f"{tau:.2f}",
                int(c["drafting_steps"]),
                lossless,
            ]
        )
        print(f"{label}: done", flush=True)
    header = [
        "method",
        "conditional acceptance, positions 1 / 2 / 3",
        "accepted at 1 / 2 / 3 per step",
        "tau",
        "drafting steps",
        "output = plain",
    ]
    print("\n" + markdown_table(header, rows))


if __name__ == "__main__":
    main()
