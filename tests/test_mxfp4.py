"""gpt-oss's MXFP4 expert weights, as released checkpoints store them (`*_blocks`, `*_scales`),
dequantized at load: our dequantization equals transformers' own (`convert_moe_packed_tensors`)
bit for bit, and a tiny gpt-oss folder whose experts are MXFP4 loads to transformers' logits on
the same (dequantized) weights."""

from __future__ import annotations

import json

import families
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from logit_check import compare_with_torch
from safetensors.numpy import save_file

import specjax
from specjax.models import mxfp4
from specjax.models.tensors import of_array

EXPERTS = ("gate_up_proj", "down_proj")  # gpt-oss's expert weights [X, in, out]


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)  # [X, out, in / 32, 16]
    scales = rng.integers(120, 134, (3, 8, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    ours = mxfp4.mxfp4_tensor(of_array(blocks, "b"), of_array(scales, "s"), "w")
    assert ours.shape == tuple(theirs.shape) == (3, 128, 8) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours.read(), theirs.numpy())
    # A slice (what one device of a mesh reads): experts 1-2, output columns 2-6.
    index = (slice(1, 3), slice(None), slice(2, 6))
    np.testing.assert_array_equal(ours.read_index(index), theirs.numpy()[index])


def test_quantize_round_trips_what_it_can_hold():
    """Values already on the MXFP4 grid come back exactly; others to within half a step: the
    grid's largest step is 2 (from 4 to 6) times the group's scale, which is below peak / 3."""
    rng = np.random.default_rng(1)
    values = rng.standard_normal((2, 5, 64)).astype(np.float32)
    once = mxfp4.dequantize(*mxfp4.quantize(values))
    np.testing.assert_array_equal(mxfp4.dequantize(*mxfp4.quantize(once)), once)
    peak = np.abs(values.reshape(2, 5, 2, 32)).max(-1, keepdims=True)
    assert (np.abs(once - values).reshape(2, 5, 2, 32) <= peak / 3).all()


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A tiny gpt-oss saved with MXFP4 experts, and the torch model on the dequantized weights."""
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = families.save_folder("gpt_oss", folder)
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(EXPERTS):
                tensors[name] = param.detach().numpy()
                continue
            blocks, scales = mxfp4.quantize(param.detach().numpy().transpose(0, 2, 1))  # [X, out, in]
            param.copy_(torch.from_numpy(mxfp4.dequantize(blocks, scales).transpose(0, 2, 1)))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


def test_mxfp4_experts_load_dequantized(mxfp4_folder):
    folder, torch_model = mxfp4_folder
    model = specjax.load(folder)
    gate_up = torch_model.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.params.layers[0].expert_gate), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(model.params.layers[0].expert_up), gate_up[..., 1::2])
    error = compare_with_torch(model, torch_model, families.prompts(), [[3, 4], [5, 6]])
    assert error < 1e-4
    in_bf16 = specjax.load(folder, dtype="bfloat16")  # every MXFP4 value is exact in bfloat16
    np.testing.assert_array_equal(
        np.asarray(in_bf16.params.layers[2].expert_down.astype(jnp.float32)),
        np.asarray(model.params.layers[2].expert_down),
    )
