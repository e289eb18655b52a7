r"""On a GPU or TPU: whether the accelerator path gives the XLA path's tokens there, and what a
decoding step and a verify step cost a real-sized model, with the Pallas attention kernels
("auto") and without them ("xla"), in bfloat16 and with int8 and int4 weights.

    python benchmarks/accelerator_step.py                        # all three parts
    python benchmarks/accelerator_step.py --parts check          # tokens only (small models)
    python benchmarks/accelerator_step.py --parts time --size 8b --weights bfloat16 int8 int4 \
        --kernels auto xla --proposers plain verify-k4 --batches 1 8 --layers unrolled scanned
    python benchmarks/accelerator_step.py --parts products --product-rows 1 8

**check**: random Llama models with heads 64 and 128 wide (the sizes the device kernels take),
float32 at "highest" precision, four ragged prompts: plain decoding and NGram, a draft model
accepted part of the time (the target with noise added), a Medusa tree and ForcedAcceptance
(drafts accepted at 60% a position whatever the target says: ragged cache lengths), each with
kernels "auto" (the device's Pallas kernels) against "xla". Every row must give the same tokens
under both, and every lossless proposer plain decoding's tokens.

**time**: a random model of Llama-3.1-8B's shape (or --size 1b: Llama-3.2-1B's), weights drawn on
the device. Milliseconds per step as benchmarks/step_time.py measures them: whole `generate` calls
at --short-steps and --long-steps new tokens (median of --repeats after a warm-up), the difference
over the extra steps, so prefill and compilation cancel. `verify-kN` is ForcedAcceptance(0, k=N):
every step one verify pass over N + 1 tokens. "weight GB/s" is the weights' bytes over the step
time (every step reads each weight once, the embedding aside: a row per token): against the
device's memory bandwidth it says how close a step is to the memory roofline. int8 and int4
weights are random integers with random scales (their values do not matter to the time), products
through `quantized.xla_product` (the backend's form): whether XLA fuses their dequantization
into the products shows as a step faster than bfloat16's. `--layers scanned` runs the layers as
one loop over stacked weights (`scan_layers=True`), `unrolled` as the default does.

**products**: one [4096, 14336] product (Llama-3.1-8B's MLP) at a decoding step's rows, bfloat16
weights against int8 and int4 ones in each of `xla_product`'s forms (`time_products`).

Needs no data set and no tokenizer. Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table, median_time
from memory_table import MODELS

import specjax
from specjax.kernels.quantized import PRODUCT_FORMS, QuantizedWeight, xla_product
from specjax.models import LlamaConfig, MedusaHead, Model, init_params
from specjax.models.quantized import PROJECTIONS, nbytes
from specjax.speculate.tree import TokenTree

SIZES = {  # configs whose shapes the timed random models take
    "8b": dataclasses.replace(MODELS["Llama-3.1-8B"], max_position_embeddings=8192),
    "1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}
CHECK_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [4] * 20]


# -- check ---------------------------------------------------------------------------------------


def check_model(head_dim: int, seed: int = 0) -> Model:
    """A small random model whose heads are `head_dim` wide, its later layers' updates scaled
    down (as tests/drafters.py's layered targets) so that drafts made from it are accepted part
    of the time."""
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=2 * head_dim,
        intermediate_size=3 * head_dim,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    params = init_params(config, jax.random.key(seed))
    first, *later = params.layers
    later = [layer.replace(o=0.3 * layer.o, down=0.3 * layer.down) for layer in later]
    return Model(config, params.replace(layers=(first, *later)), name=f"random-head{head_dim}")


def noisy(model: Model, noise: float = 0.05, seed: int = 1) -> Model:
    """`model` with N(0, noise^2) times each weight's RMS added to it: a draft model that agrees
    with the target most of the time."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [
        w + noise * jnp.sqrt(jnp.mean(w * w)) * jax.random.normal(k, w.shape, w.dtype)
        for w, k in zip(leaves, keys, strict=True)
    ]
    return Model(model.config, jax.tree.unflatten(treedef, out), name=f"{model.name}-noisy")


