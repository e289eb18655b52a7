"""specjax against llama.cpp at the quantizations CPU users run: the built-in model's Q4_1 file and
Q8_0 and F32 copies of it, plain decoding and the best speculative mode of each, every Spec-Bench
category (docs/benchmarks.md, "Quantized weights against llama.cpp").

    .venv/bin/python benchmarks/llamacpp_quantized.py --llama-python LLAMA_VENV/bin/python
        [--per-category 2] [--max-new-tokens 128] [--repeats 1] [--quantizations F32,Q8_0,Q4_1]
        [--categories mt_bench,qa] [--copies ~/.cache/specjax/llamacpp] [--threads 2] [--draft-k 6]

llama.cpp runs through llama-cpp-python in a venv of its own (a benchmark-only dependency, never
specjax's: `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36` there), driven
by benchmarks/llamacpp_worker.py over a pipe. Both decode the same chat-template token ids
(specjax's), batch 1, greedy, prefill included in the time of every call.

For each quantization specjax loads the file with `quantization="gguf"` (the F32 copy as float32
weights) and runs plain decoding and prompt lookup (NGram, k=5, n_min=3); llama.cpp runs plain
decoding and its prompt lookup at (k, n) = (5, 2) and (10, 3). Above Q4_1 both engines also draft
with the Q4_1 file, the quantized copy of the same model, proposing --draft-k tokens a step
(specjax.DraftModel with prompt_from_target=True: the draft's cache starts as the target's over
the prompt, so it runs no prefill of its own; llama.cpp's draft-model speculation through
llama-cpp-python's draft hook, benchmarks/llamacpp_worker.py, whose draft prefills the prompt),
and at F32 specjax also drafts with an int8 copy quantized at load (`quantization="int8"`), a
draft that is not the target's own weights. specjax.bench.run_spec_bench
times every method and peer in turn on each prompt, so the machine's load falls on all alike. A
method's "best" is, per category, the fastest of its modes, named in the table. The Q8_0 copy
quantizes every 2-D weight to Q8_0 with gguf-py; the F32 copy dequantizes every tensor, so the F32
model is the Q4_1 file's own numbers and a Q4_1 draft of it proposes almost exactly its tokens.

Without --llama-python (where llama-cpp-python does not build) only specjax's columns are
measured: its plain decoding and best mode at each quantization, and its own ratio to float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from common import REPO, common_arguments, data_dir, machine, markdown_table, spec_bench_prompts

import specjax
from specjax.bench import SPEC_BENCH_CATEGORIES, parse_categories, run_spec_bench
from specjax.models.loading import builtin_path

LOOKUPS = {"lookup k5 n2": (5, 2), "lookup k10 n3": (10, 3)}
FILE_TYPES = {"F32": 0, "Q8_0": 7}  # general.file_type of a copy (LLAMA_FTYPE_ALL_F32, _MOSTLY_Q8_0)


def write_copy(source: Path, target: Path, kind: str) -> Path:
    """`source` with every tensor as F32, or every 2-D weight as Q8_0 (the rest F32): the same
    metadata, tokenizer and chat template."""
    import gguf

    if target.is_file():
        return target
    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), architecture)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(FILE_TYPES[kind])
    for tensor in reader.tensors:
        weight = gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if kind == "Q8_0" and weight.ndim == 2 and weight.shape[-1] % 32 == 0:
            q = gguf.quantize(weight, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(tensor.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)
    return target


class LlamaCpp:
    """A llama.cpp worker process over one GGUF file: `generate(ids, max_new_tokens, lookup)`."""

    def __init__(self, python: str, path: Path, threads: int, draft: Path | None = None):
        worker = REPO / "benchmarks" / "llamacpp_worker.py"
        self.process = subprocess.Popen(
            [python, str(worker), str(path), str(threads), *([str(draft)] if draft else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def generate(
        self, ids: list[int], max_new_tokens: int, lookup: tuple[int, int] | None, draft: int | None = None
    ) -> list[int]:
        """Greedy new tokens: plain decoding, prompt lookup (k, n), or `draft` tokens a step drafted
        by the worker's draft file."""
        request = {"ids": ids, "max_new_tokens": max_new_tokens, "lookup": lookup, "draft": draft}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker exited with code {self.process.wait()}")
        return json.loads(line)["tokens"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def category_rate(result, category: str, method: str) -> float:
    """All new tokens of the category's prompts over their median seconds, in tokens/s."""
    runs = result.rounds[category][method]
    return sum(n for n, _ in runs) / sum(float(np.median(seconds)) for _, seconds in runs)


def run_quantization(args, kind: str, prompts) -> tuple[dict, dict]:
    """({category: {column: tokens/s}}, {category: prompts whose llama.cpp greedy tokens equal
    specjax's}) for one quantization."""
    source = builtin_path("smollm2-135m")
    path = source if kind == "Q4_1" else write_copy(source, Path(args.copies) / f"smollm2-{kind}.gguf", kind)
    model = specjax.load(path, quantization=None if kind == "F32" else "gguf")
    drafts = kind != "Q4_1"  # a Q4_1 draft for the wider forms of the same model
    draft_name = f"Q4_1 draft k{args.draft_k}"
    llama = None
    if args.llama_python is not None:
        llama = LlamaCpp(args.llama_python, path, args.threads, source if drafts else None)
    llama_tokens: dict[tuple, list[int]] = {}

    def peer(lookup, draft=None):
        def run(ids: list[int]) -> int:
            tokens = llama.generate(ids, args.max_new_tokens, lookup, draft)
            llama_tokens.setdefault((tuple(ids), lookup, draft), tokens)
            return len(tokens)

        return run

    peers = {}
    if llama is not None:
        peers = {"llama.cpp plain": peer(None)} | {f"llama.cpp {n}": peer(kn) for n, kn in LOOKUPS.items()}
        if drafts:
            peers[f"llama.cpp {draft_name}"] = peer(None, args.draft_k)
    methods = {"plain": None, "ngram": specjax.NGram(k=5, n_min=3)}
    if drafts:
        q4 = specjax.load(source, quantization="gguf")
        methods[draft_name] = specjax.DraftModel(q4, k=args.draft_k, prompt_from_target=True)
    if kind == "F32":
        int8 = specjax.load(path, quantization="int8")
        methods[f"int8 draft k{args.draft_k}"] = specjax.DraftModel(
            int8, k=args.draft_k, prompt_from_target=True
        )
    try:
        result = run_spec_bench(
            model, prompts, methods, max_new_tokens=args.max_new_tokens, repeats=args.repeats, peers=peers
        )
    finally:
        if llama is not None:
            llama.close()
    rates = {
        category: {name: category_rate(result, category, name) for name in result.methods}
        for category in result.speeds
    }
    same = {}
    for category, text in prompts if llama is not None else ():
        ours = specjax.generate(model, [text], max_new_tokens=args.max_new_tokens, chat=True)
        ids = tuple(ours.prompt_tokens[0])
        theirs = llama_tokens[(ids, None, None)]
        same[category] = same.get(category, 0) + int(theirs == ours.tokens[0])
        for key, tokens in llama_tokens.items():
            if key[0] == ids and tokens != theirs:
                print(f"{kind}: llama.cpp's {key[1:]} output differs from its plain decoding ({category})")
    if result.mismatches:
        print(f"{kind}: specjax speculative outputs that differ from plain: {result.mismatches}")
    return rates, same


def main() -> None:
    parser = common_arguments(__doc__.splitlines()[0], timed=False)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per measurement after a warm-up")
    parser.add_argument("--categories", default=",".join(SPEC_BENCH_CATEGORIES), help="comma-separated")
    parser.add_argument(
        "--llama-python", help="python of a venv with llama-cpp-python (without it: specjax's columns only)"
    )
    parser.add_argument("--quantizations", default="F32,Q8_0,Q4_1", help="of F32, Q8_0, Q4_1")
    parser.add_argument(
        "--copies", default=str(Path.home() / ".cache" / "specjax" / "llamacpp"), help="where the copies go"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    parser.add_argument(
        "--draft-k", type=int, default=6, help="tokens a draft model proposes a step (default %(default)s)"
    )
    args = parser.parse_args()
    if args.draft_k < 1:
        sys.exit(f"--draft-k must be >= 1, got {args.draft_k}")
    kinds = [k.strip() for k in args.quantizations.split(",")]
    unknown = [k for k in kinds if k not in ("F32", "Q8_0", "Q4_1")]
    if unknown:
        sys.exit(f"--quantizations: unknown {unknown[0]!r}; allowed: F32, Q8_0, Q4_1")
    prompts = spec_bench_prompts(data_dir(args.data), args.per_category, parse_categories(args.categories))

    print(f"machine: {machine()}; llama.cpp threads: {args.threads}")
    print(
        f"{len(prompts)} prompts ({args.per_category} per category), {args.max_new_tokens} new tokens, "
        f"batch 1, greedy, chat template, median of {args.repeats} timed run(s) after a warm-up\n"
    )
    header = [
        "category",
        "quantization",
        "llama.cpp plain",
        "llama.cpp best",
        "its mode",
        "specjax plain",
        "specjax best",
        "its mode",
        "plain ratio",
        "best ratio",
        "specjax plain / its float32",
        "same greedy tokens",
    ]
    rows, float32_plain = [], {}
    for kind in kinds:
        rates, same = run_quantization(args, kind, prompts)
        modes = list(next(iter(rates.values())))
        every = [[category, *(rates[category][m] for m in modes)] for category in rates]
        print(f"{kind}, every mode (tokens/s):\n{markdown_table(['category', *modes], every)}\n", flush=True)
        for category in (c for c in SPEC_BENCH_CATEGORIES if c in rates):
            r = rates[category]
            ours = {name: rate for name, rate in r.items() if not name.startswith("llama.cpp")}
            ours_mode = max(ours, key=ours.get)
            if kind == "F32":
                float32_plain[category] = r["plain"]
            own = r["plain"] / float32_plain[category] if category in float32_plain else "-"
            theirs = ["-"] * 6  # llama.cpp's columns, where it ran
            if "llama.cpp plain" in r:
                peers = {name: rate for name, rate in r.items() if name.startswith("llama.cpp")}
                theirs_mode = max(peers, key=peers.get)
                ratios = [r["plain"] / peers["llama.cpp plain"], ours[ours_mode] / peers[theirs_mode]]
                mode = theirs_mode.removeprefix("llama.cpp ")
                theirs = [peers["llama.cpp plain"], peers[theirs_mode], mode, *ratios]
                theirs.append(f"{same[category]}/{args.per_category}")
            ours_columns = [r["plain"], ours[ours_mode], ours_mode]
            rows.append([category, kind, *theirs[:3], *ours_columns, *theirs[3:5], own, theirs[5]])
    print(markdown_table(header, rows), flush=True)


if __name__ == "__main__":
    main()
