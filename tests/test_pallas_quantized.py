"""The accelerators' quantized products (specjax/kernels/pallas_quantized.py) and FP8 products
(specjax/kernels/quantized.py, `fp8_product`), proven on this CPU:

- each Pallas kernel (TPU and GPU, in Pallas' interpreter) against a float64 numpy product of the
  dequantized weight: int8 with a scale per output channel and in groups, int4 in groups of 32
  and 128, the five GGUF blocks as they load (gguf-py's dequantization is their reference), over
  random shapes and 1, 3, 8, 64 rows (decoding, verify) and a prefill's blocked rows;
- the backend seam chooses them on "cuda" and "tpu" (XLA's form where a weight has no tile, on
  the CPU, and with kernels="xla");
- the whole loop with the kernels interpreted gives the XLA path's tokens on tiny quantized
  models, plainly and with n-gram and draft-model proposers, at batch 1 and 4;
- a quantized generation exports for CUDA and TPU with the kernels in it on one device and a
  data 2 x model 2 mesh, and no CPU custom call;
- FP8 weights as FP8 products: equal a float64 product of the e4m3-rounded activations, and
  export for CUDA as an f8 dot where the backend has FP8 products.
"""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from drafters import layered_target, noisy_copy
from test_export import assert_accelerator_program
from test_quantized import fp8_case, gguf_case
from tiny import tiny_model

import specjax
from specjax.kernels import backend as backends
from specjax.kernels import pallas_quantized
from specjax.kernels.quantized import QuantizedWeight, dequantize, fp8_product
from specjax.models.quantized import GGUF_FORMATS, quantize, quantize_params
from specjax.programs import clear_compiled_programs

IMPLEMENTATIONS = pallas_quantized.IMPLEMENTATIONS
ROWS = (1, 3, 8, 64)