def check(kernels: str) -> list[list]:
    rows = []
    for head_dim in (64, 128):
        target = check_model(head_dim)
        proposers = {
            "plain": None,
            "ngram": specjax.NGram(k=3),
            "draft": specjax.DraftModel(noisy(target), k=3),
            "medusa-tree": specjax.Medusa(MedusaHead.init(target, num_heads=2), tree=TokenTree.top_k((2, 2))),
            "forced-0.6": specjax.ForcedAcceptance(0.6, specjax.NGram(k=3)),
        }
        plain = None
        for name, proposer in proposers.items():
            options = dict(proposer=proposer, max_new_tokens=40, matmul_precision="highest")
            device = specjax.generate(target, CHECK_PROMPTS, kernels=kernels, **options)
            xla = specjax.generate(target, CHECK_PROMPTS, kernels="xla", **options)
            same_as_xla = sum(a == b for a, b in zip(device.tokens, xla.tokens, strict=True))
            if name == "plain":
                plain = xla.tokens
            lossless = (
                "-"
                if name.startswith("forced")
                else f"{sum(a == b for a, b in zip(device.tokens, plain, strict=True))}/4"
            )
            m = device.metrics
            rows.append(
                [head_dim, name, f"{same_as_xla}/4", lossless, int(m.accepted.sum()), int(m.drafted.sum())]
            )
            print(rows[-1], flush=True)
    return rows


# -- time ----------------------------------------------------------------------------------------


