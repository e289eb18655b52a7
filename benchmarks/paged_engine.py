"""The serving engine on pages against its dense rows: a shared system prompt, and what the KV
cache holds at start; with --vllm, vLLM's CPU build on the same requests.

    .venv/bin/python benchmarks/paged_engine.py [--requests 12] [--max-batch 4] [--system-tokens 600]
        [--max-new-tokens 64] [--rounds 2] [--page-size 128] [--data ../shared/data]

The built-in model, plain decoding (or --proposer ngram), greedy, driven directly (no HTTP).
Every request is a chat of one system message (a long shared document: Spec-Bench's questions
joined until --system-tokens tokens) and one user message (a Spec-Bench question, a different one
each), all added at once to an engine of --max-batch slots, so admissions run while other rows
decode (a closed queue). Three engines, built and warmed up once each, run the same requests in
turn, round after round (the machine's drift falls on all alike):

- dense: a row of max_model_len slots per slot (EngineConfig's default);
- pages: a pool of pages (--page-size slots each), prefix caching off: every prompt prefilled whole;
- pages+prefix: the same pool, prefix caching on: the shared document's pages are computed once
  and every later request prefills only its own question.

Per engine: output tokens per second of wall time, time to first token (mean and max, from the
requests' common start), the seconds the admissions took (`EngineStats.admission_s`), and the
prompt tokens the prefix cache found. The tokens of every engine are checked equal. Then, per
engine, what its KV cache holds (`Engine.cache_summary`) and the process's resident memory added
by building it.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import numpy as np
from common import data_dir, machine, markdown_table

import specjax
from specjax.bench import SPEC_BENCH_CATEGORIES, spec_bench_prompts
from specjax.serve import Engine
from specjax.serve.engine_config import Request


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def requests_for(model, questions: list[str], system_tokens: int, count: int, max_new_tokens: int):
    """`count` chats sharing one system message of about `system_tokens` tokens."""
    tokenizer = model.tokenizer
    document, i = "", 0
    while len(tokenizer.encode(document)) < system_tokens:
        document += questions[i % len(questions)] + "\n"
        i += 1
    system = "Answer the question using this document.\n" + document
    asked = questions[i : i + count] if len(questions) >= i + count else questions[:count]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in asked]
    prompts = [specjax.chat_prompt_ids(tokenizer, chat) for chat in chats]
    return [Request(p, max_new_tokens=max_new_tokens) for p in prompts]


def run(engine: Engine, requests: list[Request]) -> dict:
    """All requests at once; tokens by request, first-token times, wall time, where it went."""
    engine.stats.reset()
    queries, hits = engine.kv_cache.prefix_counts
    compiles = engine.num_compiles
    start = time.perf_counter()
    ids = [engine.add(r) for r in requests]
    tokens = {i: [] for i in ids}
    first = {}
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id] += update.tokens
            if update.tokens and update.request_id not in first:
                first[update.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    now_queries, now_hits = engine.kv_cache.prefix_counts
    return {
        "tokens": [tokens[i] for i in ids],
        "wall": wall,
        "ttft": [first[i] for i in ids],
        "admission_s": engine.stats.admission_s,
        "hits": now_hits - hits,
        "queries": now_queries - queries,
        "preemptions": engine.stats.preemptions,
        "compiled": engine.num_compiles - compiles,
        "steps": sum(engine.stats.steps.values()),
        "chunks": engine.stats.prompt_chunks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", help="folder with spec_bench_question.jsonl")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--proposer", choices=("plain", "ngram"), default="plain")
    parser.add_argument(
        "--vllm",
        metavar="PYTHON",
        help="also vLLM's CPU build (the python of its venv: benchmarks/vllm_worker.py), prefix caching "
        "off and on, --max-batch sequences at once, the same token ids, in the same rounds",
    )
    args = parser.parse_args()

    model = specjax.load("smollm2-135m")
    questions = [text for _, text in spec_bench_prompts(data_dir(args.data), 10, SPEC_BENCH_CATEGORIES)]
    requests = requests_for(model, questions, args.system_tokens, args.requests, args.max_new_tokens)
    longest = max(len(r.prompt) for r in requests)
    max_model_len = -(-(longest + args.max_new_tokens + 16) // 128) * 128
    proposer = None if args.proposer == "plain" else specjax.NGram(k=5, n_min=3)
    common = dict(max_batch=args.max_batch, max_model_len=max_model_len, chunk_steps=16)
    layouts = {
        "dense": {},
        "pages": dict(page_size=args.page_size, prefix_caching=False),
        "pages+prefix": dict(page_size=args.page_size),
    }
    engines, memory = {}, {}
    for name, options in layouts.items():
        gc.collect()
        before = resident_bytes()
        engine = Engine(model, proposer, **common, **options)
        memory[name] = (engine.kv_cache.summary(), resident_bytes() - before)
        engine.precompile(sorted({len(r.prompt) for r in requests}))
        run(engine, requests[:2])  # warm-up: every program the timed rounds run
        engines[name] = engine

    peers = {}
    if args.vllm:
        from vllm_peer import DEFAULT_FOLDER, VLLM, hf_folder

        folder = hf_folder(model, Path(DEFAULT_FOLDER))
        for name, caching in (("vllm", False), ("vllm+prefix", True)):
            peer = VLLM(
                args.vllm,
                folder,
                max_model_len=max_model_len,
                prefix_caching=caching,
                max_num_seqs=args.max_batch,
            )
            peer.generate_batch([r.prompt for r in requests[:2]], args.max_new_tokens)  # warm-up
            peers[name] = peer

    print(f"# {machine()}")
    print(
        f"# {len(requests)} requests, prompts of {min(len(r.prompt) for r in requests)}-{longest} tokens "
        f"(a shared system message of >= {args.system_tokens}), {args.max_new_tokens} new tokens, "
        f"{args.max_batch} slots, max_model_len {max_model_len}, {args.proposer}, {args.rounds} rounds"
    )
    results = {name: [] for name in engines}
    vllm_runs: dict[str, list] = {}
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            engine.kv_cache.reset_prefix_cache()  # each round from an empty cache: the first request misses
            result = run(engine, requests)
            results[name].append(result)
            print(
                f"round {round_}: {name} {result['wall']:.1f} s, {result['steps']} steps, "
                f"{result['chunks']} prompt chunks, {result['compiled']} programs compiled"
            )
        for name, peer in peers.items():  # (one LLM.generate call of every request: its own queue)
            batch = [r.prompt for r in requests]
            tokens, seconds = peer.generate_batch(batch, args.max_new_tokens, reset_prefix_cache=True)
            vllm_runs.setdefault(name, []).append((tokens, seconds))
            print(f"round {round_}: {name} {seconds:.1f} s")
    reference = results["dense"][0]["tokens"]
    for name, runs in results.items():
        for result in runs:
            assert result["tokens"] == reference, f"{name}: tokens differ from the dense engine's"
    rows = []
    for name, runs in results.items():
        generated = sum(len(t) for t in runs[0]["tokens"])
        rates = [generated / r["wall"] for r in runs]
        ttft = np.concatenate([r["ttft"] for r in runs])
        rows.append(
            [
                name,
                " / ".join(f"{x:.1f}" for x in rates),
                f"{ttft.mean():.2f}",
                f"{ttft.max():.2f}",
                " / ".join(f"{r['admission_s']:.1f}" for r in runs),
                f"{runs[0]['hits']:,} of {runs[0]['queries']:,}",
                runs[0]["preemptions"],
            ]
        )
    for name, runs in vllm_runs.items():
        generated = sum(len(t) for t in runs[0][0])
        same = sum(t == ours for t, ours in zip(runs[0][0], reference, strict=True))
        rates = " / ".join(f"{generated / seconds:.1f}" for _, seconds in runs)
        rows.append([name, rates, "-", "-", "-", f"greedy = ours on {same}/{len(reference)}", "-"])
    for peer in peers.values():
        peer.close()
    header = [
        "engine",
        "tok/s (rounds)",
        "TTFT mean s",
        "TTFT max s",
        "admissions s",
        "cache hits",
        "preempted",
    ]
    print(markdown_table(header, rows))
    print("greedy tokens equal across the three engines")
    print(
        markdown_table(
            ["engine", "KV cache", "resident memory added"],
            [[name, summary, f"{added / (1 << 30):.2f} GiB"] for name, (summary, added) in memory.items()],
        )
    )


if __name__ == "__main__":
    main()
