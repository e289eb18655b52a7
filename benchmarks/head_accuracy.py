r"""How often trained heads agree with the target on held-out chat answers, teacher-forced.

    .venv/bin/python benchmarks/head_accuracy.py heads/eagle/head heads/medusa/head \
        heads/eagle3/head heads/dflash/head [--questions 8:48] [--passes 3] [--cache /tmp/val.npz]

The validation set: MT-bench first turns (Spec-Bench's mt_bench category, in the round-robin order
of `spec_bench_prompts`) at positions --questions, default 8:48 (40 questions, five of each
sub-category; `spec_bench.py --categories mt_bench --per-category 4` times positions 0-3, so
the two never meet), each with the target's greedy answer (128 tokens, chat template) and its
hidden states. None of MT-bench is in the heads' training sets: `make heads` trains on the split
specjax.bench.HEADS_SPLIT (Spec-Bench's questions less MT-bench's), each head records its split in
its meta, and this script prints what each head trained on and stops if a validation question is
one of its split's training prompts.

Scored on the answers only (the input at t counts from the last prompt token on): top-1
agreement of the head's draft with the target's own next token, over the head's draft
vocabulary. For EAGLE, pass p feeds the head its own predicted features p - 1 times before the
scored position (EAGLE's "n-alpha", over all positions, not only where the earlier passes were
right); pass 1 is what the first draft position of a chain accepts under greedy decoding. For
Medusa, head i predicts the token i + 2 past the input. For EAGLE-3 as for EAGLE (passes of its
own outputs); for DFlash, slot i of blocks anchored at random answer positions (positions 1..3 of
a drafted block). Training on a set and validating here
is the quick loop (seconds per head) behind the tables in docs/notes/benchmarks-history.md ("A
validation set for the heads"); acceptance in the speculative loop itself is `spec_bench.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
from common import data_dir, spec_bench_prompts

import specjax
from specjax import bench
from specjax.models import DFlashHead, Eagle3Head
from specjax.models.eagle import EagleHead
from specjax.train import (
    DistillationData,
    distill_data,
    evaluate_dflash,
    evaluate_eagle,
    evaluate_eagle3,
    evaluate_medusa,
    load_head,
)

MAX_LEN = 256
NEW_TOKENS = 128


def validation_set(model, questions: list[str], cache: Path | None) -> tuple[DistillationData, np.ndarray]:
    """The target's answers to `questions` with its hidden states, and where each answer starts
    [N]; read from `cache` (and its .starts.npy) when both exist, else built and saved there."""
    starts_file = cache.with_suffix(".starts.npy") if cache else None
    if cache and cache.is_file() and starts_file.is_file():
        return DistillationData.load(cache), np.load(starts_file)
    sequences, starts = [], []
    for first in range(0, len(questions), 16):
        result = specjax.generate(model, questions[first : first + 16], max_new_tokens=NEW_TOKENS, chat=True)
        for prompt, answer in zip(result.prompt_tokens, result.tokens, strict=True):
            whole = list(prompt) + list(answer)
            cut = max(0, len(whole) - MAX_LEN)  # keep the end: the answer matters here
            sequences.append(whole[cut:])
            starts.append(max(0, len(prompt) - cut))
    data, starts = distill_data(model, sequences, max_len=MAX_LEN), np.array(starts)
    if cache:
        data.save(cache)
        np.save(starts_file, starts)
    return data, starts


def check_held_out(head, path: str, questions: list[str], folder: Path) -> None:
    """Print what `head` trained on; SystemExit if one of `questions` is a training prompt of the
    split its meta records."""
    print(f"{path}: trained on {bench.training_of(head)}")
    split = bench.split_of(head)
    if split is None:
        print("  (its meta names no split of specjax.bench.SPLITS: check that it never saw MT-bench)")
        return
    try:
        trained = split.training_prompts(folder)
    except ValueError as error:  # the split's files are not in the data folder
        print(f"  (not checked against its training prompts: {error})")
        return
    overlap = sum(question in trained for question in questions)
    if overlap:
        raise SystemExit(f"{path}: {overlap} validation questions are training prompts of {split.name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("heads", nargs="+", help="folders of saved heads (e.g. heads/eagle/head)")
    parser.add_argument(
        "--data", help="folder with spec_bench_question.jsonl (default: $SPECJAX_DATA or ../shared/data)"
    )
    parser.add_argument(
        "--questions", default="8:48", help="positions in MT-bench's round-robin order (default 8:48)"
    )
    parser.add_argument("--passes", type=int, default=3, help="EAGLE passes to score (default 3)")
    parser.add_argument("--cache", type=Path, help="an .npz to keep the validation set in between runs")
    args = parser.parse_args()
    start, _, stop = args.questions.partition(":")
    if not (start.isdigit() and stop.isdigit() and int(start) < int(stop) <= 80):
        raise SystemExit(f"--questions must be START:STOP within 0:80, got {args.questions!r}")

    if args.passes < 1:
        raise SystemExit(f"--passes must be at least 1, got {args.passes}")
    model = specjax.load("smollm2-135m")
    folder = data_dir(args.data)
    questions = [text for _, text in spec_bench_prompts(folder, 80, ["mt_bench"])][int(start) : int(stop)]
    heads = {path: load_head(path, model) for path in args.heads}
    for path, head in heads.items():  # before the validation set is built: minutes
        check_held_out(head, path, questions, folder)
    data, starts = validation_set(model, questions, args.cache)
    positions = np.arange(data.tokens.shape[1])[None, :]
    answers = dataclasses.replace(data, mask=data.mask & (positions >= starts[:, None] - 1))
    print(
        f"{data.num_sequences} MT-bench questions ({args.questions}), {int(answers.mask.sum())} answer tokens"
    )
    for path, head in heads.items():
        if isinstance(head, EagleHead | Eagle3Head):
            evaluate = evaluate_eagle if isinstance(head, EagleHead) else evaluate_eagle3
            metrics = evaluate(head, model, answers, unroll=args.passes)
            scores = [metrics["accuracy"]] + [metrics[f"accuracy_{p}"] for p in range(2, args.passes + 1)]
            label = ("EAGLE" if isinstance(head, EagleHead) else "EAGLE-3") + ", passes 1.."
        elif isinstance(head, DFlashHead):
            metrics = evaluate_dflash(head, model, answers)
            scores = [metrics["accuracy"]] + [metrics[f"accuracy_{i}"] for i in range(2, args.passes + 1)]
            label = "DFlash, block slots 1.."
        else:
            scores = evaluate_medusa(head, model, answers)["head_accuracy"]
            label = "Medusa, heads 1.."
        print(f"{path}: {label}{len(scores)}: " + " ".join(f"{s:.3f}" for s in scores))


if __name__ == "__main__":
    main()