def assert_close(got, want, rtol=1e-5, what=""):
    """|got - want| <= rtol * max |want|: the float32 accumulation's error against float64, relative
    to the product's scale."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, f"{what}: relative error {err:.3g}"


def random_weight(kind: str, rng: np.random.Generator) -> QuantizedWeight:
    """A weight of random shape (multiples of 16 outputs, of 128 inputs: what both kernels tile)
    in `kind`'s layout: "int8" one scale per output channel; "int8-g64" int8 in groups of 64 with
    random scales; "int4-g32" and "int4-g128" quantized from floats."""
    d_in = 128 * int(rng.integers(1, 6))
    d_out = 16 * int(rng.integers(1, 12))
    if kind == "int8-g64":
        values = rng.integers(-127, 128, (d_in, d_out)).astype(np.int8)
        scales = rng.uniform(0.5, 2.0, (d_in // 64, d_out)).astype(np.float32) * 1e-2
        return QuantizedWeight(values, scales, None, bits=8, group=64)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    if kind == "int8":
        return quantize(w, "int8")
    return quantize(w, "int4", int(kind.removeprefix("int4-g")))


FLOAT_KINDS = ("int8", "int8-g64", "int4-g32", "int4-g128")


def case(kind: str, seed: int) -> tuple[QuantizedWeight, np.ndarray]:
    """(the weight as device arrays, its float64 dequantization [D_in, D_out])."""
    if kind in GGUF_FORMATS:  # 512 inputs (two K-quant super-blocks), 48 outputs, as loaded
        w, reference = gguf_case(kind)
    else:
        w = random_weight(kind, np.random.default_rng(seed))
        reference = np.asarray(dequantize(jax.tree.map(jnp.asarray, w)), np.float64)
    return jax.tree.map(jnp.asarray, w), reference


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", FLOAT_KINDS + GGUF_FORMATS)
def test_each_kernel_equals_a_float64_product(kind, implementation):
    w, reference = case(kind, seed=len(kind))
    rng = np.random.default_rng(1)
    for rows in ROWS:
        x = rng.standard_normal((rows, w.shape[0])).astype(np.float32)
        got = pallas_quantized.quantized_matmul(
            jnp.asarray(x), w, implementation=implementation, interpret=True
        )
        assert got.dtype == jnp.float32
        assert_close(got, x.astype(np.float64) @ reference, what=f"{kind} {w.shape} at {rows} rows")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["int8", "int4-g32", "Q4_K"])
def test_prefill_rows_run_in_blocks(kind, implementation):
    """More rows than a decoding block (DECODE_ROWS): the blocked form, x padded to whole blocks of
    PREFILL_ROWS, given as [B, T, D_in] (the leading axes kept)."""
    w, reference = case(kind, seed=7)
    rows = pallas_quantized.PREFILL_ROWS[implementation] + 9
    assert rows > pallas_quantized.DECODE_ROWS
    assert (
        pallas_quantized.padded_rows(rows, implementation)[0] % pallas_quantized.PREFILL_ROWS[implementation]
        == 0
    )
    x = np.random.default_rng(2).standard_normal((rows, w.shape[0])).astype(np.float32)
    got = pallas_quantized.quantized_matmul(
        jnp.asarray(x.reshape(1, rows, -1)), w, implementation=implementation, interpret=True
    )
    assert got.shape == (1, rows, w.shape[1])
    assert_close(got[0], x.astype(np.float64) @ reference, what=f"{kind} at {rows} rows")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["int8-g64", "Q4_1"])
def test_bfloat16_rows_multiply_the_tile_in_bfloat16(kind, implementation):
    """bfloat16 x: each tile is dequantized in float32 and rounded once to bfloat16, then
    multiplied with float32 accumulation: a float64 product of the bfloat16-rounded operands."""
    w, reference = case(kind, seed=3)
    bf16 = ml_dtypes.bfloat16
    tile = np.asarray(dequantize(w), np.float32).astype(bf16).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((5, w.shape[0])).astype(bf16)
    got = pallas_quantized.quantized_matmul(
        jnp.asarray(x), w, implementation=implementation, interpret=True, out_dtype=jnp.float32
    )
    assert_close(got, x.astype(np.float64) @ tile, what=kind)
    assert (
        pallas_quantized.quantized_matmul(
            jnp.asarray(x), w, implementation=implementation, interpret=True
        ).dtype
        == jnp.bfloat16
    )


def test_tiles_hold_whole_groups():
    """A tile holds whole groups (scaled in registers) unless the weight has one group and no
    offsets; Triton's tiles are powers of two, TPU's multiples of (8, 128) or whole axes."""
    int4, _ = case("int4-g32", seed=0)
    rows, columns, groups = pallas_quantized.tiles(int4, "cuda")
    assert rows * 2 % 32 == 0 and groups == rows * 2 // 32 and rows & (rows - 1) == 0
    int8, _ = case("int8", seed=0)
    assert pallas_quantized.tiles(int8, "tpu")[2] == 1
    q6, _ = case("Q6_K", seed=0)  # 16 inputs a group
    rows, columns, groups = pallas_quantized.tiles(q6, "tpu")
    assert groups == rows // 16 and (groups % 8 == 0 or rows == 512) and columns == 48  # the whole axis


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_tile_named_gives_the_same_product(implementation):
    """`tile=` (what the accelerator benchmark compares on a device) replaces the largest tile
    that fits; the product stays the float64 one, and a tile the kernel cannot take is refused by
    name. The weight is 512 x 256 in groups of 32: [256, 256] stored."""
    floats = np.random.default_rng(2).standard_normal((512, 256)).astype(np.float32)
    w = jax.tree.map(jnp.asarray, quantize(floats, "int4", 32))
    reference = np.asarray(dequantize(w), np.float64)
    x = np.random.default_rng(3).standard_normal((3, 512)).astype(np.float32)
    small = (128, 128) if implementation == "tpu" else (16, 32)
    assert pallas_quantized.tiles(w, implementation, small) == (*small, small[0] * 2 // 32)
    assert pallas_quantized.tiles(w, implementation, small) != pallas_quantized.tiles(w, implementation)
    got = pallas_quantized.quantized_matmul(
        jnp.asarray(x), w, implementation=implementation, interpret=True, tile=small
    )
    assert_close(got, x.astype(np.float64) @ reference, what=f"tile {small}")
    bad = (96, 128) if implementation == "cuda" else (96, 256)  # not a power of two / not a multiple of 128
    refused = rf"tile=\(96, {bad[1]}\) does not fit values \(256, 256\) in 16 groups"
    with pytest.raises(ValueError, match=refused):
        pallas_quantized.quantized_matmul(jnp.asarray(x), w, implementation=implementation, tile=bad)
    for odd in [(0, 128), (128,), (128.0, 128)]:
        with pytest.raises(
            ValueError, match=r"tile must be \(stored rows, output columns\), two positive ints"
        ):
            pallas_quantized.quantized_matmul(jnp.asarray(x), w, implementation=implementation, tile=odd)
    with pytest.raises(ValueError, match=r"tile=\(512, 128\) does not fit"):  # more rows than stored
        pallas_quantized.quantized_matmul(jnp.asarray(x), w, implementation=implementation, tile=(512, 128))


def test_bad_input_is_refused_by_name():
    w, _ = case("int4-g32", seed=0)
    x = jnp.ones((2, w.shape[0]))
    with pytest.raises(ValueError, match=r"implementation is 'gpu'; allowed: \('tpu', 'cuda'\)"):
        pallas_quantized.quantized_matmul(x, w, implementation="gpu")
    with pytest.raises(ValueError, match=rf"x has 3 features, the weight {w.shape[0]} inputs"):
        pallas_quantized.quantized_matmul(jnp.ones((2, 3)), w, implementation="tpu", interpret=True)
    with pytest.raises(ValueError, match="x must be floating point, got int32"):
        pallas_quantized.quantized_matmul(x.astype(jnp.int32), w, implementation="tpu", interpret=True)
    fp8, _ = fp8_case()
    with pytest.raises(ValueError, match="does not fit the tpu kernel: FP8 values run as XLA's FP8 product"):
        pallas_quantized.quantized_matmul(x, jax.tree.map(jnp.asarray, fp8), implementation="tpu")
    odd = jax.tree.map(jnp.asarray, quantize(np.ones((64, 97), np.float32), "int4", 32))  # 97 outputs
    with pytest.raises(ValueError, match=r"does not fit the cuda kernel: no tile fits values \(32, 97\)"):
        pallas_quantized.quantized_matmul(jnp.ones((1, 64)), odd, implementation="cuda")
    assert pallas_quantized.unsupported(odd, "tpu") is None  # a whole axis is a TPU tile


# ---------------------------------------------------------------------------------------------
# The backend seam


def custom_calls_of(exported: jax.export.Exported, kernel: str) -> dict[str, int]:
    """How many custom calls of each target in an exported module name Pallas kernel `kernel`."""
    counts: dict[str, int] = {}
    for line in exported.mlir_module().splitlines():
        if "custom_call" in line and kernel in line:
            target = (
                re.findall(r"custom_call @([\w.$]+)", line)
                or re.findall(r'call_target_name = "([^"]+)"', line)
            )[0]
            counts[target] = counts.get(target, 0) + 1
    return counts


TRITON = "__gpu$xla.gpu.triton"


def export_product(backend: backends.Backend, w, rows: int = 2, dtype=jnp.bfloat16) -> jax.export.Exported:
    def product(x, w):
        with backend.tracing():
            return backend.matmul(x, w)

    x = jax.ShapeDtypeStruct((rows, w.shape[0]), dtype)
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    return jax.export.export(jax.jit(product), platforms=backend.platforms, disabled_checks=checks)(x, w)


def test_the_seam_runs_each_accelerators_kernel():
    w, _ = case("int4-g128", seed=1)
    both = export_product(backends.Backend(("cuda", "tpu"), portable=True), w)
    assert custom_calls_of(both, "specjax_quantized_matmul") == {TRITON: 1, "tpu_custom_call": 1}
    plain = export_product(backends.Backend(("cuda", "tpu"), kernels="xla"), w)
    assert custom_calls_of(plain, "specjax_quantized_matmul") == {}
    # A weight Triton has no tile for: XLA's form on CUDA, the kernel on TPU.
    odd = jax.tree.map(jnp.asarray, quantize(np.ones((64, 97), np.float32), "int4", 32))
    assert backends.Backend(("cuda",)).quantized_kernel_for("cuda", odd) is None
    assert custom_calls_of(
        export_product(backends.Backend(("cuda", "tpu")), odd), "specjax_quantized_matmul"
    ) == {"tpu_custom_call": 1}
    # The CPU keeps XLA's form for a QuantizedWeight (its own kernels read panels); "pallas:tpu"
    # interprets the TPU kernel there.
    assert backends.Backend(("cpu",)).quantized_kernel_for("cpu", w) is None
    assert backends.Backend(("cpu",), kernels="pallas:tpu").quantized_kernel_for("cpu", w) == ("tpu", True)


@pytest.mark.parametrize("kernels", ["pallas:tpu", "pallas:cuda"])
def test_the_seams_products_equal_xlas(kernels):
    """matmul and product_f32 through the seam, interpreted kernels against XLA's form."""
    w, reference = case("Q4_0", seed=0)
    x = np.random.default_rng(5).standard_normal((3, w.shape[0])).astype(np.float32)
    on = backends.Backend(("cpu",), kernels=kernels)
    with on.tracing():
        assert_close(jax.jit(on.matmul)(x, w), x.astype(np.float64) @ reference)
        assert on.product_f32(x.astype(jnp.bfloat16), w).dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# The whole loop


