"""The `specjax` command line. Subcommands:

    specjax train-medusa --prompts FILE.jsonl [--exclude HELD_OUT.jsonl] --out DIR [options]

`train-medusa` builds a self-distillation set (the target's own greedy continuations of the
prompts and its hidden states along them), trains Medusa heads on it and saves them to DIR
(`specjax.train.load_head(DIR, model)` reads them back). Training checkpoints go to DIR/checkpoints,
and a rerun resumes from the latest. Keep the training prompts apart from the prompts you
evaluate on: `--exclude` drops every prompt that also appears in a held-out file. For the
built-in model: `--prompts ../shared/data/spec_bench_question.jsonl --exclude
../shared/data/mt_bench_question.jsonl` trains on Spec-Bench's non-MT-bench categories and keeps
MT-bench for evaluation.
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


def train_medusa_command(args: argparse.Namespace) -> None:
    import specjax
    from specjax.train import distill_medusa_data, save_head, train_medusa

    prompts = read_prompts(args.prompts, args.field, None)
    if args.exclude:  # a held-out set: none of its prompts may be trained on
        held_out = set(read_prompts(args.exclude, args.field, None))
        prompts = [p for p in prompts if p not in held_out]
    prompts = prompts[: args.limit]
    model = specjax.load(args.model)
    print(f"{model}: generating {args.new_tokens} tokens for {len(prompts)} prompts", file=sys.stderr)
    sequences = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start : start + args.batch_size]
        result = specjax.generate(model, chunk, max_new_tokens=args.new_tokens, chat=True)
        sequences += [p + t for p, t in zip(result.prompt_tokens, result.tokens, strict=True)]
    sequences = [s[-args.max_len :] for s in sequences]  # the continuation matters most
    data = distill_medusa_data(model, sequences, max_len=args.max_len, batch_size=args.batch_size)
    out = Path(args.out)
    head = train_medusa(
        model,
        data,
        num_heads=args.heads,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        seed=args.seed,
        checkpoint_dir=out / "checkpoints",
    )
    head.meta.update(prompts_file=str(args.prompts), prompts_field=args.field, num_prompts=len(prompts))
    save_head(out / "head", head)
    print(f"saved {args.heads} Medusa heads to {out / 'head'}", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="specjax", description="specjax: speculative decoding in JAX")
    commands = main.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train-medusa", help="train Medusa heads for a model by self-distillation", description=__doc__
    )
    train.add_argument("--prompts", required=True, help="a JSONL file of training prompts")
    train.add_argument("--field", default="turns", help="the JSON field holding the prompt (default: turns)")
    train.add_argument("--out", required=True, help="folder for the heads and the training checkpoints")
    train.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    train.add_argument(
        "--exclude", default=None, help="a JSONL file of held-out prompts (same field) to leave out"
    )
    train.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    train.add_argument("--heads", type=int, default=4, help="number of Medusa heads (default 4)")
    train.add_argument("--new-tokens", type=int, default=128, help="continuation length per prompt")
    train.add_argument("--max-len", type=int, default=256, help="tokens per training sequence")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--learning-rate", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(run=train_medusa_command)
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
