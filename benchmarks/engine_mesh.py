"""The engine on a mesh of fake devices: what each device holds of its KV cache, and the
all-reduces a decoding step makes.

    XLA_FLAGS=--xla_force_host_platform_device_count=6 .venv/bin/python benchmarks/engine_mesh.py \
        [--max-batch 4] [--max-model-len 1024] [--page-size 16] [--num-pages 128]

The built-in model (SmolLM2-135M: 30 layers, 9 heads, 3 kv heads, so the "model" axis is 1 or 3)
with NGram(k=4), on one device, on model 3, and on data 2 x model 3; dense rows (max_batch rows of
max_model_len and a verify pass) and pages (`--num-pages` usable pages of `--page-size` slots, a
part per data group). Per layout: the KV cache's bytes in all and on one device (read from the
running state's arrays: the shards each device holds), and the all-reduces in the compiled
decoding loop's HLO (`Engine._batch.programs`, the greedy loop at max_batch): the float32 sums over
each model group (two per layer: after attention, after the MLP) and the others (the loop's
integer and flag reductions). Nothing here is timed: the fake devices share two cores, so a step's
time on them says nothing of a mesh of accelerators.
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


def all_reduces(engine: Engine) -> Counter:
    """The compiled greedy loop's all-reduces, counted by (dtype, whether over the model groups)."""
    width = engine.max_batch
    kind = next(k for k in engine._batch.loops if (k, width) in engine._batch.programs)
    text = engine._batch.programs[(kind, width)].as_text()
    sums = re.findall(r"= (\w+)\[[^\]]*\]\S* all-reduce\(.*?replica_groups=(\{[{}0-9,]*\})", text)
    model = 1 if engine.mesh is None else sharding.model_degree(engine.mesh)
    data = 1 if engine.mesh is None else sharding.data_degree(engine.mesh)
    groups = (
        "{"
        + ",".join("{" + ",".join(str(g * model + m) for m in range(model)) + "}" for g in range(data))
        + "}"
    )
    return Counter((dtype, found == groups) for dtype, found in sums)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=128)
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
            state = engine._batch.state.cache
            total, mine = per_device_bytes([*state.k, *state.v])
            counts = all_reduces(engine) if mesh is not None else Counter()
            over_model = sum(
                n for (dtype, model_groups), n in counts.items() if model_groups and dtype == "f32"
            )
            others = sum(
                n for (dtype, model_groups), n in counts.items() if not (model_groups and dtype == "f32")
            )
            others_kinds = ", ".join(
                sorted({dtype for (dtype, model_groups) in counts if not (model_groups and dtype == "f32")})
            )
            rows.append(
                [
                    name,
                    cache,
                    engine.kv_cache.summary().removeprefix("KV cache: "),
                    f"{total / 2**20:.1f}",
                    f"{mine / 2**20:.1f}",
                    f"{total / mine:.0f}",
                    "-" if mesh is None else over_model,
                    "-" if mesh is None else f"{others} ({others_kinds or 'none'})",
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
        "f32 all-reduces over model groups per step",
        "other all-reduces",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
