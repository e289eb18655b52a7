"""Prefill and decode apart: what handing a prefilled row over costs, per token of prompt.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python benchmarks/disaggregation.py \
        [--lengths 128 512 1024] [--rounds 3] [--proposer ngram]

The built-in model. A prefill engine on fake device 0 and a decode engine on device 1, each a mesh
of one (SmolLM2-135M's 3 kv heads do not split over 2; tests/test_handoff.py splits tiny models).
Per prompt length, in
interleaved rounds (the machine's drift falls on all alike): the prefill itself
(`Engine.prefill`), the move between the meshes in one process (`jax.device_put` onto the decode
engine's row shardings: `EngineBatch.placed_row`), and the host path between processes (the row
to bytes, `encode_row`, and back, `decode_row`, then placed; the HTTP hop itself not counted),
sending the filled slots only (`Engine.prefill_bytes`: the prompt's and the first token's) and,
for comparison, the whole row (a max_model_len cache whatever the prompt's length). Medians; per
token of prompt; the bytes sent. On this CPU all fake devices share two cores and one memory, so
these times say what the copies cost, not what a link between two accelerators would: only
correctness of the split is shown here (tests/test_handoff.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from common import machine, markdown_table

import specjax
from specjax import sharding
from specjax.serve import Engine, Request
from specjax.serve.handoff import decode_row, encode_row  # (what Engine.prefill_bytes sends)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--proposer", choices=("none", "ngram"), default="ngram")
    args = parser.parse_args()
    if jax.device_count() < 2:
        raise SystemExit("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    model = specjax.load("smollm2-135m")
    proposer = specjax.NGram(k=4) if args.proposer == "ngram" else None
    options = dict(max_batch=2, max_model_len=max(args.lengths) + 64, prefill_chunk=None)
    prefill_mesh = sharding.make_mesh(model=1, data=1, devices=jax.devices()[:1])
    decode_mesh = sharding.make_mesh(model=1, data=1, devices=jax.devices()[1:2])
    prefill = Engine(model, proposer, mesh=prefill_mesh, **options)
    decode = Engine(model, proposer, mesh=decode_mesh, **options)
    like = decode._batch.free_row
    times: dict[tuple[int, str], list[float]] = {}
    sizes = {}
    for round_ in range(args.rounds + 1):  # round 0 compiles
        for n in args.lengths:
            request = Request(list(range(10, 10 + n)), max_new_tokens=32)
            start = time.perf_counter()
            row = jax.block_until_ready(prefill.prefill(request))
            made = time.perf_counter()
            jax.block_until_ready(decode._batch.placed_row(row))
            moved = time.perf_counter()
            data = encode_row(row, prefill._batch.slot_axes(), n + 1)  # (as Engine.prefill_bytes)
            jax.block_until_ready(decode._batch.placed_row(decode_row(data, like)))
            hosted = time.perf_counter()
            whole = encode_row(row)
            jax.block_until_ready(decode._batch.placed_row(decode_row(whole, like)))
            hosted_whole = time.perf_counter()
            sizes[n] = (len(data), len(whole))
            if round_:
                for name, seconds in (
                    ("prefill", made - start),
                    ("device_put", moved - made),
                    ("host", hosted - moved),
                    ("host_whole", hosted_whole - hosted),
                ):
                    times.setdefault((n, name), []).append(seconds)
    rows = []
    names = ("prefill", "device_put", "host", "host_whole")
    for n in args.lengths:
        median = {name: statistics.median(times[(n, name)]) for name in names}
        per_token = {
            name: f"{median[name] * 1e3:.2f} ({median[name] / n * 1e6:.1f} us/token)" for name in names
        }
        sent, whole = sizes[n]
        rows.append(
            [
                n,
                f"{median['prefill'] * 1e3:.1f}",
                per_token["device_put"],
                per_token["host"],
                f"{sent / 2**20:.2f}",
                per_token["host_whole"],
                f"{whole / 2**20:.1f}",
            ]
        )
    print(machine())
    print(f"proposer {args.proposer}, max_model_len {options['max_model_len']}, rounds {args.rounds}")
    header = [
        "prompt tokens",
        "prefill ms",
        "device_put ms",
        "host path ms (filled slots)",
        "sent MiB",
        "host path ms (whole row)",
        "whole row MiB",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
