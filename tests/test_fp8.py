"""FP8 checkpoints as released (DeepSeek-V3, the Qwen3 FP8 releases): float8_e4m3fn weights with
`weight_scale_inv` block scales, kept as FP8 (models/quantized.py, `from_fp8`).

- `from_fp8` and its products against a float64 numpy formula: blocks that do not divide the
  weight (the last ones partial, as FP8Linear allows) and one scale per tensor.
- A tiny llama (and qwen3) HF folder whose projections torch quantized to e4m3 blocks, as the
  releases store them: its logits equal transformers' loading the same folder (FineGrainedFP8Config
  dequantize=True), its greedy tokens transformers' greedy tokens.
- quantization="int8" / "int4" from an FP8 folder requantizes the dequantized weights; what is not
  read is refused by name; a faked mesh splits the block scales with their weights.
(Speculative decoding on FP8 weights and the export for CUDA and TPU: tests/test_quantized.py.)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quantized import PROMPTS, assert_close

import specjax
from specjax.kernels import backend as backends
from specjax.kernels.layouts import pack_panels
from specjax.kernels.quantized import PRODUCT_FORMS, QuantizedWeight, dequantize, is_fp8, xla_product
from specjax.models import Model, forward, init_cache
from specjax.models.quantized import FP8_DTYPE, from_fp8, nbytes, quantize, quantize_params

RNG = np.random.default_rng(3)
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def block_reference(values: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """W [out, in] in float64: each value times its block's scale (block None: the one scale)."""
    w = values.astype(np.float64)
    if block is None:
        return w * np.float64(scale_inv.reshape(()))
    rows, cols = np.indices(w.shape)
    return w * scale_inv.astype(np.float64)[rows // block[0], cols // block[1]]


@pytest.mark.parametrize(
    "n_out, n_in, block",
    [
        (200, 320, (128, 128)),
        pytest.param(96, 256, (64, 128), marks=pytest.mark.slow),
        pytest.param(48, 192, None, marks=pytest.mark.slow),
    ],
)
def test_fp8_products_equal_a_float64_product(n_out, n_in, block):
    """Partial blocks at both edges (320 inputs: groups of gcd(320, 128) = 64 rows), blocks of
    another size, one scale per tensor: every product the backend runs equals x @ W in float64."""
    values = RNG.uniform(-448, 448, (n_out, n_in)).astype(FP8_DTYPE)
    grid = () if block is None else (-(-n_out // block[0]), -(-n_in // block[1]))
    scale_inv = RNG.uniform(0.5, 2.0, grid).astype(np.float32) * 1e-3
    reference = block_reference(values, scale_inv, block).T  # [in, out]
    w = from_fp8(values, scale_inv, block)
    assert is_fp8(w) and w.shape == (n_in, n_out) and w.offsets is None
    assert w.scales.shape == (n_in // w.group, n_out) and w.group == (
        64 if n_in == 320 else 128 if block else n_in
    )
    w = jax.tree.map(jnp.asarray, w)
    x = RNG.standard_normal((6, n_in)).astype(np.float32)
    want = x.astype(np.float64) @ reference
    for form in PRODUCT_FORMS:
        assert_close(jax.jit(functools.partial(xla_product, form=form))(x, w), want)
    for platforms in (("cpu",), ("cuda",)):
        on = backends.Backend(platforms, kernels="xla")
        with on.tracing():
            assert_close(jax.jit(on.matmul)(x[:2], w), want[:2])
            assert_close(jax.jit(on.product_f32)(x, w), want)
    # The CPU kernels' form: float32 panels of the dequantized weight.
    assert_close(backends.Backend().matmul(x[:1], pack_panels(w)), want[:1])
    with pytest.raises(ValueError, match="has scales"):
        from_fp8(values, np.ones((1, 1), np.float32), (128, 128))


def test_fp8_quantization_rounds_each_weight_to_e4m3():
    """quantize(w, "fp8"): each 128 x 128 block scaled to max |w| = 448, each value the nearest
    e4m3 (3 mantissa bits: within 2^-4 relative, or half the smallest subnormal step)."""
    w = RNG.standard_normal((2, 192, 136)).astype(np.float32) * RNG.uniform(0.1, 3.0, (2, 1, 136))
    w[0, :, :8] = 0.0  # a block's corner of zeros
    q = quantize(w, "fp8")
    assert is_fp8(q) and q.group == 64 and q.scales.shape == (2, 3, 136)
    scale = np.repeat(np.asarray(q.scales, np.float64), q.group, axis=-2)
    error = np.abs(np.asarray(dequantize(q), np.float64) - w)
    assert (error <= np.abs(w) * 2.0**-4 + scale * 2.0**-10 + 1e-12).all()
    assert np.abs(np.asarray(dequantize(q))[0, :, :8]).max() == 0.0
    with pytest.raises(ValueError, match="fp8 has blocks of 128 x 128, got group=32"):
        quantize(w, "fp8", 32)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def write_fp8_folder(folder: Path, model_type: str = "llama", seed: int = 0, **config) -> Path:
    """A tiny random transformers model saved as an FP8 release: every decoder projection in
    float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (max |w| / 448, as
    transformers' Fp8Quantize makes it); the embedding, the norms and the head left float32."""
    import torch
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    family = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    hp = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    hp |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    model = family(family.config_class(**(hp | config)))
    tensors = {}
    for name, w in model.state_dict().items():
        w = w.detach().float()
        if w.ndim == 2 and ".layers." in name:
            n_out, n_in = w.shape
            blocks = w.reshape(n_out // 128, 128, n_in // 128, 128)
            scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0
            values = (blocks / scale_inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name], tensors[name + "_scale_inv"] = values.reshape(n_out, n_in), scale_inv
        else:
            tensors[name] = w.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(model.config.to_dict() | {"quantization_config": FP8_CONFIG})
    )
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def transformers_dequantized(folder: Path):
    """transformers' own reading of the FP8 folder, dequantized to float32 (it runs FP8 on GPUs)."""
    import torch
    import transformers

    config = transformers.FineGrainedFP8Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=config, dtype=torch.float32
    )


def assert_same_params(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def float_copy(model: Model) -> Model:
    """The float32 model of a quantized model's dequantized weights."""
    params = jax.tree.map(
        lambda w: dequantize(w) if isinstance(w, QuantizedWeight) else w,
        model.params,
        is_leaf=lambda w: isinstance(w, QuantizedWeight),
    )
    return Model(model.config, params)


@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_an_fp8_checkpoint_gives_transformers_logits_and_tokens(model_type, tmp_path):
    import torch

    folder = write_fp8_folder(tmp_path, model_type)
    model = specjax.load(folder)
    layer = model.params.layers[0]
    for name in ("qkv", "o", "gate", "up", "down"):  # kept as released: e4m3 values, block scales
        assert is_fp8(getattr(layer, name)) and getattr(layer, name).group == 128
    assert not isinstance(model.params.lm_head, QuantizedWeight) and model.params.embed.dtype == jnp.float32
    assert nbytes(model.params.layers) < nbytes(float_copy(model).params.layers) / 3.5

    reference = transformers_dequantized(folder)
    tokens = np.asarray(PROMPTS[:1] + [PROMPTS[2][:8]])
    with torch.no_grad():
        want = reference(torch.tensor(tokens)).logits.numpy()
    got, _, _ = forward(
        model.params,
        model.config,
        jnp.asarray(tokens),
        jnp.broadcast_to(jnp.arange(8), (2, 8)),
        init_cache(model.config, 2, 16),
    )
    assert_close(got, want, rtol=1e-4)

    # Greedy tokens: transformers' on the dequantized model, ours on the FP8 one (the CPU kernels
    # on its dequantized panels; XLA's products of the FP8 values run in the slow
    # test_quantized.py::test_scanned_and_unrolled_layers_give_the_same_logits[fp8]).
    reference.generation_config.eos_token_id = None  # ten tokens; ours stop after an EOS
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, do_sample=False)
    expected = out[0, len(PROMPTS[0]) :].tolist()
    stops = [i for i, token in enumerate(expected) if token in (model.config.eos_token_ids or ())]
    expected = expected[: stops[0] + 1] if stops else expected
    assert specjax.generate(model, [PROMPTS[0]], max_new_tokens=10).tokens == [expected]


def test_int8_and_int4_from_an_fp8_checkpoint_requantize_its_weights(tmp_path):
    """quantization="int8" / "int4" quantize the dequantized FP8 weights (as from a float folder);
    "fp8" keeps them as released and quantizes the head the release left float."""
    folder = write_fp8_folder(tmp_path)
    fp8 = specjax.load(folder)
    all_fp8 = specjax.load(folder, quantization="fp8").params
    assert_same_params(all_fp8.layers, fp8.params.layers)
    assert_same_params(all_fp8.lm_head, quantize(fp8.params.lm_head, "fp8"))
    dequantized = float_copy(fp8).params
    for kind, group in (("int8", None), ("int4", 32)):
        model = specjax.load(folder, quantization=kind, group_size=group)
        assert model.params.layers[0].qkv.bits == (8 if kind == "int8" else 4)
        assert_same_params(model.params, quantize_params(dequantized, kind, group))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"fmt": "e5m2"}, "fmt='e5m2': specjax reads e4m3 weights"),
        ({"activation_scheme": "static"}, "activation_scheme='static': specjax reads activations in float"),
        ({"scale_fmt": "ue8m0"}, "scale_fmt='ue8m0': specjax reads float32 scales"),
        ({"weight_block_size": [128]}, "weight_block_size must be two positive integers, got \\[128\\]"),
        ({"weight_block_size": [64, 64]}, "in blocks of 64 x 64 has scales"),
        (
            {"quant_method": "gptq"},
            "quant_method='gptq' is not read by specjax; it reads \\('fp8', 'mxfp4'\\)",
        ),
    ],
)
def test_what_is_not_read_is_refused(change, match, tmp_path):
    folder = write_fp8_folder(tmp_path, num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= change
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        specjax.load(folder)


@pytest.mark.slow  # about 20 s here: two loads and two generations on a faked mesh
def test_an_fp8_checkpoint_loads_onto_a_mesh(tmp_path):
    """Block scales split with their weights: qkv, gate and up by columns (each column's scale
    with it), o and down by rows (their groups of 128 rows over the devices)."""
    folder = write_fp8_folder(tmp_path)
    mesh = specjax.sharding.make_mesh(data=1, model=2)
    one = specjax.load(folder)
    split = specjax.load(folder, mesh=mesh)
    assert_same_params(split.params, one.params)
    layer = split.params.layers[0]
    assert layer.qkv.scales.addressable_shards[0].data.shape == (1, layer.qkv.shape[1] // 2)
    assert layer.down.scales.addressable_shards[0].data.shape == (1, layer.down.shape[1])  # 2 groups over 2
    assert layer.down.values.addressable_shards[0].data.dtype == FP8_DTYPE
    tokens = specjax.generate(split, PROMPTS, max_new_tokens=6, mesh=mesh).tokens
    assert tokens == specjax.generate(one, PROMPTS, max_new_tokens=6).tokens
