"""Argument types and options that several commands share."""

from __future__ import annotations

import argparse
import json


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def tokens_or_off(text: str) -> int:
    """An integer >= 0, or -1 (off)."""
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, or -1 for off; got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def add_load_options(command: argparse.ArgumentParser) -> None:
    """--quantization and --group-size, for the commands that load a model (`load_options`)."""
    from specjax.models.quantized import QUANTIZATIONS

    command.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="gguf: keep a .gguf file's blocks; int8, int4, fp8: quantize the projections and the "
        "head at load (default: the checkpoint's own weights, an FP8 one's kept FP8)",
    )
    command.add_argument("--group-size", type=positive_int, help="int4's groups: 32 (default) or 128")


def load_options(args: argparse.Namespace) -> dict:
    """specjax.load's quantization options from the command line (`add_load_options`)."""
    return dict(quantization=args.quantization, group_size=args.group_size)


def json_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error.msg}): {text!r}") from None
