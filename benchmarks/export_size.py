"""How the exported generate program grows with depth: the module's size, its dot_generals and its
Pallas calls for CUDA and TPU, and XLA:CPU's compile time of the same program on the XLA path,
for random Llama models of 4, 16, 32 and 80 layers (small widths: the size is in the structure),
with the layers scanned (the accelerators' default) and unrolled (the CPU's).

    .venv/bin/python benchmarks/export_size.py [--layers 4 16 32 80] [--proposer plain ngram]
        [--layout scanned unrolled]

Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import re
import time

import jax

import specjax
from specjax.models import LlamaConfig, Model, init_params

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 7]]


def model_of(layers: int) -> Model:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        tie_word_embeddings=False,
    )
    return Model(config, init_params(config, jax.random.key(0)), name=f"random-{layers}")


def measure(layers: int, proposer_name: str, layout: str) -> dict:
    model = model_of(layers)
    proposer = specjax.NGram(k=4) if proposer_name == "ngram" else None
    options = dict(proposer=proposer, max_new_tokens=16, scan_layers=layout == "scanned")
    start = time.perf_counter()
    exported = specjax.export_generate(model, PROMPTS, platforms=("cuda", "tpu"), **options)
    export_s = time.perf_counter() - start
    text = exported.mlir_module()
    calls = re.findall(r"stablehlo\.custom_call @([\w.$]+)", text)
    # XLA:CPU's compile time of the same program on the plain-XLA path (what every platform can run).
    cpu = specjax.export_generate(model, PROMPTS, platforms=("cpu",), kernels="xla", **options)
    start = time.perf_counter()
    arguments = specjax.export_arguments(model, PROMPTS, platforms=("cpu",), **options)
    jax.jit(cpu.call).lower(*arguments).compile()
    compile_s = time.perf_counter() - start
    return {
        "layers": layers,
        "proposer": proposer_name,
        "layout": layout,
        "module_mb": len(text) / 1e6,
        "dot_generals": text.count("stablehlo.dot_general"),
        "pallas_calls": sum(c in ("tpu_custom_call", "__gpu$xla.gpu.triton") for c in calls),
        "export_s": export_s,
        "cpu_compile_s": compile_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32, 80])
    parser.add_argument("--proposer", nargs="+", default=["plain", "ngram"], choices=["plain", "ngram"])
    parser.add_argument(
        "--layout", nargs="+", default=["scanned", "unrolled"], choices=["scanned", "unrolled"]
    )
    args = parser.parse_args()
    columns = (
        "proposer",
        "layers",
        "layers run",
        "module (MB)",
        "dot_generals",
        "Pallas calls",
        "export (s)",
    )
    columns += ("XLA:CPU compile (s)",)
    print("| " + " | ".join(columns) + " |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.proposer:
        for layout in args.layout:
            for layers in args.layers:
                r = measure(layers, name, layout)
                print(
                    f"| {name} | {layers} | {layout} | {r['module_mb']:.2f} | {r['dot_generals']} | "
                    f"{r['pallas_calls']} | {r['export_s']:.1f} | {r['cpu_compile_s']:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
