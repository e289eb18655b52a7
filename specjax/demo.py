"""`make demo`: where speculative decoding pays on this machine, and where it does not.

Loads the built-in model and runs two sets of prompts written here, each prompt at batch 1,
greedy, with plain decoding and with speculative proposers:

- edits (a paragraph to correct, a sentence to punctuate): the answer copies most of the prompt, so
  prompt lookup (NGram) drafts long runs the target accepts, for free: no model runs to draft;
- open-ended questions: the answer is new text, drafts are rarely right, and every rejected
  draft still costs a verify pass over k + 1 tokens, which on a CPU costs more than a plain step
  (docs/benchmarks.md, "The loop's own overhead"). Lookup finds little to copy there and drafts
  little, so it runs about even with plain decoding; a trained EAGLE-3 head (`make heads`) drafts
  better than lookup on such text, but it drafts at every step: as a chain of 3 its drafting and
  verify passes cost more than its accepted tokens save, as a chain of one draft it can pay, and
  a Hybrid takes lookup's drafts where the text repeats and the head's elsewhere.

Tokens/s are new tokens over run time (compilation excluded). The methods run interleaved, prompt
by prompt, and each keeps its fastest of --repeats runs, so that the host's other load falls on
all of them alike; the speedup is over plain decoding of the same prompts. Tokens per pass are new
tokens per target forward pass (plain decoding: 1); a step's cost in plain steps is its tokens per
pass over its speedup. Every speculative output is checked against plain greedy decoding: the demo
fails if one differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import NamedTuple

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


@dataclasses.dataclass
class Measured:
    """One method over a set of prompts: its tokens and text per prompt, its fastest run time per
    prompt and the target forward passes of that run."""

    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    passes: list[int] = dataclasses.field(default_factory=list)  # target forward passes, prefill included

    @property
    def speed(self) -> float:  # new tokens per second over all prompts
        return sum(map(len, self.tokens)) / sum(self.seconds)

    @property
    def tokens_per_pass(self) -> float:  # new tokens per target forward pass (plain decoding: 1)
        return sum(map(len, self.tokens)) / max(sum(self.passes), 1)


def measure(model, prompts, methods, max_new_tokens, repeats) -> dict[str, Measured]:
    """{name: Measured} for plain decoding ("plain") and each of `methods` ({name: proposer}) on
    every prompt at batch 1: per prompt, `repeats` rounds of every method in turn."""
    measured = {name: Measured() for name in ["plain", *methods]}
    for prompt in prompts:
        fastest = {}
        for _ in range(repeats):
            for name, proposer in [("plain", None), *methods.items()]:
                result = specjax.generate(
                    model, [prompt], proposer=proposer, max_new_tokens=max_new_tokens, chat=True
                )
                if name not in fastest or result.metrics.run_time_s < fastest[name].metrics.run_time_s:
                    fastest[name] = result
        for name, result in fastest.items():
            measured[name].tokens.append(result.tokens[0])
            measured[name].texts.append(result.texts[0])
            measured[name].seconds.append(result.metrics.run_time_s)
            measured[name].passes.append(int(result.metrics.target_forwards.sum()))
    return measured


class Outcome(NamedTuple):
    """A method against plain decoding of the same prompts."""

    speedup: float  # its tokens/s over plain's
    tokens_per_pass: float  # new tokens per target forward pass
    step_cost: float  # a step's time in plain steps: tokens per pass (relative to plain's) / speedup


def compare(model, title, prompts, methods, max_new_tokens, repeats) -> dict[str, Outcome]:
    """Print a table of plain decoding and each method on `prompts`; returns {name: Outcome}.
    SystemExit if a method's output differs from plain greedy output."""
    print(f"\n== {title} ({len(prompts)} prompts, batch 1, greedy, {max_new_tokens} new tokens)")
    measured = measure(model, prompts, methods, max_new_tokens, repeats)
    plain = measured.pop("plain")
    print(f">>> {prompts[0].splitlines()[0][:100]}...\n{plain.texts[0].strip()}\n")
    width = max(len(name) for name in ["method", *measured])
    print(f"{'method':<{width}} {'tokens/s':>9} {'speedup':>8} {'tokens/pass':>12} {'step cost':>10}  output")
    print(f"{'plain':<{width}} {plain.speed:>9.1f} {1.0:>7.2f}x {plain.tokens_per_pass:>12.2f} {1.0:>10.2f}")
    outcomes = {}
    for name, m in measured.items():
        speedup = m.speed / plain.speed
        outcome = Outcome(speedup, m.tokens_per_pass, m.tokens_per_pass / plain.tokens_per_pass / speedup)
        same = "= plain greedy" if m.tokens == plain.tokens else "DIFFERS from plain greedy"
        print(
            f"{name:<{width}} {m.speed:>9.1f} {speedup:>7.2f}x {outcome.tokens_per_pass:>12.2f} "
            f"{outcome.step_cost:>10.2f}  {same}"
        )
        if m.tokens != plain.tokens:
            raise SystemExit(f"demo: {name}'s output differs from plain greedy decoding")
        outcomes[name] = outcome
    return outcomes


