"""Shared pieces of the benchmarks: options, the HF reference; the prompt sets, machine description,
timing and tables live in specjax.bench (re-exported here).

The prompt data is read from the folder given by --data, else $SPECJAX_DATA, else ../shared/data
(relative to the repository root); it is never copied into the repository.
"""

from __future__ import annotations

from pathlib import Path

from specjax import bench
from specjax.bench import (  # noqa: F401  (re-exported for the benchmark scripts)
    EAGLE_TREE,
    MT_BENCH_CATEGORIES,
    SPEC_BENCH_CATEGORIES,
    machine,
    markdown_table,
    median_time,
    spec_bench_prompts,
)

REPO = Path(__file__).resolve().parent.parent


def common_arguments(description: str, timed: bool = True):
    """The options the Spec-Bench benchmarks take; returns an argparse parser to add to. `timed`:
    also --repeats and --no-hf, for the scripts that time generate against HF transformers."""
    import argparse

    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data", help="folder with spec_bench_question.jsonl (default: $SPECJAX_DATA or ../shared/data)"
    )
    parser.add_argument(
        "--per-category",
        type=int,
        default=2,
        help="the first N questions of each category (default %(default)s)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens per prompt (default %(default)s)"
    )
    if timed:
        parser.add_argument(
            "--repeats", type=int, default=3, help="timed runs per measurement after a warm-up (median)"
        )
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
    try:
        return bench.data_dir(option)
    except ValueError as error:
        raise SystemExit(str(error)) from None
