"""Shared pieces of the benchmarks: prompt sets, machine description, timing, tables.

The prompt data is read from the folder given by --data, else $SPECJAX_DATA, else ../shared/data
(relative to the repository root); it is never copied into the repository.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MT_BENCH_CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}
# A sparse EAGLE tree for SmolLM2: wide at the first draft position, where acceptance is highest,
# then deeper along the best candidates (11 nodes, depth 5).
EAGLE_TREE = (
    (0,),
    (1,),
    (2,),
    (0, 0),
    (0, 1),
    (1, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 0, 0),
)
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def common_arguments(description: str):
    """The options every benchmark takes; returns an argparse parser to add to."""
    import argparse

    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", help="folder with spec_bench_question.jsonl (default: $SPECJAX_DATA or ../shared/data)"
    )
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baselines")
    return parser


def load_hf_reference():
    """HF transformers' float32 load of the built-in model's GGUF (torch: benchmark-only)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specjax.models.loading import builtin_path

    path = builtin_path("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def data_dir(option: str | None = None) -> Path:
    folder = Path(option or os.environ.get("SPECJAX_DATA") or REPO.parent / "shared" / "data")
    if not (folder / "spec_bench_question.jsonl").exists():
        raise SystemExit(f"no spec_bench_question.jsonl in {folder}: pass --data or set SPECJAX_DATA")
    return folder


def spec_bench_prompts(folder: Path, per_category: int) -> list[tuple[str, str]]:
    """The first `per_category` questions of each Spec-Bench category, in file order (a fixed,
    documented subset); MT-bench's eight sub-categories count as one, "mt_bench", taken round-robin
    over the sub-categories. Returns (category, first turn) pairs."""
    rows = [json.loads(line) for line in (folder / "spec_bench_question.jsonl").open()]
    chosen = []
    for category in SPEC_BENCH_CATEGORIES:
        if category == "mt_bench":
            pool = [r for r in rows if r["category"] in MT_BENCH_CATEGORIES]
            pool.sort(
                key=lambda r: (int(r["question_id"]) - 81) % 10 * 100 + (int(r["question_id"]) - 81) // 10
            )
        else:
            pool = [r for r in rows if r["category"] == category]
        chosen += [(category, r["turns"][0]) for r in pool[:per_category]]
    return chosen


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    return (
        f"{cpu}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} device(s))"
    )


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(x):
        return f"{x:.2f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
