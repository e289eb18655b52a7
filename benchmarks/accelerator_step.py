r"""On a GPU or TPU, in one short run: what the quantized products and a decoding step of a
real-sized model cost in bfloat16, int8, int4 and FP8 (issue 67's timing goals, checked at the
end), whether the quantized kernels give the XLA path's tokens there, and (part "check") whether
the Pallas attention kernels do.

The prepared run for a lent device, sized to end in about 8 minutes on an H100 or H200 (an
estimate from the H200 run's compile times: the time part starts no case after --budget-s);
each part writes its tables to --out as it ends, so a run cut short keeps what it finished:

    cd benchmarks && PYTHONPATH=.. PYTHONUNBUFFERED=1 python accelerator_step.py --out $OUT

Parts (--parts; default products, quantized-check, time, in that order):

**products**: one [4096, 14336] product (Llama-3.1-8B's MLP; --product-shape) at a decoding
step's rows (--product-rows: 1, 8) and a verify pass's (40: 8 rows of 5 tokens): bfloat16 weights
against int8 (a scale per output channel, and in groups of 32 as GGUF's Q8_0), int4 (groups of 32
and 128) and FP8 (blocks of 128) ones, each through the device's Pallas kernel
(specjax/kernels/pallas_quantized.py: "pallas", its default tile, as `generate` runs it) and
through XLA's form (`quantized.xla_product`'s "in_product": what kernels="xla" runs); FP8 through
`fp8_product` (XLA's FP8 dot). Each call chains the product over --copies distinct weights
(their bytes past the L2 cache), each input the last output's first D_in columns; microseconds
per product, median of --repeats. Then the Pallas kernel at other tiles (stored rows, output
columns; TILES), int8 and int4 in groups of 32 at --tile-rows, to choose the defaults from.

**quantized-check**: a small random Llama (heads 128 wide, every projection but its 97-token
head a shape the device kernels tile) quantized to int8, int4 (groups of 32) and FP8
(--check-weights); four ragged prompts, 40 new tokens, float32 at "highest" precision; plain
decoding, a draft model accepted part of the time and ForcedAcceptance(0.6) of NGram (ragged
cache lengths): kernels "auto" (the device's quantized kernels, or FP8 dots where the GPU has
them) against "xla". Rows with the same tokens, and how many of the model's weights the kernel
multiplies.

**time**: a random model of Llama-3.1-8B's shape (--size; 1b: Llama-3.2-1B's), weights drawn on
the device, layers unrolled (the default). Milliseconds per step as benchmarks/step_time.py
measures them: whole `generate` calls at --short-steps and --long-steps new tokens (median of
--repeats after a warm-up), the difference over the extra steps, so that prefill and compilation
cancel. --cases are weights/batch/proposer, most needed first (--budget-s stops the rest):
`verify-kN` is ForcedAcceptance(0, k=N), every step one verify pass over N + 1 tokens. "weight
GB/s" is the weights' bytes over the step time (each step reads every weight once, the embedding
aside): against the memory's bandwidth, how close a step is to the roofline. Quantized weights are
random integers with random scales (their values do not change the time).

**goals** (printed last, from what ran): the product at 1 and 8 rows, int8 at most 0.6x and int4
(groups of 32) at most 0.35x bfloat16's; the 8B step at batch 1, int8 at most 0.7x and int4 at
most 0.5x bfloat16's; a verify pass of 5 tokens at batch 8 at most 1.3 plain steps of the same
weights.

**check** (not in the default run; an H200 run gave 4/4 everywhere, docs/benchmarks.md): random
Llama models with heads 64 and 128 wide, plain decoding and NGram, a draft model, a Medusa tree and
ForcedAcceptance(0.6), kernels "auto" (the Pallas attention kernels) against "xla".

On a CPU the same parts run the GPU's kernels in Pallas' interpreter (`--kernels pallas:cuda`,
`--check-kernels pallas:cuda`, --size tiny and a small --product-shape): how
tests/test_accelerator_step.py keeps this script working before a device runs it.

Needs no data set and no tokenizer. Prints markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import machine, markdown_table, median_time
from memory_table import MODELS

import specjax
from specjax.kernels import pallas_quantized
from specjax.kernels.quantized import QuantizedWeight, fp8_product, xla_product
from specjax.models import LlamaConfig, MedusaHead, Model, init_params
from specjax.models.quantized import PROJECTIONS, nbytes, quantize_params
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
    "tiny": LlamaConfig(  # for this script's own test on a CPU
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    ),
}
CHECK_PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [4] * 20]
WEIGHTS = ("bfloat16", "int8", "int4", "fp8")
# Most needed first: the goals' step ratios at batch 1, then the verify pass against plain at 8.
CASES = (
    "bfloat16/1/plain",
    "int8/1/plain",
    "int4/1/plain",
    "bfloat16/8/plain",
    "bfloat16/8/verify-k4",
    "int8/8/plain",
    "int8/8/verify-k4",
    "int4/8/plain",
    "int4/8/verify-k4",
    "fp8/1/plain",
)
PRODUCT_KINDS = ("int8", "int8-g32", "int4-g32", "int4-g128", "fp8")
TILES = {  # (stored rows, output columns) tried for the Pallas product beside its default
    "cuda": ((32, 64), (64, 64), (64, 128), (128, 32), (128, 128), (256, 64), (256, 128), (512, 64)),
    "tpu": ((256, 256), (512, 512), (1024, 256), (1024, 512), (2048, 512)),
}
# Issue 67's goals: a quantized time over bfloat16's (products, steps), and verify over plain.
PRODUCT_GOALS = {"int8": 0.6, "int4-g32": 0.35}
STEP_GOALS = {"int8": 0.7, "int4": 0.5}
VERIFY_GOAL = 1.3


def pallas_implementation() -> tuple[str, bool]:
    """(whose Pallas kernel, interpret?) the products part runs: the device's own, or on a CPU
    the GPU's kernel in Pallas' interpreter."""
    platform = jax.default_backend()
    if platform == "tpu":
        return "tpu", False
    return "cuda", platform != "gpu"


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


def failed(error: Exception) -> str:
    """A table cell for a case that raised. On a lent device every case runs once, in a few
    minutes all told: a kernel that does not compile there (a tile too large for Triton's
    registers, say) is a finding to record, and the cases after it still run."""
    print(f"failed: {type(error).__name__}: {error}", flush=True)
    first_line = next(iter(str(error).splitlines()), "")
    return f"failed: {type(error).__name__}: {first_line[:160]}"


def against_xla(model: Model, proposers: dict, kernels: str) -> list[list]:
    """[proposer, rows with "xla"'s tokens, rows with plain decoding's ("-" for a forced, lossy
    proposer), drafts accepted, drafted] of each of `proposers` (the first: plain decoding) on
    `model` with `kernels`, the four CHECK_PROMPTS, 40 new tokens, float32 at "highest"."""
    rows, plain = [], None
    for name, proposer in proposers.items():
        options = dict(proposer=proposer, max_new_tokens=40, matmul_precision="highest")
        try:
            device = specjax.generate(model, CHECK_PROMPTS, kernels=kernels, **options)
            xla = specjax.generate(model, CHECK_PROMPTS, kernels="xla", **options)
        except Exception as error:  # recorded, and the next proposer runs (`failed`)
            rows.append([name, failed(error), "-", "-", "-"])
            continue
        plain = xla.tokens if plain is None else plain
        same_as_xla = sum(a == b for a, b in zip(device.tokens, xla.tokens, strict=True))
        same_as_plain = sum(a == b for a, b in zip(device.tokens, plain, strict=True))
        lossless = "-" if name.startswith("forced") else f"{same_as_plain}/4"
        m = device.metrics
        rows.append([name, f"{same_as_xla}/4", lossless, int(m.accepted.sum()), int(m.drafted.sum())])
        print(model.name, rows[-1], flush=True)
    return rows


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
        rows += [[head_dim, *row] for row in against_xla(target, proposers, kernels)]
    return rows


# -- weights ------------------------------------------------------------------------------------


def random_quantized(key, shape, kind: str) -> QuantizedWeight:
    """Random weights of logical shape [D_in, D_out] in `kind`'s layout, drawn on the device:
    "int8" (a scale per output channel), "int8-g32" (scales per 32 inputs, as GGUF's Q8_0),
    "int4" / "int4-g32" / "int4-g128" (groups of 32 or 128 inputs, scales and offsets), "fp8"
    (float8_e4m3fn values, a scale per 128 inputs and output column, as FP8 releases load)."""
    d_in, d_out = shape
    k1, k2 = jax.random.split(key)
    if kind in ("int8", "int8-g32"):
        group = d_in if kind == "int8" else 32
        values = jax.random.randint(k1, shape, -127, 128, jnp.int8)
        scales = jax.random.uniform(k2, (d_in // group, d_out), jnp.float32, 0.5, 1.5) / (127 * np.sqrt(d_in))
        return QuantizedWeight(values, scales, None, bits=8, group=group)
    if kind == "fp8":
        values = jax.random.normal(k1, shape, jnp.float32).astype(jnp.float8_e4m3fn)
        scales = jax.random.uniform(k2, (d_in // 128, d_out), jnp.float32, 0.5, 1.5) / np.sqrt(d_in)
        return QuantizedWeight(values, scales, None, bits=8, group=128)
    group = 32 if kind == "int4" else int(kind.removeprefix("int4-g"))
    values = jax.random.randint(k1, (d_in // 2, d_out), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.uniform(k2, (d_in // group, d_out), jnp.float32, 0.5, 1.5) / (8 * np.sqrt(d_in))
    return QuantizedWeight(values, scales, -8 * scales, bits=4, group=group)


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


def kernel_weights(params, platform: str) -> tuple[int, int]:
    """(how many of params' quantized weights the `platform`'s Pallas kernel multiplies, how many
    quantized weights there are): the rest run XLA's form."""
    quantized = [
        w
        for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
        if isinstance(w, QuantizedWeight)
    ]
    fits = sum(pallas_quantized.unsupported(w, platform) is None for w in quantized)
    return fits, len(quantized)


# -- products ------------------------------------------------------------------------------------


def product_forms(kind: str, implementation: str, interpret: bool) -> dict:
    """The ways a product of x [N, D_in] (bfloat16) and a `kind` weight is timed."""
    if kind == "bfloat16":
        return {"dot": jnp.matmul}
    if kind == "fp8":
        return {"fp8_product": fp8_product, "in_product": functools.partial(xla_product, form="in_product")}
    pallas = functools.partial(
        pallas_quantized.quantized_matmul, implementation=implementation, interpret=interpret
    )
    return {"pallas": pallas, "in_product": functools.partial(xla_product, form="in_product")}


def time_chain(form, x, weights, repeats: int) -> float:
    """Microseconds per product of `form` chained over `weights`."""
    d_in = x.shape[-1]

    @jax.jit
    def chain(x, weights):
        for w in weights:
            x = form(x, w)[:, :d_in].astype(jnp.bfloat16)
        return x

    chain(x, weights).block_until_ready()
    seconds = median_time(lambda: chain(x, weights).block_until_ready(), repeats)
    return seconds / len(weights) * 1e6


def time_products(args) -> dict[str, list[list]]:
    """The products table (rows, weights, form, us, GB/s read) and the tiles table."""
    d_in, d_out = args.product_shape
    implementation, interpret = pallas_implementation()
    keys = jax.random.split(jax.random.key(2), args.copies)
    cases = {"bfloat16": [jax.random.normal(k, (d_in, d_out), jnp.bfloat16) for k in keys]}
    for kind in PRODUCT_KINDS:
        cases[kind] = [random_quantized(k, (d_in, d_out), kind) for k in keys]
    products, tiles = [], []
    for rows_n in args.product_rows:
        x = jax.random.normal(jax.random.key(3), (rows_n, d_in), jnp.bfloat16)
        for kind, weights in cases.items():
            nbytes_each = sum(a.nbytes for a in jax.tree.leaves(weights[0]))
            for name, form in product_forms(kind, implementation, interpret).items():
                tile = pallas_quantized.tiles(weights[0], implementation)[:2] if name == "pallas" else "-"
                try:
                    us = time_chain(form, x, weights, args.repeats)
                except Exception as error:  # recorded, and the next form runs (`failed`)
                    products.append([rows_n, kind, name, str(tile), failed(error), "-"])
                    continue
                products.append([rows_n, kind, name, str(tile), us, nbytes_each / us / 1e3])
                print(products[-1], flush=True)
        for kind in ("int8", "int4-g32") if rows_n in args.tile_rows else ():
            for tile in TILES[implementation]:
                if pallas_quantized.tiles(cases[kind][0], implementation, tile) is None:
                    continue
                form = functools.partial(
                    pallas_quantized.quantized_matmul,
                    implementation=implementation,
                    interpret=interpret,
                    tile=tile,
                )
                try:
                    us = time_chain(form, x, cases[kind], args.repeats)
                except Exception as error:  # recorded, and the next tile runs (`failed`)
                    us = failed(error)
                tiles.append([rows_n, kind, str(tile), us])
                print(tiles[-1], flush=True)
    return {"products": products, "tiles": tiles}


# -- quantized check -----------------------------------------------------------------------------


def quantized_check(kernels: str, kinds) -> list[list]:
    """Tokens of a small model quantized to each of `kinds` with kernels `kernels` against "xla"
    (see the module's docstring)."""
    target = check_model(128)
    platform = "tpu" if kernels.endswith("tpu") or jax.default_backend() == "tpu" else "cuda"
    rows = []
    for kind in kinds:
        group = 32 if kind == "int4" else None
        model = Model(
            target.config, quantize_params(target.params, kind, group), name=f"{target.name}-{kind}"
        )
        fits, total = kernel_weights(model.params, platform)
        proposers = {
            "plain": None,
            "draft": specjax.DraftModel(noisy(target), k=3),
            "forced-0.6": specjax.ForcedAcceptance(0.6, specjax.NGram(k=3)),
        }
        kernel_share = "-" if kind == "fp8" else f"{fits}/{total}"
        rows += [[kind, kernel_share, *row] for row in against_xla(model, proposers, kernels)]
    return rows


# -- time ----------------------------------------------------------------------------------------


def parse_case(case: str) -> tuple[str, int, str]:
    """ "weights/batch/proposer" -> (weights, batch, proposer)."""
    parts = case.split("/")
    allowed = f"weights/batch/proposer, weights one of {WEIGHTS}, proposer plain or verify-kN"
    if len(parts) != 3 or parts[0] not in WEIGHTS or not parts[1].isdigit():
        raise SystemExit(f"--cases: {case!r} is not {allowed}")
    if parts[2] != "plain" and not (parts[2].startswith("verify-k") and parts[2][8:].isdigit()):
        raise SystemExit(f"--cases: {case!r} is not {allowed}")
    return parts[0], int(parts[1]), parts[2]


def step_ms(model, batch: int, proposer_name: str, kernels: str, layers: str, args) -> float:
    rng = np.random.default_rng(batch)
    high = min(100000, model.config.vocab_size)
    prompts = [list(map(int, rng.integers(high // 100, high, args.prompt_tokens))) for _ in range(batch)]
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
    rows, models, read_gb = [], {}, {}
    start = time.perf_counter()
    for weights, batch, proposer_name in map(parse_case, args.cases):
        if weights not in models:
            models[weights] = model = timing_model(args.size, weights)
            # What a step reads: every weight but the embedding, of which it looks up a row per
            # token (a tied model's head is the embedding: then it is read whole).
            embedding = 0 if model.params.lm_head is None else nbytes(model.params.embed)
            read_gb[weights] = (nbytes(model.params) - embedding) / 1e9
            print(f"{weights}: {read_gb[weights]:.2f} GB of weights read per step", flush=True)
        for kernels, layers in [(k, lay) for k in args.kernels for lay in args.layers]:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget of {args.budget_s} s spent: stopping", flush=True)
                return rows
            try:
                ms = step_ms(models[weights], batch, proposer_name, kernels, layers, args)
            except Exception as error:  # recorded, and the next case runs (`failed`)
                rows.append([weights, batch, proposer_name, kernels, layers, failed(error), "-", "-"])
                continue
            gb_s = read_gb[weights] / ms * 1e3
            rows.append([weights, batch, proposer_name, kernels, layers, ms, batch * 1e3 / ms, gb_s])
            print(rows[-1], flush=True)
    return rows


# -- goals ---------------------------------------------------------------------------------------


def goals(products: list[list], steps: list[list]) -> list[list]:
    """Each goal that what ran can decide: [what, measured ratio, goal, met?]. Products through
    the Pallas kernel at its default tile; steps with the first kernels and layers timed."""
    rows = []
    product_us = {(r[0], r[1], r[2]): r[4] for r in products if isinstance(r[4], float)}
    for (rows_n, kind, form), us in product_us.items():
        base = product_us.get((rows_n, "bfloat16", "dot"))
        if form == "pallas" and kind in PRODUCT_GOALS and base and rows_n in (1, 8):
            ratio = us / base
            rows.append(
                [
                    f"{kind} product / bfloat16's, {rows_n} rows",
                    ratio,
                    PRODUCT_GOALS[kind],
                    ratio <= PRODUCT_GOALS[kind],
                ]
            )
    step = {}  # (weights, batch, proposer) -> ms, of the first kernels and layers timed
    for weights, batch, proposer, _kernels, _layers, ms, *_ in steps:
        if isinstance(ms, float):
            step.setdefault((weights, batch, proposer), ms)
    for weights, goal in STEP_GOALS.items():
        if (weights, 1, "plain") in step and ("bfloat16", 1, "plain") in step:
            ratio = step[weights, 1, "plain"] / step["bfloat16", 1, "plain"]
            rows.append([f"{weights} step / bfloat16's, batch 1", ratio, goal, ratio <= goal])
    for weights in WEIGHTS:
        if (weights, 8, "verify-k4") in step and (weights, 8, "plain") in step:
            ratio = step[weights, 8, "verify-k4"] / step[weights, 8, "plain"]
            rows.append(
                [
                    f"{weights} verify of 5 tokens / plain step, batch 8",
                    ratio,
                    VERIFY_GOAL,
                    ratio <= VERIFY_GOAL,
                ]
            )
    return rows


HEADERS = {
    "check": ["head dim", "proposer", '"auto" = "xla" tokens', "= plain tokens", "accepted", "drafted"],
    "quantized-check": [
        "weights",
        "kernel's weights",
        "proposer",
        '"auto" = "xla" tokens',
        "= plain tokens",
        "accepted",
        "drafted",
    ],
    "products": ["rows", "weights", "written as", "tile", "us per product", "GB/s read"],
    "tiles": ["rows", "weights", "tile (stored rows, columns)", "us per product"],
    "time": [
        "weights",
        "batch",
        "proposer",
        "kernels",
        "layers",
        "ms per step",
        "tokens/s (plain) or steps/s x batch",
        "weight GB/s",
    ],
    "goals": ["goal", "measured", "at most", "met"],
}


class Report:
    """The tables as they are made: printed, and with --out written to accelerator_step.md and
    .json there after each part (a run cut short keeps the parts it finished)."""

    def __init__(self, out: str | None, preamble: str):
        self.out = None if out is None else Path(out)
        self.tables: dict[str, list[list]] = {}
        self.text = [preamble]
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, rows: list[list], caption: str) -> None:
        self.tables[name] = rows
        self.text.append(f"{caption}\n\n{markdown_table(HEADERS[name], rows)}")
        print("\n" + self.text[-1], flush=True)
        if self.out is not None:
            (self.out / "accelerator_step.md").write_text("\n\n".join(self.text) + "\n")
            (self.out / "accelerator_step.json").write_text(json.dumps(self.tables, default=str, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parts = ["products", "quantized-check", "time", "check"]
    parser.add_argument("--parts", nargs="+", default=parts[:3], choices=parts)
    parser.add_argument("--out", help="a folder for accelerator_step.md and .json (written after each part)")
    parser.add_argument(
        "--product-shape", type=int, nargs=2, default=[4096, 14336], metavar=("D_IN", "D_OUT")
    )
    parser.add_argument("--product-rows", type=int, nargs="+", default=[1, 8, 40])
    parser.add_argument(
        "--tile-rows", type=int, nargs="*", default=[1, 8], help="rows the other tiles are tried at"
    )
    parser.add_argument("--copies", type=int, default=8, help="distinct weights per products call")
    parser.add_argument(
        "--check-kernels",
        default="auto",
        help='"auto" on the device; "pallas:cuda" to try the checks on a CPU',
    )
    parser.add_argument(
        "--check-weights", nargs="+", default=["int8", "int4", "fp8"], choices=["int8", "int4", "fp8"]
    )
    parser.add_argument("--size", default="8b", choices=sorted(SIZES))
    parser.add_argument(
        "--cases", nargs="+", default=list(CASES), help="weights/batch/proposer, most needed first"
    )
    parser.add_argument(
        "--kernels", nargs="+", default=["auto"], choices=["auto", "xla", "pallas:cuda", "pallas:tpu"]
    )
    parser.add_argument(
        "--layers",
        nargs="+",
        default=["unrolled"],
        choices=["scanned", "unrolled"],
        help="decoder layers unrolled (the default everywhere) or as one loop over stacked weights",
    )
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--short-steps", type=int, default=8)
    parser.add_argument("--long-steps", type=int, default=136)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, default=240, help="time part: start no new case after this many seconds"
    )
    args = parser.parse_args(argv)
    for case in args.cases:
        parse_case(case)
    report = Report(args.out, f"machine: {machine()}; devices: {jax.devices()}; jax {jax.__version__}")
    print(report.text[0], flush=True)
    if "products" in args.parts:
        tables = time_products(args)
        d_in, d_out = args.product_shape
        caption = (
            f"{d_in} x {d_out} products, bfloat16 inputs, median of {args.repeats} over {args.copies} copies"
        )
        report.add("products", tables["products"], caption)
        report.add("tiles", tables["tiles"], "The Pallas product at other tiles")
    if "quantized-check" in args.parts:
        rows = quantized_check(args.check_kernels, args.check_weights)
        report.add("quantized-check", rows, f'Quantized tokens, kernels "{args.check_kernels}" against "xla"')
    if "time" in args.parts:
        rows = time_steps(args)
        caption = (
            f"random {args.size} model, prompt of {args.prompt_tokens} tokens, greedy, "
            f"{args.long_steps} - {args.short_steps} new tokens, median of {args.repeats}"
        )
        report.add("time", rows, caption)
    if "check" in args.parts:
        rows = check(args.check_kernels)
        report.add("check", rows, f'Attention kernels, "{args.check_kernels}" against "xla"')
    decided = goals(report.tables.get("products", []), report.tables.get("time", []))
    report.add("goals", decided, "Issue 67's timing goals, from what ran")


if __name__ == "__main__":
    main()
