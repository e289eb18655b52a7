"""The `specjax` command line. Subcommands (each with `--help`):

    specjax generate "prompt" [...] [--model smollm2-135m] [--proposer ngram --k 4] [--json]
    specjax bench [--methods plain,ngram,eagle] [--categories qa] [--format markdown|csv] [--out FILE]
    specjax ablate SPEC.yaml --out DIR
    specjax serve MODEL [--host H] [--port P] [--speculative-config JSON] [options]
    specjax train-medusa [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-eagle [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-eagle3 [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-dflash [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-mlp-speculator [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-mtp [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]

A bad argument or input gives one line, `specjax <command>: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from specjax.cli.ablate import add_ablate_command
from specjax.cli.bench import add_bench_command
from specjax.cli.generate import add_generate_command
from specjax.cli.serve import add_serve_command
from specjax.cli.train import add_train_commands


class UsageError(Exception):
    """A bad command line, already worded `specjax <command>: error: ...`."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage is in --help); subcommand parsers inherit it."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")


def parser() -> argparse.ArgumentParser:
    main = ArgumentParser(
        prog="specjax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = main.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_command(commands)
    add_bench_command(commands)
    add_ablate_command(commands)
    add_serve_command(commands)
    add_train_commands(commands)
    return main


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns the exit status (0, 2 for a bad argument or input, 130 when
    interrupted). User mistakes print one line on stderr, never a traceback."""
    try:
        args = parser().parse_args(argv)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0
    try:
        args.run(args)
    except (ValueError, OSError) as error:  # bad input or a missing file: one line, not a traceback
        message = " ".join(str(error).split())
        print(f"specjax {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nspecjax {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
