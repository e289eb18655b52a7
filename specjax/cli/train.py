"""`specjax train-medusa`, `train-eagle`, `train-eagle3`, `train-dflash`, `train-mlp-speculator`, `train-mtp`:
thin over the distillation pipeline (specjax.train.pipeline)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

from specjax.cli.arguments import non_negative_int, positive_int

TRAIN_HELP = """    specjax train-medusa [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-eagle [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-eagle3 [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-dflash [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-mlp-speculator [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]
    specjax train-mtp [--prompts FILE.jsonl] [--self-instruct N] --out DIR [options]

Each builds a self-distillation set (the target's own greedy continuations of the prompts and its
hidden states along them), trains a head on it (Medusa heads, an EAGLE, EAGLE-3 or DFlash head,
drafting from the `--draft-vocab` most frequent tokens of the set; an MLP speculator or MTP layers,
drafting from the whole vocabulary) and saves it to DIR/head (`specjax.load_head(DIR/head, model)`
reads it back; MTP layers draft as `specjax.MTP()` over `model.with_mtp(layers)`). Training checkpoints go to
DIR/checkpoints, and a rerun resumes from the latest. `--data FILE.npz` keeps the distillation
set: read from FILE when it exists, else built and saved there, so one set trains every head.
Keep the training prompts apart from the prompts you evaluate on: `--exclude` drops every prompt
that also appears in a held-out file. For the built-in model, `--split spec-bench-minus-mt-bench`
(what `make heads` runs; the split is defined once, specjax.bench.HEADS_SPLIT, and the benchmarks
read it too) is `--prompts ../shared/data/spec_bench_question.jsonl --exclude
../shared/data/mt_bench_question.jsonl`: it trains on Spec-Bench's non-MT-bench categories and
keeps MT-bench for evaluation. `--self-instruct N`
adds N chat prompts the model writes itself (fed its chat template up to a user's message, as
Magpie does; none equal to a held-out or --prompts prompt), with or without --prompts.
"""


def flag(option: str) -> str:
    """The flag of a TrainingOptions field (draft_vocab: --draft-vocab), also its argparse dest."""
    return "--" + option.replace("_", "-")


@contextlib.contextmanager
def options_as_flags():
    """The pipeline's OptionErrors as ValueErrors naming the command's flags (main's one line)."""
    from specjax.train import OptionError

    try:
        yield
    except OptionError as error:
        raise ValueError(error.worded(flag)) from None


def training_options(args: argparse.Namespace):
    """The TrainingOptions of a `specjax train-<head>` command line (each field is the dest of its
    flag; --draft-vocab only where HEAD_TRAINERS says the head has a draft vocabulary)."""
    from specjax.train import HEAD_TRAINERS, TrainingOptions

    head = trained_head(args)
    names = [
        field.name
        for field in dataclasses.fields(TrainingOptions)
        if field.name != "draft_vocab" or HEAD_TRAINERS[head].draft_vocab
    ]
    with options_as_flags():
        return TrainingOptions(**{name: getattr(args, name) for name in names})


def trained_head(args: argparse.Namespace) -> str:
    """The HEAD_TRAINERS name of a train command: train-mlp-speculator trains "mlp_speculator"."""
    return args.command.removeprefix("train-").replace("-", "_")


def run_training(args: argparse.Namespace, **trainer_options):
    """Run specjax.train.train_head for the command line (`trainer_options` are the trainer's own);
    returns the head and where it was saved."""
    from specjax.train import train_head

    options = training_options(args)
    with options_as_flags():
        head = train_head(args.model, trained_head(args), options, **trainer_options)
    return head, options.head_folder


def train_medusa_command(args: argparse.Namespace) -> None:
    head, path = run_training(args, num_heads=args.heads)
    vocab = head.config.draft_vocab_size
    print(f"saved {args.heads} Medusa heads ({vocab} draft tokens) to {path}", file=sys.stderr)


def train_eagle_command(args: argparse.Namespace) -> None:
    head, path = run_training(args, noise=args.noise, unroll=args.unroll)
    print(f"saved an EAGLE head ({head.config.draft_vocab_size} draft tokens) to {path}", file=sys.stderr)


def train_eagle3_command(args: argparse.Namespace) -> None:
    head, path = run_training(args, unroll=args.unroll)
    print(f"saved an EAGLE-3 head ({head.config.draft_vocab_size} draft tokens) to {path}", file=sys.stderr)


def train_dflash_command(args: argparse.Namespace) -> None:
    head, path = run_training(
        args, block_size=args.block, num_layers=args.layers, anchors_per_sequence=args.anchors
    )
    blocks = f"blocks of {args.block}, {head.config.draft_vocab_size} draft tokens"
    print(f"saved a DFlash head ({blocks}) to {path}", file=sys.stderr)


def train_mlp_speculator_command(args: argparse.Namespace) -> None:
    _, path = run_training(args, n_predict=args.n_predict, positions_per_sequence=args.positions or None)
    print(f"saved an MLP speculator ({args.n_predict} stages) to {path}", file=sys.stderr)


def train_mtp_command(args: argparse.Namespace) -> None:
    _, path = run_training(
        args, num_layers=args.layers, init=args.init, positions_per_sequence=args.positions or None
    )
    print(f"saved {args.layers} MTP layer(s) to {path}", file=sys.stderr)


def add_training_options(
    command: argparse.ArgumentParser, learning_rate: float, draft_vocab: bool = True
) -> None:
    """The options every trainer takes (--draft-vocab: those whose heads have a draft vocabulary)."""
    command.add_argument("--prompts", default=None, help="a JSONL file of training prompts")
    command.add_argument(
        "--split",
        default=None,
        metavar="NAME",
        help="a named split of specjax.bench.SPLITS instead of --prompts and --exclude: its prompts less "
        "its held-out file, read from --split-data (`make heads`: spec-bench-minus-mt-bench)",
    )
    command.add_argument(
        "--split-data",
        default=None,
        help="the folder of --split's files (default: $SPECJAX_DATA or ../shared/data)",
    )
    command.add_argument(
        "--self-instruct",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="add N chat prompts the model writes itself (Magpie; seeded by --seed; default 0)",
    )
    command.add_argument(
        "--field", default="turns", help="the JSON field holding the prompt (default: turns)"
    )
    command.add_argument("--out", required=True, help="folder for the head and the training checkpoints")
    command.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    command.add_argument(
        "--exclude", default=None, help="a JSONL file of held-out prompts (same field) to leave out"
    )
    command.add_argument("--limit", type=int, default=None, help="use the first N prompts of --prompts only")
    command.add_argument(
        "--data", default=None, help="an .npz distillation set: read if it exists, else built and saved there"
    )
    command.add_argument("--new-tokens", type=int, default=128, help="continuation length per prompt")
    command.add_argument("--max-len", type=int, default=256, help="tokens per training sequence")
    command.add_argument("--steps", type=int, default=1000)
    command.add_argument("--batch-size", type=int, default=8, help="training sequences per step (default 8)")
    command.add_argument(
        "--generate-batch-size",
        type=positive_int,
        default=16,
        help="prompts answered per generate call (default 16)",
    )
    command.add_argument("--learning-rate", type=float, default=learning_rate)
    command.add_argument("--seed", type=int, default=0)
    if not draft_vocab:
        return
    command.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="tokens the head drafts from: the most frequent of the set (default 8192, or the whole "
        "vocabulary of a model with fewer)",
    )


def add_positions_option(command: argparse.ArgumentParser) -> None:
    """--positions, for trainers whose heads predict from each position alone (MLP speculator, MTP):
    their `positions_per_sequence`, 0 for None."""
    command.add_argument(
        "--positions",
        type=non_negative_int,
        default=64,
        help="positions scored per sequence and step, at random (default 64; 0: all of them)",
    )


def add_train_commands(commands) -> None:
    """The six train commands, each with its head's own options."""
    medusa = commands.add_parser(
        "train-medusa", help="train Medusa heads for a model by self-distillation", description=TRAIN_HELP
    )
    add_training_options(medusa, learning_rate=1e-3)
    medusa.add_argument("--heads", type=int, default=4, help="number of Medusa heads (default 4)")
    medusa.set_defaults(run=train_medusa_command)
    eagle = commands.add_parser(
        "train-eagle", help="train an EAGLE head for a model by self-distillation", description=TRAIN_HELP
    )
    add_training_options(eagle, learning_rate=3e-3)
    eagle.add_argument(
        "--noise", type=float, default=0.1, help="uniform noise on the input features (default 0.1)"
    )
    eagle.add_argument(
        "--unroll",
        type=positive_int,
        default=1,
        help="passes of the training loss: 1 is EAGLE-1's teacher forcing; n > 1 also trains on the "
        "head's own predictions n - 1 steps deep (EAGLE-3's training-time test; default 1)",
    )
    eagle.set_defaults(run=train_eagle_command)
    eagle3 = commands.add_parser(
        "train-eagle3", help="train an EAGLE-3 head for a model by self-distillation", description=TRAIN_HELP
    )
    add_training_options(eagle3, learning_rate=3e-3)
    eagle3.add_argument(
        "--unroll",
        type=positive_int,
        default=3,
        help="training-time test: passes of the loss, the head fed its own outputs n - 1 deep (default 3)",
    )
    eagle3.set_defaults(run=train_eagle3_command)
    dflash = commands.add_parser(
        "train-dflash",
        help="train a DFlash block drafter for a model by self-distillation",
        description=TRAIN_HELP,
    )
    add_training_options(dflash, learning_rate=3e-3)
    dflash.add_argument(
        "--block", type=positive_int, default=8, help="tokens per drafted block, anchor included (default 8)"
    )
    dflash.add_argument(
        "--layers", type=positive_int, default=1, help="the head's decoder layers (default 1)"
    )
    dflash.add_argument(
        "--anchors",
        type=positive_int,
        default=16,
        help="blocks scored per training sequence and step (default 16)",
    )
    dflash.set_defaults(run=train_dflash_command)
    mlp = commands.add_parser(
        "train-mlp-speculator",
        help="train an MLP speculator for a model by self-distillation",
        description=TRAIN_HELP,
    )
    add_training_options(mlp, learning_rate=1e-3, draft_vocab=False)
    mlp.add_argument("--n-predict", type=positive_int, default=3, help="stages, tokens drafted (default 3)")
    add_positions_option(mlp)
    mlp.set_defaults(run=train_mlp_speculator_command)
    mtp = commands.add_parser(
        "train-mtp",
        help="train MTP layers (DeepSeek-V3's module) for a model by self-distillation",
        description=TRAIN_HELP,
    )
    add_training_options(mtp, learning_rate=1e-3, draft_vocab=False)
    mtp.add_argument("--layers", type=positive_int, default=1, help="MTP layers, chained (default 1)")
    mtp.add_argument(
        "--init",
        choices=("last_layer", "random"),
        default="last_layer",
        help="each layer's start: the target's last layer and final norm (default), or random",
    )
    add_positions_option(mtp)
    mtp.set_defaults(run=train_mtp_command)
