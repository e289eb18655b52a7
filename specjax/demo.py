"""`make demo`: where speculative decoding pays on this machine, and where it does not.

Loads the built-in model and runs two sets of prompts written here, each prompt at batch 1,
greedy, with plain decoding and with speculative proposers:

- edits (a paragraph to correct, a sentence to punctuate): the answer copies most of the prompt, so
  prompt lookup (NGram) drafts long runs the target accepts, for free: no model runs to draft;
- open-ended questions: the answer is new text, drafts are rarely right, and every rejected
  draft still costs a verify pass over k + 1 tokens (on this CPU about 1.6 plain steps at k = 4),
  so speculation is slower than plain decoding there. A trained EAGLE-3 head (`make heads`)
  drafts better than lookup on such text, but on this CPU its drafting and verify passes cost
  more than its accepted tokens save.

Tokens/s are each call's new tokens over its run time (compilation excluded); the speedup is over
plain decoding of the same prompts. Every speculative output is checked against plain greedy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import specjax

HEADS = Path(__file__).resolve().parents[1] / "heads"  # `make heads` writes the trained heads here

EDITS = [
    "Correct the spelling mistakes in this paragraph and return the whole paragraph:\n\n"
    "The library opens at nine in the morining and closes at six in the evening. Visitors can "
    "borrow up to five books at a time, and the loan period is three weeks. Late returns are "
    "charged a small fee, wich goes towards buying new books for the childrens section.",
    "Add the missing commas to this sentence and return it: When the train arrived the passengers "
    "who had waited for an hour picked up their bags and walked slowly towards the exit where a "
    "guide was waiting for them with a sign.",
]
OPEN_ENDED = [
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while working from home.",
]


def run(model, prompts, proposer, max_new_tokens):
    """Each prompt at batch 1: (tokens per prompt, total new tokens / total run time, mean
    acceptance length over the calls)."""
    tokens, emitted, seconds, passes = [], 0, 0.0, 0
    for prompt in prompts:
        result = specjax.generate(
            model, [prompt], proposer=proposer, max_new_tokens=max_new_tokens, chat=True
        )
        tokens.append(result.tokens[0])
        emitted += len(result.tokens[0])
        seconds += result.metrics.run_time_s
        passes += int(result.metrics.steps.sum())
    return tokens, emitted / seconds, emitted / max(passes, 1)


def compare(model, title, prompts, proposers, max_new_tokens) -> dict[str, tuple[float, float]]:
    """Print a table of plain decoding and each proposer on `prompts`; returns {name: (speedup,
    tokens per target pass)}."""
    print(f"\n== {title} ({len(prompts)} prompts, batch 1, greedy, {max_new_tokens} new tokens)")
    plain_tokens, plain_speed, _ = run(model, prompts, None, max_new_tokens)
    result = specjax.generate(model, prompts[:1], max_new_tokens=max_new_tokens, chat=True)
    print(f">>> {prompts[0].splitlines()[0][:100]}...\n{result.texts[0].strip()}\n")
    print(f"{'method':<34} {'tokens/s':>9} {'speedup':>8} {'tokens/pass':>12}  output")
    print(f"{'plain':<34} {plain_speed:>9.1f} {1.0:>7.2f}x {1.0:>12.2f}")
    measured = {}
    for name, proposer in proposers.items():
        tokens, speed, tau = run(model, prompts, proposer, max_new_tokens)
        same = "= plain greedy" if tokens == plain_tokens else "DIFFERS from plain greedy"
        print(f"{name:<34} {speed:>9.1f} {speed / plain_speed:>7.2f}x {tau:>12.2f}  {same}")
        if tokens != plain_tokens:
            raise SystemExit(f"demo: {name}'s output differs from plain greedy decoding")
        measured[name] = (speed / plain_speed, tau)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--heads", default=str(HEADS), help="folder with the trained heads of `make heads`")
    args = parser.parse_args()

    start = time.perf_counter()
    model = specjax.load(args.model)
    print(f"loaded {model} in {time.perf_counter() - start:.1f} s")

    lookup = {
        "NGram(k=8) (prompt lookup)": specjax.NGram(k=8),
        "Dynamic(NGram(k=8)) (k per row)": specjax.Dynamic(specjax.NGram(k=8)),
    }
    edits = compare(model, "Edits: the answer copies the prompt", EDITS, lookup, args.max_new_tokens)

    open_ended = dict(lookup)
    eagle3 = Path(args.heads) / "eagle3" / "head"
    if args.model == "smollm2-135m" and eagle3.is_dir():
        open_ended["EAGLE-3 chain k=3 (trained head)"] = specjax.Eagle3(specjax.load_head(eagle3, model), k=3)
    chat = compare(model, "Open-ended questions: new text", OPEN_ENDED, open_ended, args.max_new_tokens)

    best_edit = max(edits, key=lambda name: edits[name][0])
    best_chat = max(chat, key=lambda name: chat[name][0])
    print(
        f"\nOn the edits, {best_edit} ran {edits[best_edit][0]:.2f}x plain decoding: the answer copies "
        f"the prompt, lookup drafts the copied phrases for free and the target accepts "
        f"{edits[best_edit][1]:.1f} tokens per pass.\nOn the open-ended questions, the best was "
        f"{best_chat} at {chat[best_chat][0]:.2f}x: few drafts are right "
        f"({min(tau for _, tau in chat.values()):.2f}-{max(tau for _, tau in chat.values()):.2f} tokens "
        "per pass), "
        + (
            "and on this machine a verify pass over k + 1 tokens costs more than a plain step, so a "
            "rejected draft is time lost."
            if chat[best_chat][0] < 1
            else "yet on this machine a verify pass is cheap enough for that to pay."
        )
        + "\nTry NGram or Dynamic(NGram) first for input-grounded tasks "
        "(edits, summaries, RAG, code); plain decoding for short open-ended chat on a CPU."
    )


if __name__ == "__main__":
    main()
