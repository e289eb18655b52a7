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
import contextlib
import dataclasses
import json
import sys
import textwrap
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------
# specjax generate

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


# ---------------------------------------------------------------------------------------------
# specjax bench

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


# ---------------------------------------------------------------------------------------------
# specjax ablate

ABLATE_HELP = """Run an ablation sweep from a YAML or JSON spec (see specjax.ablation): every
combination of its proposers and settings on its prompts, with specjax.ablate.

    specjax ablate sweeps/k.yaml --out results/k

Writes the table to DIR/ablation.csv and the figures to DIR/*.png, then prints where they went
and the table's main columns (speed, speedup and acceptance of each configuration).
"""


# The columns of the table printed after a sweep (all of them are in ablation.csv).
ABLATE_SUMMARY_COLUMNS = (
    "category",
    "proposer",
    "k",
    "temperature",
    "seed",
    "tokens_per_second",
    "speedup",
    "acceptance_rate",
    "mean_acceptance_length",
)


def ablate_command(args: argparse.Namespace) -> None:
    spec = Path(args.spec)
    if not spec.is_file():
        raise ValueError(f"no such file {args.spec!r} (a YAML or JSON sweep spec)")
    if spec.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"{args.spec!r}: a sweep spec is a .yaml, .yml or .json file")
    try:
        from specjax.sweep import run_sweep_file
    except ImportError as error:
        raise ValueError(
            f"ablation sweeps are not available here ({error}); they need pandas and matplotlib"
        ) from None
    out = Path(args.out)
    frame = run_sweep_file(spec, out, progress=True)
    figures = sorted(out.glob("*.png"))
    print(f"table: {out / 'ablation.csv'} ({len(frame)} rows)")
    print(f"figures: {', '.join(str(f) for f in figures) or 'none'}")
    summary = [c for c in ABLATE_SUMMARY_COLUMNS if c in frame.columns]
    print(frame[summary].to_string(max_rows=20, float_format=lambda x: f"{x:.3g}"))


def add_ablate_command(commands) -> None:
    command = commands.add_parser(
        "ablate",
        help="run an ablation sweep from a YAML or JSON spec; write its table and figures",
        description=ABLATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("spec", metavar="SPEC", help="the sweep spec, a .yaml or .json file")
    command.add_argument(
        "--out", required=True, metavar="DIR", help="folder for ablation.csv and the figures"
    )
    command.set_defaults(run=ablate_command)


# ---------------------------------------------------------------------------------------------
# specjax serve

SERVE_HELP = """An OpenAI-compatible HTTP server (FastAPI and uvicorn) over specjax's engine, which
batches requests continuously over the compiled loop.

    specjax serve smollm2-135m --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'
    specjax serve ./my-model --host 0.0.0.0 --port 8001 --max-batch 16 --served-model-name mine

Routes: /v1/chat/completions and /v1/completions (stream=true: server-sent events), /v1/models,
/health and /metrics (Prometheus, vLLM's names under the prefix specjax:). --speculative-config
takes vLLM's and FastDeploy's keys: "method" (ngram, draft_model, eagle, eagle3, medusa, dflash,
mlp_speculator; specjax's self_draft and specjax), "num_speculative_tokens", "model" (a draft model,
or a head's folder), "prompt_lookup_max", "prompt_lookup_min" (see specjax/serve/config.py). A request may
send "speculative": false to be decoded without the proposer. At most --max-waiting requests
wait for a slot; past them a request is answered at once with HTTP 503 (retry later).
"""


def serve_command(args: argparse.Namespace) -> None:
    try:
        from specjax.serve import serve
    except ModuleNotFoundError as error:
        if error.name not in ("fastapi", "starlette", "uvicorn", "prometheus_client"):
            raise
        raise ValueError(
            f"the server needs FastAPI, uvicorn and prometheus-client ({error.name} is missing): "
            "pip install 'specjax[serve]'"
        ) from None
    serve(
        args.model,
        args.speculative_config,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        **load_options(args),
        max_batch=args.max_batch,
        max_model_len=args.max_model_len,
        chunk_steps=args.chunk_steps,
        admission_steps=args.admission_steps,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        metrics_prefix=args.metrics_prefix,
        precompile=None if args.precompile == -1 else args.precompile,
    )


def add_serve_command(commands) -> None:
    command = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and completions, streamed; Prometheus metrics)",
        description=SERVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("model", metavar="MODEL", help="built-in name, HF folder or .gguf file")
    command.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    command.add_argument("--port", type=positive_int, default=8000, help="default 8000")
    command.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="default float32"
    )
    add_load_options(command)
    command.add_argument(
        "--max-batch", type=positive_int, default=8, help="requests decoded together (default 8)"
    )
    command.add_argument(
        "--max-model-len",
        type=positive_int,
        help="the longest prompt plus answer, in tokens (default: the engine's, from the model's context)",
    )
    command.add_argument(
        "--chunk-steps",
        type=positive_int,
        default=16,
        help="loop steps between two looks at the queue (default 16)",
    )
    command.add_argument(
        "--admission-steps",
        type=positive_int,
        help="loop steps between two looks at the queue while a slot is free (default 4; <= --chunk-steps)",
    )
    command.add_argument(
        "--max-waiting",
        type=non_negative_int,
        help="requests that may wait for a slot; past them a request gets HTTP 503 (default 4 x --max-batch)",
    )
    command.add_argument(
        "--speculative-config", type=json_value, help='vLLM\'s JSON object, e.g. \'{"method": "ngram"}\''
    )
    command.add_argument("--served-model-name", help="the model's id in the API (default: MODEL as given)")
    command.add_argument(
        "--metrics-prefix",
        default="specjax:",
        help="prefix of the Prometheus names (default specjax:; vllm: gives vLLM's exact names)",
    )
    command.add_argument(
        "--precompile",
        type=tokens_or_off,
        default=256,
        metavar="TOKENS",
        help="before listening, compile the loop at every width and the prefill of prompts up to "
        "TOKENS tokens (default 256; -1: compile each program on first use, stalling the running "
        "requests while it compiles)",
    )
    command.set_defaults(run=serve_command)


# ---------------------------------------------------------------------------------------------
# specjax train-medusa, train-eagle


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
