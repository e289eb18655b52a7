"""generate of a mixed Spec-Bench batch as one call: the prefill in chunks of one row (the
default on one CPU device, `prefill_chunk="auto"`) against the prompts in one pass over the batch
padded to its longest (`prefill_chunk=None`), in interleaved rounds.

    .venv/bin/python benchmarks/chunked_prefill.py [--per-category 2] [--max-new-tokens 128] \
        [--rounds 2] [--data ../shared/data]

The built-in model, float32, greedy, chat template on, the first `--per-category` questions of
each Spec-Bench category as one batch (2 each: 12 prompts, a batch bucket of 16). Each method's
first call compiles (reported apart); then each round calls both in turn. Tokens/s counts the new
tokens over the wall time of the whole call, prefill included; the two methods' tokens must agree.
"""

from __future__ import annotations

import argparse
import time

import specjax
from specjax import bench

METHODS = {"one pass": {"prefill_chunk": None}, "chunks": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", default=None, help="the prompt sets' folder (default $SPECJAX_DATA)")
    args = parser.parse_args()
    model = specjax.load("smollm2-135m")
    questions = bench.spec_bench_prompts(bench.data_dir(args.data), per_category=args.per_category)
    ids = [specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": q}]) for _, q in questions]
    print(f"{len(ids)} prompts, {sum(map(len, ids))} tokens, lengths {sorted(map(len, ids))}")
    tokens, rates = {}, {name: [] for name in METHODS}
    for name, options in METHODS.items():
        start = time.perf_counter()
        tokens[name] = specjax.generate(model, ids, max_new_tokens=args.max_new_tokens, **options).tokens
        print(f"{name}: first call (compiles) {time.perf_counter() - start:.1f} s")
    for round_ in range(args.rounds):
        for name, options in METHODS.items():
            start = time.perf_counter()
            result = specjax.generate(model, ids, max_new_tokens=args.max_new_tokens, **options)
            seconds = time.perf_counter() - start
            rates[name].append(sum(map(len, result.tokens)) / seconds)
            assert result.tokens == tokens[name]
            print(f"round {round_}: {name} {seconds:.1f} s, {rates[name][-1]:.1f} tokens/s")
    assert tokens["one pass"] == tokens["chunks"], "the two prefills' tokens differ"
    ratios = [c / w for c, w in zip(rates["chunks"], rates["one pass"], strict=True)]
    print(f"{bench.machine()}\nchunks / one pass, per round: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
