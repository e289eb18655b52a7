"""Serving under load: throughput and latency of `specjax serve` against the number of clients.

    .venv/bin/python benchmarks/serving.py [--clients 1 2 4 8 16] [--modes plain ngram dynamic]
        [--per-category 2] [--requests-per-client 4] [--max-new-tokens 128] [--max-batch 16]
        [--chunk-steps 16] [--admission-steps 4]
        [--llama-cpp-url http://127.0.0.1:8080/v1]

The built-in model is served in this process (the FastAPI app of specjax/serve on uvicorn, on a
free localhost port) with max_batch slots; for each level of offered load, N clients (the
official `openai` async client) each take the next Spec-Bench prompt from one shared list and send
it as a streamed chat completion (greedy, max_new_tokens, the prompt's first turn), then the
next, until the list is done: a closed loop of N requests in flight. The list goes round as many
whole times as it takes for each client to send at least `--requests-per-client` requests (so every
level sends each prompt equally often): with one or two requests a client, the run's end, where
fewer than N requests are left in flight, weighs as much as the load itself (docs/benchmarks.md,
run 17). Per level: output tokens per
second of wall time (all requests), time to first token and inter-token latency (the gaps between
a request's streamed chunks over the tokens they carried), p50 and p99, and the drafts accepted.

Modes: plain decoding; NGram(k=5, n_min=3) (prompt lookup); Dynamic(NGram(k=5, n_min=3)) with a
GoodputSchedule whose verify costs were measured on this machine at 1, 2, 4, ... rows up to all
the slots (`verify_cost_by_rows`: it drafts less as rows join). `Engine.precompile` compiles the
programs (the admission of each prompt's bucket, the loop at every width, as `specjax serve`
does before it listens) and one short pass at each level warms the HTTP side before the timed
levels: a program compiled inside a timed level stalls every request running beside it.
Every mode's engine and server are up at once, and the runs go in turn: for each repeat, each
level, each mode, so that the machine's drift falls on all alike. With --repeats R each level
runs R times per mode: the throughput is the median of the R runs, the latencies are over all of
their requests.

`--llama-cpp-url` points the same clients at a llama.cpp server (`python -m llama_cpp.server
--model F32.gguf --n_threads 2 --n_ctx 2048` in its own venv, see ../shared/CPU_PERFORMANCE.md
for building llama-cpp-python) for a side-by-side row; it applies its own chat template.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import socket
import threading
import time

import numpy as np
from common import data_dir

import specjax
from specjax.bench import SPEC_BENCH_CATEGORIES, machine, markdown_table, spec_bench_prompts

MODES = ("plain", "ngram", "dynamic")


def proposer_for(mode: str, model, prompts, max_batch: int, kernels: str):
    if mode == "plain":
        return None
    ngram = specjax.NGram(k=5, n_min=3)
    if mode == "ngram":
        return ngram
    # The verify cost at each width the engine runs (1, 2, 4, ... max_batch): the schedule turns
    # drafting down as rows join. (Interpolated from 1, 8 and 16 rows, the cost at 4 rows came out
    # half the one measured there, and Dynamic drafted at 4 clients where it did not pay.)
    sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length())} | {max_batch})
    schedule = specjax.GoodputSchedule.measure(
        model, ngram, prompts[:4], max_new_tokens=32, batch_sizes=sizes, generate_options={"kernels": kernels}
    )
    costs = schedule.verify_cost_by_rows
    print(f"  goodput schedule: draft_cost {schedule.draft_cost:.3f}, verify costs by rows {costs}")
    return specjax.Dynamic(ngram, schedule)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The app on uvicorn in a background thread, for the duration of a `with`. `max_clients`:
    the most requests in flight, all let wait (a closed loop offers no more than that)."""

    def __init__(self, engine, max_clients: int):
        import uvicorn

        from specjax.serve import make_app

        self.port = free_port()
        app = make_app(engine, max_waiting=max_clients)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join()


