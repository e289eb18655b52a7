"""Inter-token latency of running requests while long prompts arrive, the engine driven directly
(no HTTP): each prompt in one pass while the running rows wait (`--prefill-chunk -1`, the engine
before chunks) against long prompts in chunks of C tokens, one chunk per engine step between the
running rows' chunks (EngineConfig.prefill_chunk).

    .venv/bin/python benchmarks/long_prompts.py [--chunks -1 64 128 256] [--long-tokens 2000] \
        [--long-prompts 2] [--rounds 2] [--data ../shared/data]

Per round and method: --streams short chat requests (greedy, EOS ignored) run on an engine of the
built-in model; once they decode, --long-prompts prompts of --long-tokens tokens (Spec-Bench
questions joined until they are long enough, chat-templated) arrive one after another, each as the
previous one is admitted. The streams' tokens arriving in that window are timed: an engine step
that brings m tokens of a stream after a gap of t seconds counts m inter-token latencies of t / m
(tokens that come together share their wait). Reported: p50 and p99 of those latencies, the
longest gap, the long prompts' time to first token, and the streams' tokens/s in the window. The
methods run in interleaved rounds in one process (this machine's speed drifts): compare ratios.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import data_dir, machine, markdown_table

import specjax
from specjax.bench import spec_bench_prompts
from specjax.serve import Engine
from specjax.serve.engine_config import Request

STREAM = [{"role": "user", "content": "Write a long story about a river town and its boats."}]


def long_prompts(model, folder, tokens: int, count: int) -> list[list[int]]:
    """`count` chat prompts of `tokens` tokens: Spec-Bench questions joined, cut to length."""
    texts = [text for _, text in spec_bench_prompts(folder, 10)]
    prompts = []
    for i in range(count):
        joined, j = "", i
        while len(model.tokenizer.encode(joined)) < tokens:
            joined += texts[j % len(texts)] + "\n\n"
            j += count
        ids = specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": joined}])
        prompts.append(ids[:tokens])
    return prompts


def one_round(engine: Engine, stream_prompt, prompts, streams: int) -> dict:
    """The streams' inter-token latencies while `prompts` arrive one after another."""
    ids = [
        engine.add(
            Request(stream_prompt, max_new_tokens=engine.max_model_len - len(stream_prompt), ignore_eos=True)
        )
        for _ in range(streams)
    ]
    while engine.num_waiting:  # the streams are admitted and decoding
        engine.step()
    engine.step()
    last = dict.fromkeys(ids, time.perf_counter())
    gaps, longest, firsts, made = [], 0.0, [], 0
    start = time.perf_counter()
    for prompt in prompts:
        arrived = time.perf_counter()
        long_id = engine.add(Request(prompt, max_new_tokens=4, ignore_eos=True))
        while True:
            updates = engine.step()
            now = time.perf_counter()
            for update in updates:
                if update.request_id in last and update.tokens:
                    gap, m = now - last[update.request_id], len(update.tokens)
                    gaps += [gap / m] * m
                    longest, made = max(longest, gap), made + m
                    last[update.request_id] = now
            if any(u.request_id == long_id and u.tokens for u in updates):
                firsts.append(now - arrived)
                break
    seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work:  # the last long prompt's few tokens
        engine.step()
    return {
        "p50": float(np.percentile(gaps, 50)),
        "p99": float(np.percentile(gaps, 99)),
        "longest": longest,
        "ttft": float(np.mean(firsts)),
        "rate": made / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[-1, 64, 128, 256])
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--long-prompts", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--data", help="folder with spec_bench_question.jsonl (default: $SPECJAX_DATA)")
    args = parser.parse_args()
    if args.streams >= args.max_batch:
        parser.error(
            f"--streams {args.streams} leaves no slot of --max-batch {args.max_batch} for a long prompt"
        )
    model = specjax.load("smollm2-135m")
    stream_prompt = specjax.chat_prompt_ids(model.tokenizer, STREAM)
    prompts = long_prompts(model, data_dir(args.data), args.long_tokens, args.long_prompts)
    engines = {}
    for chunk in args.chunks:
        start = time.perf_counter()
        engine = Engine(
            model,
            None,
            max_batch=args.max_batch,
            max_model_len=args.max_model_len,
            prefill_chunk=None if chunk == -1 else chunk,
        )
        engine.precompile([len(stream_prompt), *map(len, prompts)])
        one_round(engine, stream_prompt, prompts[:1], args.streams)  # warm-up
        engines[chunk] = engine
        print(f"prefill_chunk {chunk}: ready in {time.perf_counter() - start:.0f} s", flush=True)
    results = {chunk: [] for chunk in args.chunks}
    for r in range(args.rounds):
        for chunk, engine in engines.items():
            results[chunk].append(one_round(engine, stream_prompt, prompts, args.streams))
            print(r, chunk, results[chunk][-1], flush=True)
    base = args.chunks[0]
    rows = []
    for chunk in args.chunks:
        mean = {key: float(np.mean([x[key] for x in results[chunk]])) for key in results[chunk][0]}
        ratio = mean["p99"] / mean["p50"]
        rows.append(
            ["one pass" if chunk == -1 else chunk, 1e3 * mean["p50"], 1e3 * mean["p99"], ratio]
            + [
                1e3 * mean["longest"],
                mean["ttft"],
                mean["rate"],
                mean["rate"] / np.mean([x["rate"] for x in results[base]]),
            ]
        )
    print(f"\nmachine: {machine()}\n")
    header = ["prefill_chunk", "ITL p50 (ms)", "ITL p99 (ms)", "p99 / p50", "longest gap (ms)"]
    header += ["long prompt TTFT (s)", "streams' tokens/s", "x first method"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