def quantized_target(kind: str) -> specjax.Model:
    """A tiny target whose every product has a tile on both kernels (64 hidden, 128 wide MLP and
    vocab), quantized `kind`."""
    target = layered_target(seed=21, num_layers=2, intermediate_size=128, vocab_size=128)
    return specjax.Model(target.config, quantize_params(target.params, kind, 32 if kind == "int4" else None))


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], [4] * 20]


def proposer_for(name: str):
    if name == "plain":
        return None
    if name == "ngram":
        return specjax.NGram(k=3)
    target = layered_target(seed=21, num_layers=2, intermediate_size=128, vocab_size=128)
    draft = noisy_copy(target, noise=0.05)
    return specjax.DraftModel(specjax.Model(draft.config, quantize_params(draft.params, "int8")), k=3)


# The default set: a ragged n-gram batch on the TPU kernels and plain decoding on the GPU ones;
# the rest (a draft model's batch of 4 on the GPU kernels: about 40 s here) in make test-all.
LOOP_DEFAULT = {("ngram", "int4", "pallas:tpu", 4), ("plain", "int4", "pallas:cuda", 1)}
LOOP_CASES = [
    pytest.param(
        name,
        kind,
        kernels,
        batch,
        marks=() if (name, kind, kernels, batch) in LOOP_DEFAULT else pytest.mark.slow,
    )
    for name in ("plain", "ngram", "draft")
    for kind in ("int8", "int4")
    for kernels in ("pallas:tpu", "pallas:cuda")
    for batch in (1, 4)
]