async def one_request(client, model_name: str, prompt: str, max_new_tokens: int) -> dict:
    """A streamed chat completion: its chunk arrival times and token counts."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_new_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    arrivals, tokens = [], 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    # llama-cpp-python's server sends no usage when streaming, and one token per chunk.
    tokens = tokens or len(arrivals)
    return {"start": start, "arrivals": arrivals, "tokens": tokens, "end": time.perf_counter()}


async def offered_load(
    url: str, model_name: str, prompts: list[str], clients: int, max_new_tokens: int, per_client: int = 1
):
    """N clients in a closed loop over the prompts, the list as many whole times as it takes for
    `per_client` requests a client; returns the per-request records and wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=3600, max_retries=0)
    queue = list(prompts) * math.ceil(per_client * clients / len(prompts))
    records = []

    async def worker():
        while queue:
            prompt = queue.pop(0)
            records.append(await one_request(client, model_name, prompt, max_new_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return records, wall


def summarize(records: list[dict], wall: float | None) -> dict:
    """Throughput (tokens/s of `wall` seconds; None: not asked) and latencies of `records`."""
    tokens = sum(r["tokens"] for r in records)
    ttft = [r["arrivals"][0] - r["start"] for r in records if r["arrivals"]]
    # Inter-token latency: each gap between two streamed chunks, spread over the tokens the later
    # chunk carried (a chunk of the loop carries several tokens), weighted by them.
    itl = []
    for r in records:
        if len(r["arrivals"]) > 1 and r["tokens"] > 1:
            per_token = (r["arrivals"][-1] - r["arrivals"][0]) / (r["tokens"] - 1)
            itl.append(per_token)
    return {
        "tokens/s": None if wall is None else tokens / wall,
        "ttft p50": _percentile(ttft, 50),
        "ttft p99": _percentile(ttft, 99),
        "itl p50 (ms)": 1000 * _percentile(itl, 50),
        "itl p99 (ms)": 1000 * _percentile(itl, 99),
        "requests": len(records),
        "tokens": tokens,
    }


def _percentile(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", help="folder with spec_bench_question.jsonl (default: $SPECJAX_DATA)")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument(
        "--requests-per-client", type=int, default=4, help="at least this many (whole rounds of the prompts)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--chunk-steps", type=int, default=16)
    parser.add_argument("--admission-steps", type=int, help="steps per chunk while a slot is free")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--categories", help="comma-separated Spec-Bench categories (default: all)")
    parser.add_argument("--kernels", default="auto", help="the engine's kernels: auto or xla (generate's)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each level (median throughput)")
    parser.add_argument("--llama-cpp-url", help="a llama.cpp server's /v1 URL, for a side-by-side row")
    args = parser.parse_args()
    if args.requests_per_client < 1:
        parser.error(f"--requests-per-client must be at least 1, got {args.requests_per_client}")
    per_client = args.requests_per_client

    categories = SPEC_BENCH_CATEGORIES if args.categories is None else args.categories.split(",")
    prompts = [p for _, p in spec_bench_prompts(data_dir(args.data), args.per_category, categories)]
    model = specjax.load("smollm2-135m")
    print(
        f"machine: {machine()}\n{len(prompts)} Spec-Bench prompts, {args.max_new_tokens} new tokens, greedy"
    )
    header = [
        "server",
        "mode",
        "clients",
        "tokens/s",
        "ttft p50 (s)",
        "ttft p99 (s)",
        "itl p50 (ms)",
        "itl p99 (ms)",
    ]
    rows = []
    from specjax.serve import Engine

    chat_ids = [specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    engines = {}
    for mode in args.modes:
        engines[mode] = Engine(
            model,
            proposer_for(mode, model, chat_ids, args.max_batch, args.kernels),
            max_batch=args.max_batch,
            max_model_len=args.max_model_len,
            chunk_steps=args.chunk_steps,
            admission_steps=args.admission_steps,
            kernels=args.kernels,
        )
        start = time.perf_counter()
        compiled = engines[mode].precompile([len(ids) for ids in chat_ids])
        print(f"  {mode}: {compiled} programs compiled in {time.perf_counter() - start:.0f} s", flush=True)
    ready = {mode: engine.num_compiles for mode, engine in engines.items()}
    with contextlib.ExitStack() as stack:
        servers = {mode: stack.enter_context(Server(e, max(args.clients))) for mode, e in engines.items()}
        for server in servers.values():  # the HTTP side
            for clients in sorted({args.max_batch, *args.clients}, reverse=True):
                asyncio.run(offered_load(server.url, model.name, prompts, clients, 8))
        # Modes in turn within each level, levels in turn within each repeat: the machine's drift
        # falls on every mode and level alike (modes run one after another in earlier runs).
        runs = {(mode, clients): [] for mode in args.modes for clients in args.clients}
        for repeat in range(args.repeats):
            for clients in args.clients:
                for mode, server in servers.items():
                    engines[mode].stats.reset()
                    load = offered_load(
                        server.url, model.name, prompts, clients, args.max_new_tokens, per_client
                    )
                    records, wall = asyncio.run(load)
                    runs[mode, clients].append((records, wall))
                    rate = summarize(records, wall)["tokens/s"]
                    stats = engines[mode].stats  # where the engine's time went
                    print(
                        f"  {mode}, {clients} clients, run {repeat + 1}: {len(records)} requests, "
                        f"{rate:.2f} tokens/s "
                        f"(admissions {stats.admission_s:.2f} s; steps {stats.summary()})",
                        flush=True,
                    )
    for (mode, clients), done in runs.items():
        s = summarize([r for records, _ in done for r in records], None)
        rate = float(np.median([summarize(records, wall)["tokens/s"] for records, wall in done]))
        row = ["specjax", mode, clients, rate, s["ttft p50"], s["ttft p99"]]
        rows.append(row + [s["itl p50 (ms)"], s["itl p99 (ms)"]])
        print(markdown_table(header, [rows[-1]]).splitlines()[-1], flush=True)
    for mode, engine in engines.items():
        assert engine.num_compiles == ready[mode], f"{mode}: a program compiled while serving"
    if args.llama_cpp_url:
        for clients in args.clients:
            load = offered_load(
                args.llama_cpp_url, "model", prompts, clients, args.max_new_tokens, per_client
            )
            records, wall = asyncio.run(load)
            s = summarize(records, wall)
            row = ["llama.cpp", "plain", clients, s["tokens/s"], s["ttft p50"], s["ttft p99"]]
            rows.append(row + [s["itl p50 (ms)"], s["itl p99 (ms)"]])
            print(markdown_table(header, [rows[-1]]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(header, rows))
    by = {(r[0], r[1], r[2]): r[3] for r in rows}
    for (server, mode, clients), rate in by.items():
        alone = by.get((server, mode, 1))
        if clients > 1 and alone:
            print(f"{server} {mode}: {clients} clients at {rate / alone:.2f}x the throughput of one")


if __name__ == "__main__":
    main()
