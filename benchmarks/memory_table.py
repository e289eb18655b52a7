"""The memory table of docs/models.md: device memory per device for real model sizes, computed
by `specjax.estimate_memory` from each model's config (no weights needed).

    .venv/bin/python benchmarks/memory_table.py

tests/test_docs.py checks that docs/models.md holds exactly this table.
"""

from __future__ import annotations

from specjax import estimate_memory
from specjax.models import LlamaConfig, RopeScaling

LLAMA3_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
MODELS = {
    "Llama-3.1-8B": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "Llama-3.1-70B": LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "Qwen3-30B-A3B": LlamaConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        qk_norm=True,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}
# (model, batch, tokens per row, mesh degrees)
CASES = [
    ("Llama-3.1-8B", 1, 8192, {"model": 1}),
    ("Llama-3.1-8B", 16, 8192, {"model": 1}),
    ("Llama-3.1-8B", 16, 8192, {"model": 8}),
    ("Llama-3.1-70B", 1, 8192, {"model": 8}),
    ("Llama-3.1-70B", 16, 8192, {"model": 8}),
    ("Qwen3-30B-A3B", 16, 8192, {"model": 1}),
    ("Qwen3-30B-A3B", 16, 8192, {"model": 4}),
]


def table() -> str:
    columns = ["model", "batch x tokens", "mesh (data x model)", "weights", "KV cache", "verify logits (k=4)"]
    columns.append("total per device")
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join(["---"] * len(columns)) + " |"]
    for name, batch, tokens, mesh in CASES:
        e = estimate_memory(MODELS[name], batch, tokens, "bfloat16", mesh=mesh, num_speculative_tokens=4)
        s = e.summary()
        lines.append(
            f"| {name} | {batch} x {tokens} | {e.data} x {e.model} | {s['weights_gib']:.1f} GiB | "
            f"{s['kv_cache_gib']:.1f} GiB | {s['logits_gib']:.2f} GiB | {s['total_gib']:.1f} GiB |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    print(table())
