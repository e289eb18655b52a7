"""The CPU kernel for quantized weights (specjax/kernels/quant_matmul.cc) against float64 numpy
products with the dequantized weight, its panel layout, its errors, and a model whose projections
and head are quantized panels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

from specjax import kernels
from specjax.kernels.layouts import PANEL_FIELDS, GateUpPanels, with_panel_weights
from specjax.kernels.quantized import (
    QuantizedPanelWeight,
    QuantizedWeight,
    dequantize,
    pack_quantized,
    quantized_panel_matmul,
    unpack_quantized,
)
from specjax.models import forward, init_cache
from specjax.models.llama import lm_head


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded():
    # Not a skip: where this machine's compiler cannot build the kernel, these tests fail.
    assert kernels.available(), "the CPU kernel did not build (see the warning above)"


def random_weight(rng, d_in: int, d_out: int, bits: int, group: int, offsets: bool) -> QuantizedWeight:
    """Every integer value the width allows, scales of varied size, offsets of either sign."""
    if bits == 8:
        values = rng.integers(-128, 128, (d_in, d_out)).astype(np.int8)
    else:
        values = rng.integers(0, 256, (d_in // 2, d_out)).astype(np.uint8)
    scales = rng.uniform(0.001, 0.1, (d_in // group, d_out)).astype(np.float32)
    shifts = rng.standard_normal((d_in // group, d_out)).astype(np.float32) if offsets else None
    return QuantizedWeight(
        jnp.asarray(values), jnp.asarray(scales), None if shifts is None else jnp.asarray(shifts), bits, group
    )


def check_product(x: np.ndarray, w: QuantizedWeight, got: np.ndarray) -> None:
    """got equals x @ dequantize(w) in float64 within 1e-5 of the sum of the terms' sizes (a dot
    product's float32 rounding grows with those, not with the result, which may cancel to 0)."""
    weight = np.asarray(dequantize(w), np.float64)
    want = x.astype(np.float64) @ weight
    scale = np.abs(x.astype(np.float64)) @ np.abs(weight)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= 1e-5 * scale), np.max(np.abs(got - want) / scale)


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group, d_in, d_out", [(16, 256, 40), (32, 256, 200), (128, 256, 33), (96, 96, 16)])
def test_the_kernel_equals_the_float64_product(bits, offsets, group, d_in, d_out):
    """Every row count of a decoding step and its chunks (1 to 9: one row, two, chunks of 2 and 3),
    and the panels dequantized first from 24 rows (with AVX-512 from 16 rows of 4-bit: 15, 16,
    23, 24, 25 and a prefill's 64, past 48 rows a group); groups of 16, 32, 128 and the whole
    input (one group, a scale per output channel); widths that are not whole panels (40, 33,
    200) or one panel (16)."""
    rng = np.random.default_rng([bits, group, d_in, d_out, offsets])
    w = random_weight(rng, d_in, d_out, bits, group, offsets)
    packed = pack_quantized(w)
    product = jax.jit(quantized_panel_matmul)
    for rows in (*range(1, 10), 15, 16, 23, 24, 25, 64):
        x = rng.standard_normal((rows, d_in)).astype(np.float32)
        check_product(x, w, np.asarray(product(jnp.asarray(x), packed)))


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_kernel_norms_its_rows_and_adds_a_residual(bits, offsets):
    """With `norm` and `residual` (specjax.kernels.around) the product is float64 numpy's of the
    RMS-normed rows, plus the residual, for one row, chunks and the dequantize-first path (24
    and 64 rows), at a width that is no whole panel."""
    rng = np.random.default_rng([bits, offsets, 7])
    d_in, d_out = 256, 40
    w = random_weight(rng, d_in, d_out, bits, 32, offsets)
    weight = rng.uniform(0.5, 1.5, d_in).astype(np.float32)

    @jax.jit
    def product(x, w, weight, residual):  # (eps is the kernel's attribute: not traced)
        return quantized_panel_matmul(x, w, (weight, 1e-6), residual)

    for rows in (1, 5, 24, 64):
        x = rng.standard_normal((rows, d_in)).astype(np.float32) * 3
        residual = rng.standard_normal((rows, d_out)).astype(np.float32)
        got = product(jnp.asarray(x), pack_quantized(w), jnp.asarray(weight), jnp.asarray(residual))
        x64 = x.astype(np.float64)
        normed = weight * x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6)
        check_product(normed, w, np.asarray(got) - residual)


def test_an_odd_input_size_in_one_int8_group():
    """int8 with one group over an odd D_in: the kernel's pairs of input rows leave one over."""
    rng = np.random.default_rng(5)
    w = random_weight(rng, 75, 24, bits=8, group=75, offsets=True)
    for rows in (1, 2, 7, 24, 31):  # (from 24 rows the panels are dequantized first)
        x = rng.standard_normal((rows, 75)).astype(np.float32)
        check_product(x, w, np.asarray(quantized_panel_matmul(jnp.asarray(x), pack_quantized(w))))


