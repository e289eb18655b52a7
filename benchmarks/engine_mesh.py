"""The engine on a mesh of fake devices: what each device holds of its KV cache, and the
all-reduces a decoding step makes.

    XLA_FLAGS=--xla_force_host_platform_device_count=6 .venv/bin/python benchmarks/engine_mesh.py \
        [--max-batch 4] [--max-model-len 1024] [--page-size 16] [--num-pages 160]

The built-in model (SmolLM2-135M: 30 layers, 9 heads, 3 kv heads, so the "model" axis is 1 or 3)
with NGram(k=4), on one device, on model 3, and on data 2 x model 3; dense rows (max_batch rows of
max_model_len and a verify pass) and pages (`--num-pages` usable pages of `--page-size` slots, a
part per data group). Per layout: the KV cache's bytes in all and on one device (read from the
running state's arrays at max_batch wide: the shards each device holds), and the all-reduces in
the compiled decoding loop's HLO (`Engine._batch.programs`, the greedy loop at max_batch): the
float32 sums over each model group in each of the loop's bodies that hold them (a step runs one:
the verify pass, or the plain pass of a step where no row drafted; two per layer each, after
attention and after the MLP), and the others (the loop's integer and flag reductions). Nothing
here is timed: the fake devices share two cores, so a step's time on them says nothing of a mesh
of accelerators.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import jax
from common import machine, markdown_table

import specjax
from specjax import sharding
from specjax.serve import Engine


def per_device_bytes(buffers) -> tuple[int, int]:
    """(bytes in all, bytes on the first device) of the cache's buffers."""
    total = sum(buffer.nbytes for buffer in buffers)
    device = jax.devices()[0]
    mine = sum(
        shard.data.nbytes
        for buffer in buffers
        for shard in buffer.addressable_shards
        if shard.device == device
    )
    return total, mine


def all_reduces(engine: Engine) -> tuple[list[int], Counter]:
    """The compiled greedy loop's all-reduces (`Engine._batch.programs`, the lean loop at
    max_batch): the float32 sums over the model groups in each HLO computation that holds any
    (the loop's bodies: a step runs one of them), and the others counted by dtype."""
    programs = engine._batch.programs
    kind = "lean" if ("lean", engine.max_batch) in programs else "resume"
    text = programs[(kind, engine.max_batch)].as_text()
    model, data = sharding.model_degree(engine.mesh), sharding.data_degree(engine.mesh)
    groups = ",".join("{" + ",".join(str(g * model + m) for m in range(model)) + "}" for g in range(data))
    computation, over_model, others = None, Counter(), Counter()
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[0]
        if " all-reduce(" not in line and " all-reduce-start(" not in line:
            continue
        dtype = re.search(r"= \(?(\w+)\[", line)
        dtype = dtype.group(1) if dtype else "tuple"
        if dtype == "f32" and f"replica_groups={{{groups}}}" in line:
            over_model[computation] += 1
        else:
            others[dtype] += 1
    return sorted(over_model.values(), reverse=True), others


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=160)
    args = parser.parse_args()
    if jax.device_count() < 6:
        raise SystemExit("needs 6 devices: XLA_FLAGS=--xla_force_host_platform_device_count=6")
    model = specjax.load("smollm2-135m")
    layouts = {"one device": None, "model 3": (1, 3), "data 2 x model 3": (2, 3)}
    rows = []
    for name, shape in layouts.items():
        mesh = None
        if shape is not None:
            data, degree = shape
            mesh = sharding.make_mesh(model=degree, data=data, devices=jax.devices()[: data * degree])
        for cache in ("dense", "pages"):
            pages = {} if cache == "dense" else dict(page_size=args.page_size, num_pages=args.num_pages)
            engine = Engine(
                model,
                specjax.NGram(k=4),
                mesh=mesh,
                max_batch=args.max_batch,
                max_model_len=args.max_model_len,
                **pages,
            )
            engine.precompile([])
            engine._batch.resize(engine.max_batch)  # (one device: its state at its widest)
            state = engine._batch.state.cache
            total, mine = per_device_bytes([*state.k, *state.v])
            sums, others = ([], Counter()) if mesh is None else all_reduces(engine)
            other = ", ".join(f"{n} {dtype}" for dtype, n in sorted(others.items())) or "none"
            rows.append(
                [
                    name,
                    cache,
                    engine.kv_cache.summary().removeprefix("KV cache: "),
                    f"{total / 2**20:.1f}",
                    f"{mine / 2**20:.1f}",
                    f"{total / mine:.0f}",
                    "-" if mesh is None else " + ".join(map(str, sums)),
                    "-" if mesh is None else other,
                ]
            )
            del engine
    print(machine())
    print(f"smollm2-135m ({model.config.num_layers} layers), NGram(k=4), max_batch {args.max_batch}")
    header = [
        "layout",
        "cache",
        "what it holds",
        "KV MiB in all",
        "KV MiB on one device",
        "ratio",
        "f32 all-reduces over model groups, per loop body",
        "other all-reduces in the loop",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