@pytest.mark.parametrize("name, kind, kernels, batch", LOOP_CASES)
def test_the_loop_with_interpreted_kernels_equals_xla(name, kind, kernels, batch, monkeypatch):
    model, proposer = quantized_target(kind), proposer_for(name)
    traced = []
    kernel = pallas_quantized.quantized_matmul

    def counted(*args, **kwargs):
        traced.append(kwargs["implementation"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(pallas_quantized, "quantized_matmul", counted)
    clear_compiled_programs()  # trace again: the kernels' calls are counted as they are traced
    options = dict(proposer=proposer, max_new_tokens=12)
    want = specjax.generate(model, PROMPTS[-batch:], kernels="xla", **options)
    assert not traced
    got = specjax.generate(model, PROMPTS[-batch:], kernels=kernels, **options)
    assert traced and set(traced) == {kernels.removeprefix("pallas:")}
    assert got.tokens == want.tokens
    summary, reference = got.metrics.summary(), want.metrics.summary()
    assert summary["num_accepted_tokens"] == reference["num_accepted_tokens"]
    if proposer is not None and batch == 4:  # ragged: some drafts accepted, some rejected
        assert 0 < reference["acceptance_rate"] < 1, reference


def every_proposer_case(name: str):
    """(the float target, a proposer) for every kind of proposer state (test_engine_pages's cases),
    Medusa with an untrained head (training one is not the point here). The MLP speculator, which
    those cases train for 300 steps, is left out: it drafts like Medusa's heads, from features."""
    from test_engine_pages import PREFIX_CASES, TARGET

    if name == "medusa-tree":
        head = specjax.models.MedusaHead.init(TARGET, num_heads=2)
        return TARGET, specjax.Medusa(head, tree=specjax.TokenTree.top_k((2, 2)))
    return PREFIX_CASES[name]()


EVERY_PROPOSER = (
    "ngram",
    "eagle-tree",
    "draft-model",
    "draft-from-target",
    "self-draft",
    "eagle3",
    "mtp",
    "dflash",
    "medusa-tree",
)


@pytest.mark.slow
@pytest.mark.parametrize("name", EVERY_PROPOSER)
def test_every_proposer_on_a_quantized_target_equals_xla(name, monkeypatch):
    """Each kind of proposer (its own cache, features, trees, MTP layers, DFlash blocks) drafting
    for a target quantized to int4 (groups of 32): with the GPU's kernels interpreted, the tokens
    and accepted drafts of a ragged batch of 4 are XLA's."""
    target, proposer = every_proposer_case(name)
    quantized = quantize_params(target.params, "int4", 32)  # (an MTP target's own layers kept)
    model = dataclasses.replace(target, params=quantized, name=f"{target.name}-int4")
    traced = []
    kernel = pallas_quantized.quantized_matmul
    monkeypatch.setattr(
        pallas_quantized,
        "quantized_matmul",
        lambda *a, **k: traced.append(k["implementation"]) or kernel(*a, **k),
    )
    clear_compiled_programs()
    options = dict(proposer=proposer, max_new_tokens=12)
    want = specjax.generate(model, PROMPTS, kernels="xla", **options)
    got = specjax.generate(model, PROMPTS, kernels="pallas:cuda", **options)
    assert traced and set(traced) == {"cuda"}
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(got.metrics.accepted_at, want.metrics.accepted_at)
    accepted, drafted = int(np.sum(want.metrics.accepted)), int(np.sum(want.metrics.drafted))
    assert 0 < accepted < drafted, (accepted, drafted)  # acceptance ragged across the batch


# ---------------------------------------------------------------------------------------------
# Export


def export_target(kind: str) -> specjax.Model:
    """Head dim 64 (the attention kernels' size on a device), 2 kv heads (to split over a model
    axis of 2), 256-wide MLP and vocab."""
    base = tiny_model(
        seed=3,
        hidden_size=256,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        intermediate_size=256,
        vocab_size=256,
    )
    return specjax.Model(base.config, quantize_params(base.params, kind, 32 if kind == "int4" else None))


@pytest.mark.parametrize("kind, mesh", [("int4", None), ("int8", (2, 2))])
def test_a_quantized_generation_exports_with_the_kernels(kind, mesh):
    """Every product of the program (qkv, o, gate, up, down, the head; prefill and decoding)
    through each platform's kernel, as many on CUDA as on TPU; on a data 2 x model 2 mesh the
    kernels multiply each device's slice (scales split with their weights)."""
    model = export_target(kind)
    if mesh is not None:
        mesh = specjax.sharding.make_mesh(data=mesh[0], model=mesh[1])
    exported = specjax.export_generate(
        model, PROMPTS[:2], proposer=specjax.NGram(k=3), max_new_tokens=6, mesh=mesh
    )
    assert exported.platforms == ("cuda", "tpu")
    assert exported.nr_devices == (1 if mesh is None else 4)
    assert_accelerator_program(exported)
    calls = custom_calls_of(exported, "specjax_quantized_matmul")
    assert set(calls) == {TRITON, "tpu_custom_call"} and calls[TRITON] == calls["tpu_custom_call"], calls
    # 5 products a layer (qkv, o, gate, up, down), and the head outside a mesh's shard_map (there
    # XLA partitions it), in the prefill and the decoding passes at least
    per_pass = 5 * model.config.num_layers + (mesh is None)
    assert calls[TRITON] >= 2 * per_pass, calls


# ---------------------------------------------------------------------------------------------
# FP8


def fp8_reference(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """x @ W in float64 with x rounded as `fp8_product` defines it: per row and group of inputs,
    scaled to max |x| = 448 and rounded to e4m3; W the FP8 values times their scales."""
    groups = w.scales.shape[0]
    grouped = x.astype(np.float32).reshape(x.shape[0], groups, -1)
    amax = np.abs(grouped).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    rounded = (grouped / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    return rounded.reshape(x.shape) @ np.asarray(dequantize(w), np.float64)


def test_fp8_products_equal_a_float64_product_of_the_rounded_rows():
    w, _ = fp8_case()  # 512 inputs: 4 groups of 128
    w = jax.tree.map(jnp.asarray, w)
    x = np.random.default_rng(6).standard_normal((6, w.shape[0])).astype(np.float32)
    x[2] = 0.0  # a row of zeros keeps its scale finite
    got = jax.jit(fp8_product)(x, w)
    assert_close(got, fp8_reference(x, w))
    on = backends.Backend(("cuda",), fp8_products=True)
    with on.tracing():
        assert_close(jax.jit(on.matmul)(x, w), fp8_reference(x, w))
    one = jax.tree.map(jnp.asarray, quantize(np.ones((128, 32), np.float32), "fp8"))  # one group
    assert_close(fp8_product(x[:, :128], one), fp8_reference(x[:, :128], one))


def f8_dots(exported: jax.export.Exported) -> list[str]:
    dots = re.findall(r"stablehlo\.dot_general[^\n]*", exported.mlir_module())
    return [d for d in dots if d.count("f8E4M3FN>") >= 2]  # both operands e4m3


def test_fp8_exports_for_cuda_as_an_f8_dot_where_the_gpu_has_them():
    w = jax.tree.map(jnp.asarray, fp8_case()[0])
    assert f8_dots(export_product(backends.Backend(("cuda",), fp8_products=True), w))
    assert not f8_dots(export_product(backends.Backend(("cuda",)), w))  # elsewhere: as today
    with pytest.raises(ValueError, match="fp8_products must be True or False, got 'yes'"):
        backends.Backend(("cuda",), fp8_products="yes")


def fake_gpu(capability: str):
    client = types.SimpleNamespace(platform_version="PJRT C API\ncuda 12080")
    return types.SimpleNamespace(platform="gpu", client=client, compute_capability=capability)


def test_fp8_products_follow_the_gpus_compute_capability():
    assert backends.has_fp8_products(fake_gpu("9.0")) and backends.has_fp8_products(fake_gpu("8.9"))
    assert not backends.has_fp8_products(fake_gpu("8.0")) and not backends.has_fp8_products(fake_gpu(None))
    assert backends.for_devices([fake_gpu("9.0")]).fp8_products
    assert not backends.for_devices([fake_gpu("9.0")], kernels="xla").fp8_products
    assert not backends.for_devices(jax.devices()[:1]).fp8_products  # this CPU
