"""`specjax serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse

from specjax.cli.arguments import (
    add_load_options,
    json_value,
    load_options,
    non_negative_int,
    positive_int,
    tokens_or_off,
)
from specjax.serve.engine_config import DEFAULT_CONSTRAINT_STATES, DEFAULT_MAX_LOGPROBS

SERVE_HELP = """An OpenAI-compatible HTTP server (FastAPI and uvicorn) over specjax's engine, which
batches requests continuously over the compiled loop.

    specjax serve smollm2-135m --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'
    specjax serve ./my-model --host 0.0.0.0 --port 8001 --max-batch 16 --served-model-name mine

Routes: /v1/chat/completions and /v1/completions (stream=true: server-sent events), /v1/models,
/v1/models/{id}, vLLM's /tokenize, /detokenize and /tokenizer_info, /version, /health and /metrics
(Prometheus, vLLM's names under the prefix specjax:); docs/serving.md lists the fields. --speculative-config
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
        **(
            {}
            if args.prefill_chunk is None
            else {"prefill_chunk": None if args.prefill_chunk == -1 else args.prefill_chunk}
        ),
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        role=args.role,
        prefill_url=args.prefill_url,
        lockstep_address=distributed(args),
        max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
        constraint_states=None if args.constraint_states == -1 else args.constraint_states,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        metrics_prefix=args.metrics_prefix,
        precompile=None if args.precompile == -1 else args.precompile,
        api_key=args.api_key,
        protect_monitoring=args.protect_monitoring,
        allowed_origins=args.allowed_origins or (),
        max_request_bytes=args.max_request_bytes,
    )


def distributed(args: argparse.Namespace) -> str | None:
    """With --coordinator-address: JAX's distributed runtime started (every process runs the same
    command, each with its --process-id), and the address where process 0 leads the engines:
    the coordinator's host, --lockstep-port (default the coordinator's port + 1)."""
    if args.coordinator_address is None:
        if args.num_processes is not None or args.process_id is not None:
            raise ValueError("--num-processes and --process-id go with --coordinator-address")
        return None
    if args.num_processes is None or args.process_id is None:
        raise ValueError("--coordinator-address needs --num-processes and --process-id")
    import jax

    # CPU devices' collectives across processes (GPUs' go through NCCL, TPUs' their own links);
    # set before the runtime starts, which asking for the devices would do
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
    host, _, port = args.coordinator_address.rpartition(":")
    return f"{host}:{args.lockstep_port or int(port) + 1}"


def memory_amount(text: str) -> int | float:
    """--kv-cache-memory: bytes (an integer >= 1) or a fraction in (0, 1]."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = 0
    if (isinstance(value, int) and value < 1) or (isinstance(value, float) and not 0 < value <= 1):
        raise argparse.ArgumentTypeError(
            f"must be bytes (an integer >= 1) or a fraction of the free memory in (0, 1], got {text!r}"
        )
    return value


def chunk_option(value: int | None) -> dict:
    """--prefill-chunk as serve's keyword: none given (the engine's default), -1 (None: one pass)
    or the chunk."""
    if value is None:
        return {}
    return {"prefill_chunk": None if value == -1 else value}


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
        "--prefill-chunk",
        type=tokens_or_off,
        help="prompts longer than this are prefilled in chunks of it (a multiple of 16), one chunk per "
        "step between the running requests' steps (default: EngineConfig.prefill_chunk, 128 tokens; "
        "-1: each prompt in one pass while the others wait)",
    )
    command.add_argument(
        "--page-size",
        type=positive_int,
        help="the KV cache in pages of this many token slots (a power of two, at least 16), one pool "
        "the requests share as their lengths need, the newest preempted when it runs out (default: "
        "a dense row of --max-model-len tokens per slot)",
    )
    pool = command.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-pages",
        type=positive_int,
        help="with --page-size: the pool's pages (default: enough for every slot's --max-model-len)",
    )
    pool.add_argument(
        "--kv-cache-memory",
        type=memory_amount,
        metavar="BYTES|FRACTION",
        help="with --page-size: the pool's bytes (an integer), or a fraction in (0, 1] of the free "
        "memory at start (e.g. 0.5)",
    )
    command.add_argument(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        action="store_true",
        help="with --page-size: prefill every prompt whole (default: prompts that begin with pages "
        "another request computed take them, and prefill only the rest)",
    )
    command.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="devices each layer is split over (its heads and MLP; default 1)",
    )
    command.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        help="groups of --tensor-parallel-size devices the slots are split over (--max-batch a "
        "multiple of it; default 1)",
    )
    command.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="both (default): prefill and decode here; prefill: serve only rows (POST "
        "/specjax/prefill) to a decode server; decode: serve the API, each request's row pulled "
        "from --prefill-url (both started with the same model, proposer and engine options)",
    )
    command.add_argument(
        "--prefill-url", help="with --role decode: the prefill server, e.g. http://host:8001"
    )
    command.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        help="one engine over several processes (hosts): every process runs this command with the "
        "same arguments and its own --process-id; process 0 (at HOST) serves HTTP and leads",
    )
    command.add_argument("--num-processes", type=positive_int, help="with --coordinator-address")
    command.add_argument("--process-id", type=int, help="with --coordinator-address: 0 .. N-1")
    command.add_argument(
        "--lockstep-port",
        type=positive_int,
        help="with --coordinator-address: where process 0 leads the others' engines (default: the "
        "coordinator's port + 1)",
    )
    command.add_argument(
        "--max-logprobs",
        type=tokens_or_off,
        default=DEFAULT_MAX_LOGPROBS,
        help="the most alternatives per token that logprobs, top_logprobs and prompt_logprobs may ask "
        f"for (default {DEFAULT_MAX_LOGPROBS}, vLLM's; -1: no logprobs, and the loop never computes them)",
    )
    command.add_argument(
        "--constraint-states",
        type=tokens_or_off,
        default=DEFAULT_CONSTRAINT_STATES,
        help="the states the constraint automata of response_format, tools and structured_outputs "
        f"share (default {DEFAULT_CONSTRAINT_STATES}; -1: constraints refused, the loop carries no tables)",
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
    command.add_argument(
        "--api-key",
        help="requests must send 'Authorization: Bearer KEY' (else HTTP 401); default: the environment "
        "variable SPECJAX_API_KEY, unset: no key",
    )
    command.add_argument(
        "--protect-monitoring",
        action="store_true",
        help="/health and /metrics need the API key too (default: open, for probes and Prometheus)",
    )
    command.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="origins a browser may call the server from (CORS), e.g. http://localhost:3000, or '*'",
    )
    command.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=8 * 1024 * 1024,
        help="the largest request body; a larger one gets HTTP 413 before it is read (default 8 MiB)",
    )
    command.set_defaults(run=serve_command)
