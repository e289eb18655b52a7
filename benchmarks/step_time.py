"""Milliseconds per plain decoding step, apart from prefill, at several cache lengths and batch sizes.

    .venv/bin/python benchmarks/step_time.py [--repeats 3] [--long-steps 136]

Each case times whole `generate` calls at two lengths, --short-steps and --long-steps new tokens,
on the same prompts (median of --repeats after a warm-up), and divides the difference by the
number of extra decoding steps the longer call ran (counted by the metrics, so a row that stops
at end-of-sequence is accounted for): prefill, compile and the host's fixed costs cancel out. The
prompts are written here (no data set needed). SmolLM2-135M-Instruct, float32, greedy.
"""

from __future__ import annotations

import argparse

from common import machine, markdown_table, median_time

import specjax


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
    args = parser.parse_args()

    model = specjax.load("smollm2-135m")
    cases = [(1, 100), (1, 1000), (4, 100)]
    rows = []
    for batch, prompt_tokens in cases:
        prompts = [filler_prompt(prompt_tokens)] * batch

        def run(n, prompts=prompts):
            return specjax.generate(model, prompts, max_new_tokens=n)

        times, steps = {}, {}
        for n in (args.short_steps, args.long_steps):
            result = run(n)  # warm-up (and compile)
            steps[n] = int(result.metrics.steps.max())  # the batch runs until its longest row stops
            times[n] = median_time(lambda n=n: run(n), args.repeats)
        extra_steps = steps[args.long_steps] - steps[args.short_steps]
        step_ms = (times[args.long_steps] - times[args.short_steps]) / extra_steps * 1e3
        prompt_len = len(result.prompt_tokens[0])
        rows.append([batch, prompt_len, step_ms, 1e3 / step_ms * batch])
    print(f"\nmachine: {machine()}")
    print(
        f"plain greedy decoding, {args.long_steps} - {args.short_steps} new tokens, "
        f"median of {args.repeats}\n"
    )
    print(markdown_table(["batch", "prompt tokens", "ms per step", "tokens/s in decoding"], rows))


if __name__ == "__main__":
    main()