def test_leading_axes_are_kept_and_rows_never_mix():
    """x [B, T, D_in] keeps its leading axes, and each row gets what it gets beside other rows:
    6 rows (chunks of 2) as each row alone, to float32 rounding (one row takes the pair loop);
    16 rows (dequantized first where the CPU has AVX-512) as the same rows in reverse order, bit
    for bit (the same loops for every row)."""
    rng = np.random.default_rng(3)
    packed = pack_quantized(random_weight(rng, 64, 48, bits=4, group=32, offsets=True))
    product = jax.jit(quantized_panel_matmul)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    got = np.asarray(product(jnp.asarray(x), packed))
    assert got.shape == (2, 3, 48)
    for b in range(2):
        for t in range(3):
            alone = np.asarray(quantized_panel_matmul(jnp.asarray(x[b, t][None]), packed))[0]
            np.testing.assert_allclose(got[b, t], alone, rtol=1e-6, atol=1e-6)
    x = rng.standard_normal((2, 8, 64)).astype(np.float32)
    got = np.asarray(product(jnp.asarray(x), packed))
    reversed_rows = np.asarray(product(jnp.asarray(x.reshape(16, 64)[::-1].copy()), packed))
    assert got.shape == (2, 8, 48)
    np.testing.assert_array_equal(got.reshape(16, 48), reversed_rows[::-1])


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_lays_out_panels_and_round_trips(bits):
    rng = np.random.default_rng(bits)
    w = random_weight(rng, 64, 35, bits, group=16, offsets=True)
    packed = pack_quantized(w)
    rows = 64 * bits // 8
    assert isinstance(packed, QuantizedPanelWeight) and packed.shape == (64, 35)
    assert packed.values.shape == (3, rows, 16) and packed.scales.shape == (3, 4, 16)
    assert packed.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    np.testing.assert_array_equal(packed.values[1, 2], np.asarray(w.values)[2, 16:32])  # panel 1, row 2
    np.testing.assert_array_equal(packed.offsets[2, 3, :3], np.asarray(w.offsets)[3, 32:35])
    for padding in (packed.values[2, :, 3:], packed.scales[2, :, 3:], packed.offsets[2, :, 3:]):
        np.testing.assert_array_equal(padding, 0)  # columns past 35
    back = unpack_quantized(packed)
    assert (back.bits, back.group) == (bits, 16)
    for name in ("values", "scales", "offsets"):
        np.testing.assert_array_equal(getattr(back, name), getattr(w, name))
    assert unpack_quantized(pack_quantized(w.replace(offsets=None))).offsets is None


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_scales_that_are_float16_are_packed_as_float16(bits, offsets):
    """Scales and offsets that are all float16 values (GGUF's Q8_0, Q4_0 and Q4_1 store theirs so)
    are packed as float16, half the bytes, and give the same products; one that is not keeps all
    of them float32."""
    rng = np.random.default_rng([bits, offsets, 16])
    w = random_weight(rng, 256, 200, bits, group=32, offsets=offsets)
    halves = jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32), (w.scales, w.offsets))
    w = w.replace(scales=halves[0], offsets=halves[1])
    packed = pack_quantized(w)
    assert packed.scales.dtype == jnp.float16
    assert packed.offsets is None or packed.offsets.dtype == jnp.float16
    back = unpack_quantized(packed)
    np.testing.assert_array_equal(back.scales, w.scales)
    assert back.scales.dtype == jnp.float32
    if offsets:
        np.testing.assert_array_equal(back.offsets, w.offsets)
    product = jax.jit(quantized_panel_matmul)
    for rows in (1, 2, 3, 6, 64):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        check_product(x, w, np.asarray(product(jnp.asarray(x), packed)))
    # one scale that float16 cannot hold: everything stays float32
    odd = w.replace(scales=w.scales.at[3, 7].set(np.float32(1 / 3)))
    kept = pack_quantized(odd)
    assert kept.scales.dtype == jnp.float32 and (kept.offsets is None or kept.offsets.dtype == jnp.float32)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    check_product(x, odd, np.asarray(product(jnp.asarray(x), kept)))


def test_unsupported_shapes_are_clear_errors():
    rng = np.random.default_rng(0)
    w = random_weight(rng, 96, 16, bits=8, group=32, offsets=False)
    with pytest.raises(ValueError, match="group 64 does not divide D_in 96"):
        pack_quantized(w.replace(scales=w.scales[:1], group=64))
    odd = random_weight(rng, 6, 16, bits=4, group=3, offsets=True)
    with pytest.raises(ValueError, match="group 3 does not divide D_in 6 into groups of an even size"):
        pack_quantized(odd)
    stacked = w.replace(values=w.values[None], scales=w.scales[None])
    with pytest.raises(ValueError, match="a 2-D weight"):
        pack_quantized(stacked)
    with pytest.raises(ValueError, match="x has 95 features, the weight 96"):
        quantized_panel_matmul(jnp.zeros((1, 95)), pack_quantized(w))


