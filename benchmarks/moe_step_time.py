"""What verifying k + 1 tokens costs a mixture-of-experts target: the time of one decoding pass
over T tokens (T = 1 is a plain step, T = k + 1 a chain verify pass) and the experts it touches,
against a dense model with the same active parameters, and the same mixture under latent attention
(MLA, DeepSeek-V3's), with what its cache saves per token against per-head keys and values.

    .venv/bin/python benchmarks/moe_step_time.py [--repeats 30] [--tokens 1 2 3 4 5 6 8 9]

A dense model reads all its weights once per pass whatever T, so a verify pass costs about a
plain step. A mixture reads only the experts its tokens are routed to: one token touches
`num_experts_per_tok` experts a layer, T tokens up to T times as many (on average
X * (1 - (1 - k/X)^T) of X experts, for uniform routing), so a verify pass reads more weights
than a plain step and speculation's saving shrinks. The models are random (float32, CPU; routing
of random weights is near uniform); one row, 128 tokens already in the cache; the weights as
generate uses them on the CPU (attention and dense MLPs through the CPU kernels).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table

from specjax.kernels.layouts import with_panel_weights
from specjax.models import LlamaConfig, cache_bytes, forward_hidden, init_cache, init_params
from specjax.models.llama import embed_tokens
from specjax.models.mlp import route

MOE = LlamaConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=768,
    num_layers=6,
    num_heads=16,
    num_kv_heads=4,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
# The same attention, and one dense MLP as wide as the two active experts together.
DENSE = LlamaConfig(
    **{**MOE.__dict__, "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": None}
)
# The same mixture under DeepSeek-V3's latent attention (models/mla.py): queries through a normed
# latent, keys and values from a 256-dim latent plus one 32-dim rotary key shared by the heads.
MLA_MOE = LlamaConfig(
    **{
        **MOE.__dict__,
        "num_kv_heads": 1,
        "head_dim": 96,  # 64 dims scored against the latent, 32 rotary
        "rotary_dim": 32,
        "v_head_dim": 64,
        "kv_lora_rank": 256,
        "q_lora_rank": 384,
        "rope_interleave": True,
    }
)
# DeepSeek-V3's attention shapes (config.json of deepseek-ai/DeepSeek-V3), for the cache rows only.
DEEPSEEK_V3 = LlamaConfig(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_layers=61,
    num_heads=128,
    num_kv_heads=1,
    head_dim=192,  # 128 dims scored against the latent, 64 rotary
    rotary_dim=64,
    v_head_dim=128,
    kv_lora_rank=512,
    q_lora_rank=1536,
    rope_interleave=True,
)


def per_head_numbers(config: LlamaConfig) -> int:
    """Numbers a per-head cache of `config`'s attention holds per token and layer: every query
    head's key and value (what the latent stands in for)."""
    return config.num_heads * (config.head_dim + config.v_head_dim)


def cache_rows() -> list[list]:
    """Cache per token, latent against per-head keys and values, from the caches' shapes: for
    DeepSeek-V3 in bfloat16 and for MLA_MOE in float32 (as timed here), all layers."""
    rows = []
    for name, config, itemsize in (
        ("DeepSeek-V3, bfloat16", DEEPSEEK_V3, 2),
        ("MLA + MoE timed here, float32", MLA_MOE, 4),
    ):
        latent, per_head = config.cache_token_size, per_head_numbers(config)
        L = config.num_layers
        rows.append(
            [
                f"{name}, {L} layers",
                latent,
                per_head,
                f"{cache_bytes(config, 1, 1, itemsize) / 1024:.1f} KiB",
                f"{per_head * itemsize * L / 1024:.1f} KiB",
                f"{per_head / latent:.1f}x",
            ]
        )
    return rows


def pass_time(config: LlamaConfig, params, num_tokens: int, repeats: int, cached: int = 128) -> float:
    """Median seconds of one decoding pass over num_tokens tokens after `cached` committed ones."""
    cache = init_cache(config, 1, cached + 16)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, cached)), jnp.int32)
    _, cache = jax.jit(forward_hidden, static_argnums=1, static_argnames="empty_cache")(
        params, config, prompt, jnp.arange(cached)[None], cache, empty_cache=True
    )
    cache = cache.advance(jnp.asarray([cached], jnp.int32))
    tokens = jnp.asarray(
        np.random.default_rng(num_tokens).integers(0, config.vocab_size, (1, num_tokens)), jnp.int32
    )
    positions = cached + jnp.arange(num_tokens)[None]
    step = jax.jit(lambda p, t, pos, c: forward_hidden(p, config, t, pos, c, write=False)[0])
    step(params, tokens, positions, cache).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(params, tokens, positions, cache).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def experts_touched(config: LlamaConfig, params, num_tokens: int, samples: int = 200) -> float:
    """Mean distinct experts a pass of num_tokens random tokens routes to, per layer (routing the
    first MoE layer's input: token embeddings through its router, a fair sample of routing)."""
    rng = np.random.default_rng(1)
    layer = params.layers[0]
    counts = []
    for _ in range(samples):
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (num_tokens,)), jnp.int32)
        x = embed_tokens(params, config, tokens)
        _, experts = route(config, x, layer)
        counts.append(len(np.unique(np.asarray(experts))))
    return float(np.mean(counts))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 9])
    args = parser.parse_args()
    # As generate runs them on the CPU: projections as panels for the CPU kernel (the experts stay
    # plain arrays, see models/llama.py, moe_mlp).
    models = {
        name: (config, with_panel_weights(init_params(config, jax.random.key(0))))
        for name, config in (("moe", MOE), ("dense", DENSE), ("mla", MLA_MOE))
    }
    X, k = MOE.num_experts, MOE.num_experts_per_tok
    rows, base = [], {}
    for T in args.tokens:
        times = {name: pass_time(c, p, T, args.repeats) for name, (c, p) in models.items()}
        base = base or times
        expected = X * (1 - (1 - k / X) ** T)
        rows.append(
            [
                T,
                f"{experts_touched(MOE, models['moe'][1], T):.1f} ({expected:.1f})",
                times["moe"] * 1e3,
                times["moe"] / base["moe"],
                times["mla"] * 1e3,
                times["mla"] / base["mla"],
                times["dense"] * 1e3,
                times["dense"] / base["dense"],
            ]
        )
    print(f"\nmachine: {machine()}")
    print(
        f"MoE: {X} experts, top {k}, expert ffw {MOE.moe_intermediate_size}; "
        f"dense ffw {DENSE.intermediate_size}; MLA: latent {MLA_MOE.kv_lora_rank}, rotary key "
        f"{MLA_MOE.rotary_dim}, query latent {MLA_MOE.q_lora_rank}\n"
    )
    header = [
        "tokens in the pass",
        "experts touched per layer (uniform)",
        "MoE ms",
        "MoE / 1 token",
        "MLA + MoE ms",
        "MLA + MoE / 1 token",
        "dense ms",
        "dense / 1 token",
    ]
    print(markdown_table(header, rows))
    print("\ncache per token: the latent and rotary key against every head's key and value\n")
    header = [
        "attention",
        "numbers / token / layer, latent",
        "per-head",
        "bytes / token, latent",
        "per-head",
        "saving",
    ]
    print(markdown_table(header, cache_rows()))


if __name__ == "__main__":
    main()
