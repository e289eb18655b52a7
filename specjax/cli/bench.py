"""`specjax bench`: Spec-Bench tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specjax.cli.arguments import add_load_options, load_options, positive_int

BENCH_HELP = """Spec-Bench: tokens/s, speedup over plain decoding and mean acceptance length (tau)
per category for each method, on a fixed subset of Spec-Bench (the first --per-category questions
of each category; see specjax.bench), batch 1, greedy, median of --repeats after a warm-up call.

    specjax bench --methods plain,ngram,eagle --categories mt_bench,qa --per-category 4
    specjax bench --methods ngram,selfdraft --format csv --out spec_bench.csv

Medusa and EAGLE read trained heads from --heads (medusa/head, eagle/head: `make heads`). The
questions come from spec_bench_question.jsonl in --data (default $SPECJAX_DATA or ../shared/data).
A progress bar on stderr ticks once per generate call; the table is printed at the end (Markdown,
with per-position acceptance, or CSV) and written to --out when given.
"""


def bench_command(args: argparse.Namespace) -> None:
    import specjax
    from specjax import bench

    categories = bench.parse_categories(args.categories)
    descriptions = bench.method_descriptions(**bench.method_options(args))
    prompts = bench.spec_bench_prompts(bench.data_dir(args.data), args.per_category, categories)
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise ValueError(f"--out: no folder {str(Path(args.out).parent)!r} to write {args.out!r} in")
    model = specjax.load(args.model, **load_options(args))
    methods = bench.make_methods(model, descriptions)
    from tqdm import tqdm

    total = bench.num_calls(len(prompts), len(methods), args.repeats)
    with tqdm(total=total, desc="spec-bench", unit="call", file=sys.stderr, dynamic_ncols=True) as bar:

        def progress(tick: bench.Tick) -> None:
            bar.set_postfix_str(
                f"{tick.category} {tick.prompt_index + 1}/{tick.num_prompts} {tick.method}", False
            )
            bar.update(1)

        result = bench.run_spec_bench(
            model,
            prompts,
            methods,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            chat=not args.no_chat,
            progress=progress,
        )
    table = result.report(args.format).rstrip("\n")
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
        print(f"wrote the table to {args.out}", file=sys.stderr)


def add_bench_command(commands) -> None:
    from specjax import bench

    command = commands.add_parser(
        "bench",
        help="the Spec-Bench table: speed and acceptance of speculative methods per category",
        description=BENCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    add_load_options(command)
    command.add_argument("--data", help="folder with spec_bench_question.jsonl")
    command.add_argument(
        "--per-category", type=positive_int, default=2, help="questions per category (default 2)"
    )
    command.add_argument("--max-new-tokens", type=positive_int, default=128, help="default 128")
    command.add_argument("--repeats", type=positive_int, default=3, help="timed calls per prompt and method")
    bench.add_method_arguments(command)
    command.add_argument(
        "--no-chat", action="store_true", help="feed the questions without the chat template"
    )
    command.add_argument("--format", choices=("markdown", "csv"), default="markdown", help="default markdown")
    command.add_argument("--out", help="also write the table to this file")
    command.set_defaults(run=bench_command)
