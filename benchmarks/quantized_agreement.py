"""Top-1 agreement of the built-in model's quantized forms with its float32 form over Spec-Bench
answers: docs/models.md, "Quantized weights", quotes it.

    .venv/bin/python benchmarks/quantized_agreement.py [--per-category 2] [--max-new-tokens 64]

The float32 model answers the first --per-category questions of each Spec-Bench category (first
turn, chat template, greedy). Each quantized model (the file's own blocks, int8, int4 in groups
of 32 and of 128) then reads the same prompt and answer in one forward pass, and at every answer
position its argmax is compared with the float32 model's: the fraction that agree, per category
and over all, and the mean absolute difference of the log-probability of the float32 model's
token.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import specjax
from specjax import bench, planner
from specjax.models import forward, init_cache

VARIANTS = {
    "gguf (Q4_1 + Q8_0 head)": dict(quantization="gguf"),
    "int8": dict(quantization="int8"),
    "int4, groups of 32": dict(quantization="int4", group_size=32),
    "int4, groups of 128": None,  # SmolLM2's hidden size 576 is no multiple of 128
}


def answer_logits(model, ids: list[int]) -> np.ndarray:
    """Log-probabilities [T, V] of the model at each position of `ids`, from one forward pass."""
    tokens = jnp.asarray([ids])
    cache = init_cache(model.config, 1, len(ids))
    logits, _, _ = forward(model.params, model.config, tokens, jnp.arange(len(ids))[None], cache)
    return np.asarray(jax.nn.log_softmax(logits[0], axis=-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--data", help="folder with spec_bench_question.jsonl")
    args = parser.parse_args()

    reference = specjax.load("smollm2-135m")
    prompts = bench.spec_bench_prompts(bench.data_dir(args.data), args.per_category)
    rows = []  # (category, full ids, first answer position)
    for category, text in prompts:
        result = specjax.generate(reference, [text], chat=True, max_new_tokens=args.max_new_tokens)
        prompt_ids = planner.prompt_ids(reference, text, "prompts", chat=True)  # generate's own ids
        rows.append((category, prompt_ids + result.tokens[0], len(prompt_ids)))

    print(
        "| model | " + " | ".join(dict.fromkeys(c for c, _, _ in rows)) + " | all | mean abs log-prob diff |"
    )
    print("| --- " * (len(set(c for c, _, _ in rows)) + 3) + "|")
    want = [answer_logits(reference, ids) for _, ids, _ in rows]
    for name, options in VARIANTS.items():
        if options is None:
            continue
        model = specjax.load("smollm2-135m", **options)
        agree, total, diffs = {}, {}, []
        for (category, ids, start), ref in zip(rows, want, strict=True):
            got = answer_logits(model, ids)
            positions = slice(start - 1, len(ids) - 1)  # the positions that predict answer tokens
            same = np.argmax(got[positions], -1) == np.argmax(ref[positions], -1)
            agree[category] = agree.get(category, 0) + int(same.sum())
            total[category] = total.get(category, 0) + len(same)
            chosen = np.asarray(ids[start:])
            at = np.arange(len(chosen))
            diffs.append(np.abs(got[positions][at, chosen] - ref[positions][at, chosen]))
        cells = [f"{agree[c] / total[c]:.3f}" for c in agree]
        overall = sum(agree.values()) / sum(total.values())
        print(f"| {name} | " + " | ".join(cells) + f" | {overall:.4f} | {np.concatenate(diffs).mean():.4f} |")


if __name__ == "__main__":
    main()
