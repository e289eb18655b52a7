"""`make demo`: load the built-in model, generate for a few prompts, print text and metrics."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import specjax

HEADS = Path(__file__).resolve().parents[1] / "heads"  # `make heads` writes the trained heads here
PROMPTS = [
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Rewrite this sentence in the past tense: The cat sits on the mat and watches the birds "
    "while the dog sleeps by the door and the children play in the garden.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--heads", default=str(HEADS), help="folder with the trained heads of `make heads`")
    args = parser.parse_args()

    start = time.perf_counter()
    model = specjax.load(args.model)
    print(f"loaded {model} in {time.perf_counter() - start:.1f} s")

    plain = specjax.generate(model, PROMPTS, max_new_tokens=args.max_new_tokens, chat=True)
    for prompt, text in zip(PROMPTS, plain.texts, strict=True):
        print(f"\n>>> {prompt}\n{text.strip()}")
    print(f"\nplain greedy decoding, batch {len(PROMPTS)}: {plain.metrics}")

    proposer = specjax.NGram(k=4, n_max=4, n_min=1)
    spec = specjax.generate(model, PROMPTS, proposer=proposer, max_new_tokens=args.max_new_tokens, chat=True)
    same = "identical to" if spec.tokens == plain.tokens else "DIFFERENT from"
    print(f"speculative ({proposer}), batch {len(PROMPTS)}: {spec.metrics}")
    print(f"speculative output is {same} plain greedy output")
    print(json.dumps(spec.metrics.summary()))

    eagle_head = Path(args.heads) / "eagle" / "head"
    if args.model != "smollm2-135m" or not eagle_head.is_dir():
        print(f"\n(no EAGLE head in {eagle_head.parent}: `make heads` trains one for the built-in model)")
        return
    head = specjax.train.load_head(eagle_head, model)
    eagles = {
        "EAGLE chain k=4": specjax.Eagle(head, k=4),
        "EAGLE tree top_k(3, 2, 1)": specjax.Eagle(head, tree=specjax.TokenTree.top_k((3, 2, 1))),
    }
    for kind, proposer in eagles.items():
        spec = specjax.generate(
            model, PROMPTS, proposer=proposer, max_new_tokens=args.max_new_tokens, chat=True
        )
        same = "identical to" if spec.tokens == plain.tokens else "DIFFERENT from"
        print(f"\n{kind}, batch {len(PROMPTS)}: {spec.metrics}")
        print(f"output is {same} plain greedy output")


if __name__ == "__main__":
    main()
