"""The optimized XLA:CPU programs `generate` compiles, normalized, with a digest each: to check that
a change leaves the CPU programs (and so CPU decoding speed) exactly as they were.

Run it in a checkout of each commit, then compare the digests (or diff the files):

    .venv/bin/python benchmarks/cpu_programs.py --model tiny --out /tmp/before      # at the old commit
    .venv/bin/python benchmarks/cpu_programs.py --model tiny --out /tmp/after       # at the new one
    diff -r /tmp/before /tmp/after

Normalized: source metadata, stack-frame tables, dot precision attributes (XLA:CPU computes float32
products in float32 at every precision) and every instruction's and parameter's name are dropped,
and the lines sorted: what is compared is the multiset of instructions (opcode, shapes, operands'
shapes, attributes), which a renumbering elsewhere in the program does not change.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

sys.path[:0] = [".", "tests"]  # this checkout's package and its tests' tiny models

import specjax  # noqa: E402
from specjax import api  # noqa: E402

PROMPTS = [[1, 2, 3, 1, 2, 3], [5, 6, 7]]


def normalized(text: str) -> str:
    for pattern in (
        r", metadata=\{[^}]*\}",
        r",? ?operand_precision=\{[^}]*\}",
        r", frontend_attributes=\{[^}]*\}",
    ):
        text = re.sub(pattern, "", text)
    text = re.sub(r"^HloModule.*$", "", text, flags=re.M)
    text = re.sub(r"%[\w.\-]+", "%", text)  # instruction and parameter names
    text = re.sub(r"\bparam_\d+\.\d+", "param", text)
    lines = (line.strip().rstrip(",") for line in text.splitlines())
    return "\n".join(sorted(line for line in lines if line and not re.match(r'^\d+ (\{|")', line)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "builtin"], default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    compiled = []
    real = api.compile_program

    def capture(*arguments):
        executable = real(*arguments)
        compiled.append(executable)
        return executable

    api.compile_program = capture
    if args.model == "tiny":
        from tiny import tiny_model

        model = tiny_model(seed=1, num_layers=2)
        runs = {"plain": None, "ngram": specjax.NGram(k=3), "self_draft": specjax.SelfDraft(1, k=2)}
    else:
        model = specjax.load("smollm2-135m")
        runs = {"plain": None, "ngram": specjax.NGram(k=3)}
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"specjax from {specjax.__file__}")
    for name, proposer in runs.items():
        specjax.generate(model, PROMPTS, proposer=proposer, max_new_tokens=8)
        text = normalized(compiled[-1].as_text())
        (args.out / f"{args.model}-{name}.txt").write_text(text)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{args.model} {name}: {text.count(chr(10)) + 1} lines, sha256 {digest}")


if __name__ == "__main__":
    main()
