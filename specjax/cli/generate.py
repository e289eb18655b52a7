"""`specjax generate`: text for prompts, with or without a proposer."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap

from specjax.cli.arguments import (
    add_load_options,
    json_value,
    load_options,
    positive_int,
)
from specjax.cli.train import options_as_flags

GENERATE_HELP = """Generate text for prompts given as arguments and/or read from a JSONL file.

    specjax generate "Write a haiku about JAX." --proposer ngram --k 4
    specjax generate --prompts-file questions.jsonl --limit 8 --proposer eagle \\
        --head heads/eagle/head --k 4 --json > out.jsonl
    specjax generate "Hi" --proposer '{"name": "dynamic", "proposer": {"name": "ngram", "k": 6}}'

The proposer is a name ({names}) or a JSON object with "name" and its
options (see specjax.named); --k, --layers, --head, --tree and --draft-model add the common
options to it. The chat template is
applied to every prompt unless --no-chat. Prints the texts on stdout and a metrics line per call
on stderr; with --json, one JSON object per prompt: prompt, text, tokens and that row's metrics
(its own counts; the times are those of the generate call, shared by its --batch-size rows).
"""

# proposer description key -> (argparse dest, flag) of the shortcut option that sets it
PROPOSER_SHORTCUTS = {
    "k": ("k", "--k"),
    "layers": ("layers", "--layers"),
    "head": ("head", "--head"),
    "tree": ("tree", "--tree"),
    "model": ("draft_model", "--draft-model"),
}


def proposer_description(args: argparse.Namespace):
    """--proposer (a name or a JSON object) with the shortcut options merged in; None for none."""
    given = {
        key: getattr(args, dest)
        for key, (dest, _) in PROPOSER_SHORTCUTS.items()
        if getattr(args, dest) is not None
    }
    if args.proposer is None:
        if given:
            flag = PROPOSER_SHORTCUTS[next(iter(given))][1]
            raise ValueError(f"{flag} needs --proposer (e.g. --proposer ngram --k 4)")
        return None
    if args.proposer.lstrip().startswith("{"):
        try:
            description = json.loads(args.proposer)
        except json.JSONDecodeError as error:
            raise ValueError(f"--proposer: not valid JSON ({error.msg}): {args.proposer!r}") from None
    else:
        description = {"name": args.proposer}
    if not isinstance(description, dict):
        raise ValueError(f"--proposer must be a name or a JSON object, got {args.proposer!r}")
    for key, value in given.items():
        if key in description:
            raise ValueError(
                f"{PROPOSER_SHORTCUTS[key][1]}: {key!r} is also in --proposer's JSON; give it once"
            )
        description[key] = value
    return description


def generate_prompts(args: argparse.Namespace) -> list[str]:
    from specjax.train import read_prompts

    prompts = list(args.prompts)
    if args.prompts_file:
        with options_as_flags():
            prompts += read_prompts(args.prompts_file, args.field, args.limit, option="prompts_file")
    if not prompts:
        raise ValueError("no prompts: give them as arguments or with --prompts-file FILE.jsonl")
    return prompts


def row_metrics(metrics, b: int) -> dict:
    """The summary of row b of a generate call's SpecMetrics (per-row counts, the call's times)."""
    import numpy as np

    rows = {
        f.name: getattr(metrics, f.name)[b : b + 1]
        for f in dataclasses.fields(metrics)
        if isinstance(getattr(metrics, f.name), np.ndarray)
    }
    return dataclasses.replace(metrics, **rows).summary()


def generate_command(args: argparse.Namespace) -> None:
    import jax

    import specjax
    from specjax.named import proposer_from_description
    from specjax.text import has_chat_template

    prompts = generate_prompts(args)
    description = proposer_description(args)
    sampling = specjax.Sampling(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p
    )
    model = specjax.load(args.model, **load_options(args))
    chat = not args.no_chat
    if chat and model.tokenizer is not None and not has_chat_template(model.tokenizer):
        raise ValueError(f"the tokenizer of {args.model!r} has no chat template: pass --no-chat")
    proposer = proposer_from_description(description, model, where="--proposer")
    key = jax.random.key(args.seed) if args.temperature > 0 else None
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start : start + args.batch_size]
        if key is not None and start > 0:
            key = jax.random.fold_in(key, start)  # each batch its own stream
        result = specjax.generate(
            model,
            batch,
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=args.max_new_tokens,
            key=key,
            chat=chat,
        )
        texts = result.texts or [None] * len(batch)
        for b, (prompt, text, tokens) in enumerate(zip(batch, texts, result.tokens, strict=True)):
            if args.json:
                row = {
                    "prompt": prompt,
                    "text": text,
                    "tokens": tokens,
                    "metrics": row_metrics(result.metrics, b),
                }
                print(json.dumps(row), flush=True)
                continue
            if len(prompts) > 1:
                print(f"--- prompt {start + b + 1} ---")
            print(text if text is not None else tokens, flush=True)
        if not args.json:
            print(result.metrics, file=sys.stderr)


def add_generate_command(commands) -> None:
    from specjax.named import PROPOSER_NAMES  # (the proposers' registry)

    names = textwrap.fill(", ".join(PROPOSER_NAMES), width=80, initial_indent=" " * 25)[25:]
    command = commands.add_parser(
        "generate",
        help="generate text, with or without a proposer",
        description=GENERATE_HELP.replace("{names}", names),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    command.add_argument("--prompts-file", help="a JSONL file of prompts (one JSON object per line)")
    command.add_argument(
        "--field", default="turns", help="the prompt's field in --prompts-file (default: turns)"
    )
    command.add_argument("--limit", type=positive_int, help="the first N prompts of --prompts-file")
    command.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    add_load_options(command)
    command.add_argument(
        "--proposer", help="a name (e.g. ngram) or a JSON description; default: none (plain decoding)"
    )
    command.add_argument(
        "--k", type=positive_int, help="draft tokens per step (ngram, self_draft, eagle, ...)"
    )
    command.add_argument("--layers", type=positive_int, help="self_draft: layers of the target to draft with")
    command.add_argument("--head", help="medusa, eagle: the folder of a saved head (e.g. heads/eagle/head)")
    command.add_argument(
        "--tree", type=json_value, help="medusa, eagle: a token tree, JSON paths: '[[0],[1],[0,0]]'"
    )
    command.add_argument("--draft-model", metavar="MODEL", help="draft_model: a name, folder or .gguf")
    command.add_argument("--max-new-tokens", type=positive_int, default=128, help="default 128")
    command.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    command.add_argument("--top-k", type=int, default=0, help="0 (default) is off")
    command.add_argument("--top-p", type=float, default=1.0, help="1 (default) is off")
    command.add_argument("--min-p", type=float, default=0.0, help="0 (default) is off")
    command.add_argument(
        "--seed", type=int, default=0, help="the PRNG seed when --temperature > 0 (default 0)"
    )
    command.add_argument(
        "--batch-size", type=positive_int, default=8, help="prompts per generate call (default 8)"
    )
    command.add_argument(
        "--no-chat", action="store_true", help="feed the prompts as they are, no chat template"
    )
    command.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    command.set_defaults(run=generate_command)
