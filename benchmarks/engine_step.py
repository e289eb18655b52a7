"""The serving engine driven directly, without HTTP: milliseconds per decoding step of its chunks
by chunk width and max_model_len (what a chunk narrower than the engine's batch costs:
docs/serving.md, "What a narrower chunk costs"), and with --clients, the throughput of a closed
loop of clients over Spec-Bench prompts.

    .venv/bin/python benchmarks/engine_step.py [--max-model-len 2048 256] [--widths 8 16 8]
    .venv/bin/python benchmarks/engine_step.py --max-model-len 512 --widths 1 8 1 --constraint-states -1 4096
    .venv/bin/python benchmarks/engine_step.py --max-model-len 2048 512 --clients 1 8 16 \
        --data ../shared/data --categories mt_bench,qa,math_reasoning,translation --per-category 4

An Engine of --max-batch slots (plain decoding, the built-in model, greedy) is given `width`
requests of one short chat prompt at once, so they occupy the first `width` slots and every chunk
runs at that width; after the first chunk (admissions, compilation) --chunks chunks are timed,
and the time is divided by their steps (`Engine.stats`: --chunk-steps each when the width fills
the engine, --admission-steps while slots are free). The first width is timed again last, as a
check on the machine's drift. --constraint-states: engines with constraint tables of that many
states (-1: none; `specjax serve`'s default is 4096), each timed at each width in turn, to show what
the tables cost requests that use no constraint.

--clients: N clients in a closed loop over the prompts (each chat-templated), each sending its
next request the moment its last one finishes (between two engine steps: no HTTP, no client
latency); plain decoding, greedy, --max-new-tokens; tokens/s of wall time after a warm-up at
every level, the same measure as benchmarks/serving.py's, and where the time went
(`Engine.stats`): the admissions' prefills, and the loop's steps by chunk width with the time of
each.
"""

from __future__ import annotations

import argparse
import time

from common import data_dir, machine, markdown_table

import specjax
from specjax.bench import spec_bench_prompts
from specjax.serve import Engine
from specjax.serve.engine_config import Request

PROMPT = [{"role": "user", "content": "Write a long story about a river town and its boats."}]


def closed_loop(engine, prompts, clients: int, max_new_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of `clients` clients in a closed loop over `prompts` (token ids)."""
    queue, tokens = list(prompts), 0
    start = time.perf_counter()
    for _ in range(min(clients, len(queue))):
        engine.add(Request(queue.pop(0), max_new_tokens=max_new_tokens))
    while engine.has_work:
        for update in engine.step():
            tokens += len(update.tokens)
            if update.finished and queue:
                engine.add(Request(queue.pop(0), max_new_tokens=max_new_tokens))
    return tokens, time.perf_counter() - start


def plain_engine(model, args, max_len: int, constraint_states: int = -1) -> Engine:
    """An engine of the built-in model, plain decoding, with the command line's batch and chunks
    (and constraint tables of `constraint_states` states; -1: none)."""
    return Engine(
        model,
        None,
        max_batch=args.max_batch,
        max_model_len=max_len,
        chunk_steps=args.chunk_steps,
        admission_steps=args.admission_steps,
        constraint_states=None if constraint_states < 0 else constraint_states,
    )


def closed_loops(model, args) -> list[list]:
    categories = args.categories.split(",") if args.categories else None
    texts = [p for _, p in spec_bench_prompts(data_dir(args.data), args.per_category, categories)]
    prompts = [specjax.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": t}]) for t in texts]
    rows = []
    for max_len in args.max_model_len:
        engine = plain_engine(model, args, max_len)
        engine.precompile([len(p) for p in prompts])  # no program compiles inside a timed loop
        for clients in sorted({args.max_batch, *args.clients}, reverse=True):
            closed_loop(engine, prompts, clients, 8)  # warm-up
        alone = None
        for clients in args.clients:
            engine.stats.reset()
            tokens, seconds = closed_loop(engine, prompts, clients, args.max_new_tokens)
            rate = tokens / seconds
            alone = rate if clients == 1 else alone
            stats = engine.stats
            by_width = ", ".join(
                f"{w}: {stats.steps[w]} x {stats.ms_per_step(w):.1f} ms" for w in sorted(stats.steps)
            )
            rows.append(
                [max_len, clients, tokens, seconds, rate, rate / alone if alone else "-"]
                + [stats.admission_s, by_width]
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[2048, 256])
    parser.add_argument("--widths", type=int, nargs="+", default=[8, 16, 8])
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--chunk-steps", type=int, default=16)
    parser.add_argument("--admission-steps", type=int, help="steps per chunk while a slot is free")
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="+", help="time closed loops of this many clients")
    parser.add_argument("--data", help="folder with spec_bench_question.jsonl (default: $SPECJAX_DATA)")
    parser.add_argument("--categories", help="comma-separated Spec-Bench categories (default: all)")
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--constraint-states", type=int, nargs="+", default=[-1], help="engines' constraint tables (-1: none)"
    )
    args = parser.parse_args()
    model = specjax.load("smollm2-135m")
    if args.clients:
        rows = closed_loops(model, args)
        print(f"\nmachine: {machine()}\n")
        header = ["max_model_len", "clients", "tokens", "seconds", "tokens/s", "x one client"]
        header += ["admissions (s)", "steps by width (count x ms per step)"]
        print(markdown_table(header, rows))
        return
    prompt = specjax.chat_prompt_ids(model.tokenizer, PROMPT)
    new_tokens = args.chunk_steps * (args.chunks + 2)
    rows = []
    for max_len in args.max_model_len:
        engines = {states: plain_engine(model, args, max_len, states) for states in args.constraint_states}
        for width in args.widths:
            for states, engine in engines.items():  # (in turn at each width: the drift falls on all)
                for _ in range(width):
                    engine.add(Request(prompt, max_new_tokens=new_tokens))
                engine.step()  # admissions, compilation and the first chunk
                engine.stats.reset()
                for _ in range(args.chunks):
                    engine.step()
                ms = engine.stats.ms_per_step(width)
                rows.append([max_len, args.max_batch, width, "none" if states < 0 else states, ms])
                print(rows[-1], flush=True)
                while engine.has_work:
                    engine.step()
    print(f"\nmachine: {machine()}\n")
    print(markdown_table(["max_model_len", "max_batch", "width", "constraint states", "ms per step"], rows))


if __name__ == "__main__":
    main()