def random_quantized(key, shape, kind: str) -> QuantizedWeight:
    """Random int8 (a scale per output channel) or int4 (groups of 32, scales and offsets)
    weights of logical shape [D_in, D_out], drawn on the device."""
    d_in, d_out = shape
    k1, k2 = jax.random.split(key)
    if kind == "int8":
        values = jax.random.randint(k1, shape, -127, 128, jnp.int8)
        scales = jax.random.uniform(k2, (1, d_out), jnp.float32, 0.5, 1.5) / (127 * np.sqrt(d_in))
        return QuantizedWeight(values, scales, None, bits=8, group=d_in)
    values = jax.random.randint(k1, (d_in // 2, d_out), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.uniform(k2, (d_in // 32, d_out), jnp.float32, 0.5, 1.5) / (8 * np.sqrt(d_in))
    return QuantizedWeight(values, scales, -8 * scales, bits=4, group=32)


def timing_model(size: str, weights: str) -> Model:
    config = SIZES[size]
    params = init_params(config, jax.random.key(0), dtype=jnp.bfloat16)
    if weights != "bfloat16":
        keys = iter(jax.random.split(jax.random.key(1), 8 * config.num_layers + 1))

        def quantized(w):
            return None if w is None else random_quantized(next(keys), w.shape, weights)

        layers = tuple(
            layer.replace(**{name: quantized(getattr(layer, name)) for name in PROJECTIONS})
            for layer in params.layers
        )
        head = params.embed.T if params.lm_head is None else params.lm_head
        params = params.replace(layers=layers, lm_head=quantized(head))
    jax.block_until_ready(params)
    return Model(config, params, name=f"random-{size}-{weights}")


def step_ms(model, batch: int, proposer_name: str, kernels: str, layers: str, args) -> float:
    rng = np.random.default_rng(batch)
    prompts = [list(map(int, rng.integers(1000, 100000, args.prompt_tokens))) for _ in range(batch)]
    proposer = None
    if proposer_name.startswith("verify-k"):
        proposer = specjax.ForcedAcceptance(0.0, k=int(proposer_name.removeprefix("verify-k")))

    def run(n):
        options = dict(kernels=kernels, scan_layers=layers == "scanned")
        return specjax.generate(model, prompts, proposer=proposer, max_new_tokens=n, **options)

    times, steps = {}, {}
    for n in (args.short_steps, args.long_steps):
        result = run(n)  # warm-up (and compile)
        steps[n] = int(result.metrics.steps.max())
        times[n] = median_time(lambda n=n: run(n), args.repeats)
    return (
        (times[args.long_steps] - times[args.short_steps])
        / (steps[args.long_steps] - steps[args.short_steps])
        * 1e3
    )


def time_steps(args) -> list[list]:
    rows = []
    start = time.perf_counter()
    for weights in args.weights:
        model = timing_model(args.size, weights)
        # What a step reads: every weight but the embedding, of which it looks up a row per token
        # (a tied model's head is the embedding: then it is read whole).
        embedding = 0 if model.params.lm_head is None else nbytes(model.params.embed)
        gb = (nbytes(model.params) - embedding) / 1e9
        print(f"{weights}: {gb:.2f} GB of weights read per step", flush=True)
        for batch in args.batches:
            for proposer_name in args.proposers:
                for kernels, layers in [(k, lay) for k in args.kernels for lay in args.layers]:
                    if time.perf_counter() - start > args.budget_s:
                        print(f"budget of {args.budget_s} s spent: stopping", flush=True)
                        return rows
                    ms = step_ms(model, batch, proposer_name, kernels, layers, args)
                    rows.append(
                        [weights, batch, proposer_name, kernels, layers, ms, batch * 1e3 / ms, gb / ms * 1e3]
                    )
                    print(rows[-1], flush=True)
        del model
    return rows


# -- products ------------------------------------------------------------------------------------


def product_forms(kind: str) -> dict:
    """The ways `quantized.xla_product` writes x [N, D_in] (bfloat16) @ a quantized weight."""
    return {form: functools.partial(xla_product, form=form) for form in PRODUCT_FORMS}


def time_products(args) -> list[list]:
    """Microseconds per [D_in, D_out] product of Llama-3.1-8B's MLP (4096 x 14336) at a decoding
    step's rows: bfloat16 weights against int8 and int4 ones written each way. Each call chains the
    product over --copies distinct weights (their bytes past the L2 cache), each input the last
    output's first D_in columns; the time is the call's median over --repeats over the copies."""
    d_in, d_out = 4096, 14336
    keys = jax.random.split(jax.random.key(2), args.copies)
    cases = {
        "bfloat16": ([jax.random.normal(k, (d_in, d_out), jnp.bfloat16) for k in keys], {"dot": jnp.matmul})
    }
    for kind in ("int8", "int4"):
        cases[kind] = ([random_quantized(k, (d_in, d_out), kind) for k in keys], product_forms(kind))
    rows = []
    for rows_n in args.product_rows:
        x = jax.random.normal(jax.random.key(3), (rows_n, d_in), jnp.bfloat16)
        for kind, (weights, forms) in cases.items():
            nbytes_each = sum(a.nbytes for a in jax.tree.leaves(weights[0]))
            for name, form in forms.items():

                @jax.jit
                def chain(x, weights, form=form):
                    for w in weights:
                        x = form(x, w)[:, :d_in].astype(jnp.bfloat16)
                    return x

                chain(x, weights).block_until_ready()
                seconds = median_time(
                    lambda c=chain, x=x, w=weights: c(x, w).block_until_ready(), args.repeats
                )
                us = seconds / len(weights) * 1e6
                rows.append([rows_n, kind, name, us, nbytes_each / us / 1e3])
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts", nargs="+", default=["check", "time", "products"], choices=["check", "time", "products"]
    )
    parser.add_argument("--product-rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--copies", type=int, default=8, help="distinct weights per products call")
    parser.add_argument(
        "--check-kernels",
        default="auto",
        help='"auto" on the device; "pallas:cuda" to try the check on a CPU',
    )
    parser.add_argument("--size", default="8b", choices=sorted(SIZES))
    parser.add_argument(
        "--weights", nargs="+", default=["bfloat16", "int8", "int4"], choices=["bfloat16", "int8", "int4"]
    )
    parser.add_argument("--kernels", nargs="+", default=["auto", "xla"], choices=["auto", "xla"])
    parser.add_argument("--proposers", nargs="+", default=["plain", "verify-k4"])
    parser.add_argument(
        "--layers",
        nargs="+",
        default=["scanned"],
        choices=["scanned", "unrolled"],
        help="decoder layers as one loop over stacked weights (the accelerators' default) or unrolled",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--short-steps", type=int, default=8)
    parser.add_argument("--long-steps", type=int, default=136)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, default=1e9, help="start no new case after this many seconds"
    )
    args = parser.parse_args()
    print(f"machine: {machine()}; devices: {jax.devices()}", flush=True)
    if "check" in args.parts:
        rows = check(args.check_kernels)
        header = [
            "head dim",
            "proposer",
            f'"{args.check_kernels}" = "xla" tokens',
            "= plain tokens",
            "accepted",
            "drafted",
        ]
        print("\n" + markdown_table(header, rows), flush=True)
    if "time" in args.parts:
        rows = time_steps(args)
        print(
            f"\nrandom {args.size} model, prompt of {args.prompt_tokens} tokens, greedy, "
            f"{args.long_steps} - {args.short_steps} new tokens, median of {args.repeats}\n"
        )
        header = [
            "weights",
            "batch",
            "proposer",
            "kernels",
            "layers",
            "ms per step",
            "tokens/s (plain) or steps/s x batch",
            "weight GB/s",
        ]
        print(markdown_table(header, rows), flush=True)
    if "products" in args.parts:
        rows = time_products(args)
        print(
            f"\n4096 x 14336 products, bfloat16 inputs, median of {args.repeats} over {args.copies} copies\n"
        )
        print(
            markdown_table(["rows", "weights", "written as", "us per product", "GB/s read"], rows), flush=True
        )


if __name__ == "__main__":
    main()
