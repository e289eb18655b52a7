r"""Milliseconds per decoding step, apart from prefill, at several cache lengths and batch sizes:
plain steps, and with --proposers verify steps (one target pass over a chain or a tree of drafts).

    .venv/bin/python benchmarks/step_time.py [--repeats 3] [--long-steps 136]
    .venv/bin/python benchmarks/step_time.py --cases 1x100 8x100 --quantization none gguf int8 int4
    .venv/bin/python benchmarks/step_time.py --cases 1x100 \
        --proposers plain medusa-chain3 medusa-top32 eagle-chain4 eagle-tree11

--proposers times verify steps too: `medusa-*` uses untrained (identity) Medusa heads, which
accept almost nothing, so every step is one full verify pass over the tree: chain3 scores 4 tokens,
top32 (`TokenTree.top_k((3, 2))`) 10, top421 21. `eagle-*` uses a random EAGLE head with an
8192-token draft vocabulary: its drafting passes (one per depth) come on top. `verify-kN` is
`ForcedAcceptance(0, k=N)`: N free drafts, all rejected, so every step is one verify pass over
N + 1 tokens with no drafting cost (what a lookup proposer's drafting steps cost, near enough).
Steps are counted by the metrics either way.

Each case times whole `generate` calls at two lengths, --short-steps and --long-steps new tokens,
on the same prompts (median of --repeats after a warm-up), and divides the difference by the
number of extra decoding steps the longer call ran (counted by the metrics, so a row that stops
at end-of-sequence is accounted for): prefill, compile and the host's fixed costs cancel out. The
prompts are written here (no data set needed). SmolLM2-135M-Instruct, float32 (or with
--quantization: the built-in Q4_1 file's own blocks, int8 or int4 weights), greedy.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from common import EAGLE_TREE, machine, markdown_table, median_time

import specjax
from specjax.models import EagleHead, MedusaHead

TREES = {
    "medusa-chain3": specjax.TokenTree.chain(3),
    "medusa-top32": specjax.TokenTree.top_k((3, 2)),
    "medusa-top421": specjax.TokenTree.top_k((4, 2, 1)),
    "eagle-chain4": specjax.TokenTree.chain(4),
    "eagle-tree11": specjax.TokenTree(EAGLE_TREE),
}
EAGLE_DRAFT_VOCAB = 8192  # what `make heads` trains


VERIFY_KS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def make_proposer(name: str, model):
    if name == "plain":
        return None
    if name.startswith("verify-k"):  # k free drafts, all rejected: one k+1-token verify pass a step
        return specjax.ForcedAcceptance(0.0, k=int(name.removeprefix("verify-k")))
    if name.startswith("eagle"):  # a random head drafting from the first 8192 token ids
        head = EagleHead.init(model, jax.random.key(0), vocab=np.arange(EAGLE_DRAFT_VOCAB))
        return specjax.Eagle(head, tree=TREES[name])
    return specjax.Medusa(MedusaHead.init(model, num_heads=3), tree=TREES[name])


def filler_prompt(approx_tokens: int) -> str:
    """A prompt of roughly `approx_tokens` tokens (about 25 tokens a sentence)."""
    sentences = [
        f"Sentence {i}: the river town of Alder{i % 7} grew wheat, traded salt and kept {i} boats."
        for i in range(max(1, approx_tokens // 25))
    ]
    return "Summarize the following text in one paragraph.\n" + " ".join(sentences)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--short-steps", type=int, default=8)
    parser.add_argument("--long-steps", type=int, default=136)
    parser.add_argument(
        "--cases", nargs="+", default=["1x100", "1x1000", "4x100"], help="BATCHxPROMPT_TOKENS each"
    )
    parser.add_argument(
        "--proposers",
        nargs="+",
        default=["plain"],
        choices=["plain", *TREES, *(f"verify-k{k}" for k in VERIFY_KS)],
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        choices=["none", "gguf", "int8", "int4"],
        help="the weights to time (none: float32; gguf: the built-in Q4_1 file's own blocks)",
    )
    args = parser.parse_args()

    rows = []
    for quantization in args.quantization:
        model = specjax.load("smollm2-135m", quantization=None if quantization == "none" else quantization)
        rows += time_cases(model, quantization, args)
    print(f"\nmachine: {machine()}")
    print(f"greedy decoding, {args.long_steps} - {args.short_steps} new tokens, median of {args.repeats}\n")
    header = ["weights", "proposer", "batch", "prompt tokens", "ms per step", "steps/s x batch"]
    print(markdown_table(header, rows))


def time_cases(model, quantization: str, args) -> list[list]:
    """One row per (case, proposer): ms per decoding step of `model`."""
    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases]
    rows = []
    for (batch, prompt_tokens), name in [(c, p) for c in cases for p in args.proposers]:
        prompts = [filler_prompt(prompt_tokens)] * batch
        proposer = make_proposer(name, model)

        def run(n, prompts=prompts, proposer=proposer):
            return specjax.generate(model, prompts, proposer=proposer, max_new_tokens=n)

        times, steps = {}, {}
        for n in (args.short_steps, args.long_steps):
            result = run(n)  # warm-up (and compile)
            steps[n] = int(result.metrics.steps.max())  # the batch runs until its longest row stops
            times[n] = median_time(lambda n=n: run(n), args.repeats)
        extra_steps = steps[args.long_steps] - steps[args.short_steps]
        step_ms = (times[args.long_steps] - times[args.short_steps]) / extra_steps * 1e3
        prompt_len = len(result.prompt_tokens[0])
        rows.append([quantization, name, batch, prompt_len, step_ms, 1e3 / step_ms * batch])
    return rows


if __name__ == "__main__":
    main()
