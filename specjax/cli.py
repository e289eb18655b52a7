"""The `specjax` command line. Subcommands:

    specjax train-medusa --prompts FILE.jsonl [--exclude HELD_OUT.jsonl] --out DIR [options]
    specjax train-eagle --prompts FILE.jsonl [--exclude HELD_OUT.jsonl] --out DIR [options]

Both build a self-distillation set (the target's own greedy continuations of the prompts and its
hidden states along them), train a head on it (Medusa heads or an EAGLE head, drafting from the
`--draft-vocab` most frequent tokens of the set) and save it to DIR/head
(`specjax.train.load_head(DIR/head, model)` reads it back). Training checkpoints go to
DIR/checkpoints, and a rerun resumes from the latest. `--data FILE.npz` keeps the distillation
set: read from FILE when it exists, else built and saved there, so one set trains both heads.
Keep the training prompts apart from the prompts you evaluate on: `--exclude` drops every prompt
that also appears in a held-out file. For the built-in model: `--prompts
../shared/data/spec_bench_question.jsonl --exclude ../shared/data/mt_bench_question.jsonl` trains
on Spec-Bench's non-MT-bench categories and keeps MT-bench for evaluation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_prompts(path: str, field: str, limit: int | None) -> list[str]:
    """The `field` of each JSON line of `path`; a list value (MT-bench's "turns") gives its first
    entry."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts: no such file {path!r}")
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if field not in record:
            raise ValueError(f"--prompts: line {number} of {path!r} has no field {field!r} (see --field)")
        value = record[field]
        prompts.append(value[0] if isinstance(value, list) else value)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"--prompts: {path!r} holds no prompts")
    return prompts


def training_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompts, less those of --exclude (a held-out set: none of its prompts may
    be trained on), the first --limit of them."""
    prompts = read_prompts(args.prompts, args.field, None)
    if args.exclude:
        held_out = set(read_prompts(args.exclude, args.field, None))
        prompts = [p for p in prompts if p not in held_out]
    return prompts[: args.limit]


def distillation_set(args: argparse.Namespace, model, prompts: list[str]):
    """The --data file's set if it exists; else the model's continuations of `prompts` and its
    hidden states along them, saved to --data when given."""
    import specjax
    from specjax.train import DistillationData, distill_data

    if args.data and Path(args.data).is_file():
        print(f"reading the distillation set from {args.data}", file=sys.stderr)
        return DistillationData.load(args.data)
    print(f"{model}: generating {args.new_tokens} tokens for {len(prompts)} prompts", file=sys.stderr)
    sequences = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        result = specjax.generate(model, chunk, max_new_tokens=args.new_tokens, chat=True)
        sequences += [p + t for p, t in zip(result.prompt_tokens, result.tokens, strict=True)]
    sequences = [s[-args.max_len :] for s in sequences]  # the continuation matters most
    data = distill_data(model, sequences, max_len=args.max_len, batch_size=args.batch_size)
    if args.data:
        data.save(args.data)
        print(f"saved the distillation set to {args.data}", file=sys.stderr)
    return data


DEFAULT_DRAFT_VOCAB = 8192


def check_draft_vocab_option(args: argparse.Namespace, model) -> None:
    """Resolve the default --draft-vocab (8192, or the whole vocabulary of a smaller model) and
    refuse one the model cannot have, before the costly generation."""
    V = model.config.vocab_size
    if args.draft_vocab is None:
        args.draft_vocab = min(DEFAULT_DRAFT_VOCAB, V)
    if not 1 <= args.draft_vocab <= V:
        raise ValueError(f"--draft-vocab must be in 1..{V} (the model's vocab size), got {args.draft_vocab}")


def save_trained_head(args: argparse.Namespace, head, num_prompts: int) -> Path:
    from specjax.train import save_head

    head.meta.update(prompts_file=str(args.prompts), prompts_field=args.field, num_prompts=num_prompts)
    if args.data:
        head.meta.update(data_file=str(args.data))
    save_head(Path(args.out) / "head", head)
    return Path(args.out) / "head"


def train_head(args: argparse.Namespace, trainer, **options) -> Path:
    """Load the model, build or read the distillation set, train with `trainer` (train_medusa or
    train_eagle; `options` are its own) and save the head; returns where."""
    import specjax

    prompts = training_prompts(args)
    model = specjax.load(args.model)
    check_draft_vocab_option(args, model)
    data = distillation_set(args, model, prompts)
    head = trainer(
        model,
        data,
        draft_vocab_size=args.draft_vocab,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        checkpoint_dir=Path(args.out) / "checkpoints",
        **options,
    )
    return save_trained_head(args, head, len(prompts))


def train_medusa_command(args: argparse.Namespace) -> None:
    from specjax.train import train_medusa

    path = train_head(args, train_medusa, num_heads=args.heads)
    print(f"saved {args.heads} Medusa heads ({args.draft_vocab} draft tokens) to {path}", file=sys.stderr)


def train_eagle_command(args: argparse.Namespace) -> None:
    from specjax.train import train_eagle

    path = train_head(args, train_eagle, noise=args.noise)
    print(f"saved an EAGLE head ({args.draft_vocab} draft tokens) to {path}", file=sys.stderr)


def add_training_options(command: argparse.ArgumentParser, learning_rate: float) -> None:
    """The options both trainers take."""
    command.add_argument("--prompts", required=True, help="a JSONL file of training prompts")
    command.add_argument(
        "--field", default="turns", help="the JSON field holding the prompt (default: turns)"
    )
    command.add_argument("--out", required=True, help="folder for the head and the training checkpoints")
    command.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    command.add_argument(
        "--exclude", default=None, help="a JSONL file of held-out prompts (same field) to leave out"
    )
    command.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    command.add_argument(
        "--data", default=None, help="an .npz distillation set: read if it exists, else built and saved there"
    )
    command.add_argument("--new-tokens", type=int, default=128, help="continuation length per prompt")
    command.add_argument("--max-len", type=int, default=256, help="tokens per training sequence")
    command.add_argument("--steps", type=int, default=1000)
    command.add_argument("--batch-size", type=int, default=8)
    command.add_argument("--learning-rate", type=float, default=learning_rate)
    command.add_argument("--seed", type=int, default=0)
    command.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="tokens the head drafts from: the most frequent of the set (default 8192, or the whole "
        "vocabulary of a model with fewer)",
    )


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="specjax", description="specjax: speculative decoding in JAX")
    commands = main.add_subparsers(dest="command", required=True)
    medusa = commands.add_parser(
        "train-medusa", help="train Medusa heads for a model by self-distillation", description=__doc__
    )
    add_training_options(medusa, learning_rate=1e-3)
    medusa.add_argument("--heads", type=int, default=4, help="number of Medusa heads (default 4)")
    medusa.set_defaults(run=train_medusa_command)
    eagle = commands.add_parser(
        "train-eagle", help="train an EAGLE head for a model by self-distillation", description=__doc__
    )
    add_training_options(eagle, learning_rate=3e-4)
    eagle.add_argument(
        "--noise", type=float, default=0.1, help="uniform noise on the input features (default 0.1)"
    )
    eagle.set_defaults(run=train_eagle_command)
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except ValueError as error:  # bad input: one line, not a traceback
        print(f"specjax {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
