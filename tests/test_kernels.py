"""The CPU decoding kernel (specjax/kernels): panel products against float64 numpy, the packed
model against the plain one, and generate's use of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_config, tiny_model

import specjax
from specjax import api, kernels
from specjax.models import forward, init_cache, init_params
from specjax.models.llama import lm_head, with_panel_weights


@pytest.fixture(scope="module", autouse=True)
def kernel_loaded():
    # Not a skip: where this machine's compiler cannot build the kernel, these tests fail.
    assert kernels.available(), "the CPU kernel did not build (see the warning above)"


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("d_in, d_out", [(64, 32), (48, 40), (7, 16), (96, 200)])
def test_panel_matmul_equals_the_float64_product(rows, d_in, d_out):
    """Every row count the kernel's chunking meets (up to 8 rows a chunk, 9 as 5 + 4, 40 as five
    chunks), output widths that are a whole number of panel pairs, an odd panel count (40: a lone
    last panel), and widths padded to a panel (40, 200)."""
    rng = np.random.default_rng(rows * 1000 + d_in + d_out)
    x = rng.standard_normal((rows, d_in)).astype(np.float32)
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    got = np.asarray(jax.jit(kernels.panel_matmul)(jnp.asarray(x), kernels.pack(w)))
    assert got.shape == (rows, d_out) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_panel_matmul_keeps_leading_axes_and_rows_apart():
    """x [B, T, D_in] keeps its leading axes; each row's result is what it gets alone, bit for bit
    (rows never mix, whichever chunk they fall in)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    w = kernels.pack(rng.standard_normal((64, 48)).astype(np.float32))
    got = np.asarray(jax.jit(kernels.panel_matmul)(jnp.asarray(x), w))
    assert got.shape == (2, 5, 48)
    for b in range(2):
        for t in range(5):
            alone = np.asarray(kernels.panel_matmul(jnp.asarray(x[b, t][None]), w))[0]
            np.testing.assert_allclose(got[b, t], alone, rtol=1e-6, atol=1e-6)


def test_pack_round_trips_and_lays_out_panels():
    w = np.arange(5 * 35, dtype=np.float32).reshape(5, 35)
    packed = kernels.pack(w)
    assert packed.panels.shape == (3, 5, 16) and packed.shape == (5, 35)
    np.testing.assert_array_equal(np.asarray(packed.panels[1, 2]), w[2, 16:32])  # panel 1, input row 2
    np.testing.assert_array_equal(np.asarray(packed.panels[2, 0, 3:]), 0)  # padding past column 35
    np.testing.assert_array_equal(np.asarray(kernels.unpack(packed)), w)


@pytest.mark.parametrize("tied", [True, False])
def test_panel_params_give_the_plain_models_logits(tied):
    """A forward pass over 1, 3 and 9 new tokens with every projection and the head as panels
    equals the same pass with XLA's products (float32 sums in another order: 1e-5)."""
    model = tiny_model(seed=11, tie_word_embeddings=tied)
    packed = with_panel_weights(model.params)
    config = model.config
    for num_tokens in (1, 3, 9):
        rng = np.random.default_rng(num_tokens)
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, num_tokens)))
        positions = jnp.broadcast_to(jnp.arange(num_tokens), (2, num_tokens))
        cache = init_cache(config, batch_size=2, capacity=32)
        want, _, _ = jax.jit(forward, static_argnums=1)(model.params, config, tokens, positions, cache)
        got, _, _ = jax.jit(forward, static_argnums=1)(packed, config, tokens, positions, cache)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((4, config.hidden_size)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(lm_head(packed, hidden)), np.asarray(lm_head(model.params, hidden)), rtol=1e-5, atol=1e-5
    )


def test_generate_decodes_through_the_kernel(monkeypatch):
    """On the CPU, generate multiplies with panels (the packed params, made once per params
    object, reach the compiled program) and gives the tokens XLA's products give; with
    SPECJAX_CPU_KERNEL=0 it keeps the plain params."""
    model = tiny_model(seed=2)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    seen = []
    real = api._compiled

    def compiled(spec, params, *rest):
        seen.append(params)
        return real(spec, params, *rest)

    monkeypatch.setattr(api, "_compiled", compiled)
    with_kernel = specjax.generate(model, prompts, max_new_tokens=12)
    again = specjax.generate(model, prompts, proposer=specjax.NGram(k=3), max_new_tokens=12)
    monkeypatch.setenv("SPECJAX_CPU_KERNEL", "0")
    without = specjax.generate(model, prompts, max_new_tokens=12)
    assert with_kernel.tokens == without.tokens == again.tokens
    assert isinstance(seen[0].layers[0].qkv, kernels.PanelWeight) and seen[0].head_panels is not None
    assert seen[1] is seen[0]  # packed once for these params
    assert seen[2] is model.params


def test_a_missing_compiler_is_an_error_that_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(FileNotFoundError, match="no-such-compiler"):
        kernels._build()


def test_training_shapes_are_untouched():
    """init_params still gives plain arrays: only with_panel_weights makes panels."""
    params = init_params(tiny_config(), jax.random.key(0))
    assert isinstance(params.layers[0].qkv, jax.Array) and params.head_panels is None