def quantize(w: jax.Array, bits: int, group: int) -> QuantizedWeight:
    """A float weight [D_in, D_out] rounded to `bits` (int8 symmetric, 4-bit with offsets) with one
    scale per group of input rows: only this test's model needs it."""
    w = np.asarray(w, np.float32)
    d_in, d_out = w.shape
    blocks = w.reshape(d_in // group, group, d_out)
    if bits == 8:
        scales = np.maximum(np.abs(blocks).max(1), 1e-8) / 127
        q = np.round(blocks / scales[:, None]).astype(np.int8).reshape(d_in, d_out)
        return QuantizedWeight(jnp.asarray(q), jnp.asarray(scales), None, 8, group)
    low, high = blocks.min(1), blocks.max(1)
    scales = np.maximum(high - low, 1e-8) / 15
    q = np.round((blocks - low[:, None]) / scales[:, None]).astype(np.uint8).reshape(d_in, d_out)
    values = q[0::2] | (q[1::2] << 4)
    return QuantizedWeight(jnp.asarray(values), jnp.asarray(scales), jnp.asarray(low), 4, group)


def test_gate_and_up_stored_differently_stay_two_products():
    """A GGUF file may store a layer's gate and up in different types: gate int8 and up 4-bit (or
    up float32) are not fused, each keeps its own panels, and the logits equal the model's with
    those weights dequantized."""
    model = tiny_model(seed=7)
    layers = []
    for i, layer in enumerate(model.params.layers):
        up = quantize(layer.up, 4, 32) if i == 0 else layer.up
        layers.append(layer.replace(gate=quantize(layer.gate, 8, layer.gate.shape[0]), up=up))
    params = model.params.replace(layers=tuple(layers))
    packed = with_panel_weights(params)
    assert isinstance(packed.layers[0].gate, QuantizedPanelWeight) and packed.layers[0].gate.bits == 8
    assert isinstance(packed.layers[0].up, QuantizedPanelWeight) and packed.layers[0].up.bits == 4
    assert isinstance(packed.layers[1].up, kernels.PanelWeight)
    plain = jax.tree.map(
        lambda w: dequantize(w) if isinstance(w, QuantizedWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, QuantizedWeight),
    )
    config = model.config
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 3)))
    positions = jnp.broadcast_to(jnp.arange(3), (2, 3))
    cache = init_cache(config, batch_size=2, capacity=16)
    want, _, _ = jax.jit(forward, static_argnums=1)(plain, config, tokens, positions, cache)
    got, _, _ = jax.jit(forward, static_argnums=1)(packed, config, tokens, positions, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_quantized_panels_give_the_dequantized_models_logits(bits, group):
    """A model whose projections and head are QuantizedWeights, packed by with_panel_weights,
    gives the logits of the same model with those weights dequantized to float32 arrays and XLA's
    products (float32 sums in another order: 1e-5)."""
    model = tiny_model(seed=4)
    params = model.params

    def quantized(w):
        return quantize(w, bits, group or w.shape[0])

    layers = tuple(
        layer.replace(**{name: quantized(getattr(layer, name)) for name in PANEL_FIELDS})
        for layer in params.layers
    )
    params = params.replace(layers=layers, lm_head=quantized(params.lm_head))
    packed = with_panel_weights(params)
    assert isinstance(packed.layers[0].qkv, QuantizedPanelWeight)
    fused = packed.layers[0].gate  # gate and up quantized alike: one panel weight
    assert isinstance(fused, GateUpPanels) and isinstance(fused.both, QuantizedPanelWeight)
    assert isinstance(packed.head_panels, QuantizedPanelWeight) and packed.head_panels.bits == bits
    plain = jax.tree.map(
        lambda w: dequantize(w) if isinstance(w, QuantizedWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, QuantizedWeight),
    )
    config = model.config
    for num_tokens in (1, 6):
        rng = np.random.default_rng(num_tokens)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, num_tokens)))
        positions = jnp.broadcast_to(jnp.arange(num_tokens), (2, num_tokens))
        cache = init_cache(config, batch_size=2, capacity=32)
        want, _, _ = jax.jit(forward, static_argnums=1)(plain, config, tokens, positions, cache)
        got, _, _ = jax.jit(forward, static_argnums=1)(packed, config, tokens, positions, cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((4, config.hidden_size)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(lm_head(packed, hidden)), np.asarray(lm_head(plain, hidden)), rtol=1e-5, atol=1e-5
    )