def verdict(speedup: float) -> str:
    """A speedup in words; within 0.95-1.10 is this shared machine's run-to-run noise."""
    if speedup < 0.95:
        return "slower than plain"
    return "about even with plain" if speedup < 1.10 else "faster than plain"


def explain(edits: dict[str, Outcome], chat: dict[str, Outcome]) -> str:
    """Why, in the measured numbers: tokens per pass against what a step cost in plain steps."""
    best = max(edits, key=lambda name: edits[name].speedup)
    taus = [outcome.tokens_per_pass for outcome in chat.values()]
    lines = [
        f"On the edits, {best} ran {edits[best].speedup:.2f}x plain decoding: the answer copies the "
        f"prompt, so lookup drafts the copied phrases for free and each target pass yielded "
        f"{edits[best].tokens_per_pass:.1f} tokens, for a step that cost "
        f"{edits[best].step_cost:.2f} plain steps.",
        f"On the open-ended questions few drafts were right ({min(taus):.2f}-{max(taus):.2f} tokens "
        "per pass, where plain makes 1):",
    ]
    for name, outcome in chat.items():
        lines.append(
            f"  {name}: {outcome.speedup:.2f}x, {verdict(outcome.speedup)}: "
            f"{outcome.tokens_per_pass:.2f} tokens per pass for a step that cost "
            f"{outcome.step_cost:.2f} plain steps"
        )
    lines += [
        "A step that drafts costs more than a plain one (a verify pass over k + 1 tokens, and a "
        "trained head's drafting), so it pays only where enough drafts are accepted.",
        "Lookup drafts only where the text repeats itself, so on new text most of its steps are plain "
        "ones; a trained head drafts, and pays for it, at every step: its later drafts are accepted "
        "less often than its first, so on a CPU a chain of one draft (k=1) is the one that can pay.",
    ]
    fastest = max(chat, key=lambda name: chat[name].speedup)
    chat_advice = (
        f"{fastest} on open-ended text (the fastest here, {chat[fastest].speedup:.2f}x)"
        if verdict(chat[fastest].speedup) == "faster than plain"
        else "plain decoding for short open-ended chat on a CPU (no proposer was clearly faster here)"
    )
    lines.append(
        "Try NGram, or Dynamic(NGram) (it lowers k where drafts fail), first for input-grounded "
        f"tasks (edits, summaries, RAG, code); {chat_advice}."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per prompt and method, fastest kept (default 2)"
    )
    parser.add_argument("--heads", default=str(HEADS), help="folder with the trained heads of `make heads`")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    start = time.perf_counter()
    model = specjax.load(args.model)
    print(f"loaded {model} in {time.perf_counter() - start:.1f} s")
    print(
        f"each method runs every prompt {args.repeats} time(s), interleaved with the others, and keeps "
        "its fastest run; tokens/pass: new tokens per target pass; step cost: a step's time in plain "
        "steps (tokens/pass over speedup)"
    )

    lookup = {
        "NGram(k=8) (prompt lookup)": specjax.NGram(k=8),
        "Dynamic(NGram(k=8)) (k per row)": specjax.Dynamic(specjax.NGram(k=8)),
    }
    edits = compare(
        model, "Edits: the answer copies the prompt", EDITS, lookup, args.max_new_tokens, args.repeats
    )

    open_ended = dict(lookup)
    eagle3 = Path(args.heads) / "eagle3" / "head"
    if args.model == "smollm2-135m" and eagle3.is_dir():
        # Distilled from Spec-Bench's questions less MT-bench's (specjax.bench.HEADS_SPLIT): these
        # questions, written here, are not among them. A chain of one draft: on this CPU a head's
        # later drafts are accepted less often than they cost (docs/benchmarks.md).
        head = specjax.load_head(eagle3, model)
        open_ended["EAGLE-3 chain k=1 (trained head)"] = specjax.Eagle3(head, k=1)
        open_ended["EAGLE-3 chain k=3"] = specjax.Eagle3(head, k=3)
        open_ended["Hybrid(NGram(k=4, n_min=3), EAGLE-3 k=1)"] = specjax.Hybrid(
            specjax.NGram(k=4, n_min=3), specjax.Eagle3(head, k=1)
        )
    chat = compare(
        model, "Open-ended questions: new text", OPEN_ENDED, open_ended, args.max_new_tokens, args.repeats
    )
    print("\n" + explain(edits, chat))
    print(f"(the demo took {time.perf_counter() - start:.0f} s, compilation included)")


if __name__ == "__main__":
    main()
