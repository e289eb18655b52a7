"""Streamed, sharded loading: a checkpoint is checked whole before anything is read, then read
tensor by tensor (layer by layer), each converted and placed before the next is read, so that
the process never holds much more than the final parameters.

The memory test writes a random bfloat16 Llama checkpoint of about 400 MB over three shards
(tensor by tensor: the writer never holds it whole either), then loads it in a fresh process and
reads the kernel's record of the process's peak resident memory (VmHWM, reset just before the
load). The path before streaming read every tensor into float32 host memory first: for this
checkpoint about 800 MB of float32 copies beside the 400 MB placed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import specjax
from specjax.models import checkpoint
from specjax.models.tensors import LazyTensor, write_safetensors

BIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    model_type="llama",
)
SLACK = 64 << 20  # the stated constant: allocator and bookkeeping (measured peaks leave 20-40 MB)


def random_tensor(name: str, shape, seed: int, dtype=ml_dtypes.bfloat16) -> LazyTensor:
    def read():
        values = np.random.default_rng(seed).standard_normal(shape, np.float32) * 0.02
        return values.astype(dtype)

    return LazyTensor(tuple(shape), np.dtype(dtype), read, name)


def hf_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    D, F, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    E = D // c["num_attention_heads"]
    q, kv = D, c["num_key_value_heads"] * E
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q, D),
            p + "self_attn.k_proj.weight": (kv, D),
            p + "self_attn.v_proj.weight": (kv, D),
            p + "self_attn.o_proj.weight": (D, q),
            p + "post_attention_layernorm.weight": (D,),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    return shapes | {"model.norm.weight": (D,), "lm_head.weight": (V, D)}


def write_sharded(folder, config: dict, num_shards: int = 3, overrides=None) -> dict[str, LazyTensor]:
    """A random checkpoint of `config` in `num_shards` safetensors files plus the index; each
    tensor drawn as it is written. `overrides` replaces tensors by HF name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {
        name: random_tensor(name, shape, seed) for seed, (name, shape) in enumerate(hf_shapes(config).items())
    }
    tensors.update(overrides or {})
    names = list(tensors)
    bounds = np.linspace(0, len(names), num_shards + 1).astype(int)
    weight_map = {}
    for s in range(num_shards):
        file = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[bounds[s] : bounds[s + 1]]
        write_safetensors(folder / file, {name: tensors[name] for name in part})
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


PROBE = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    import specjax

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    jnp.zeros(1).block_until_ready()  # the runtime up before the baseline
    open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
    before = status("VmRSS:")
    model = specjax.load(sys.argv[1], dtype="bfloat16")
    jax.block_until_ready(model.params)
    leaves = jax.tree.leaves(model.params)
    print(json.dumps(dict(
        before=before, peak=status("VmHWM:"), after=status("VmRSS:"),
        params=sum(x.nbytes for x in leaves), largest=max(x.nbytes for x in leaves),
        dtypes=sorted({str(x.dtype) for x in leaves}),
    )))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak resident memory from /proc (Linux only)")
def test_loading_a_sharded_bf16_checkpoint_holds_one_tensor_at_a_time(tmp_path):
    folder = tmp_path / "big"
    tensors = write_sharded(folder, BIG)
    checkpoint_bytes = sum(t.nbytes for t in tensors.values())
    assert 380e6 < checkpoint_bytes < 420e6
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(folder)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["before"]
    bound = m["params"] + m["largest"] + SLACK
    mib = 1 << 20
    print(
        f"checkpoint {checkpoint_bytes / mib:.0f} MiB in 3 shards; params {m['params'] / mib:.0f} MiB "
        f"(largest tensor {m['largest'] / mib:.0f} MiB); peak resident growth while loading "
        f"{grown / mib:.0f} MiB; bound {bound / mib:.0f} MiB"
    )
    assert m["dtypes"] == ["bfloat16"]
    assert m["params"] == checkpoint_bytes  # q, k and v fused: the same bytes, in bfloat16
    assert grown < bound


def tiny_config(**overrides):
    return dict(BIG, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2) | overrides


@pytest.mark.parametrize(
    "change, message",
    [
        ("drop", "missing \\['layers.1.down'\\]"),
        (
            "shape",
            r"model.layers.1.mlp.down_proj.weight \(layers.1.down\): got \(47, 32\), expected \(48, 32\)",
        ),
        ("dtype", "model.layers.1.mlp.down_proj.weight is int32"),
        ("extra", "unexpected \\['model.layers.1.mlp.extra.weight'\\]"),
    ],
)
def test_a_bad_tensor_is_named_before_anything_is_placed(tmp_path, monkeypatch, change, message):
    name = "model.layers.1.mlp.down_proj.weight"
    overrides = {}
    if change == "shape":
        overrides[name] = random_tensor(name, (32, 47), 0)
    elif change == "dtype":
        overrides[name] = random_tensor(name, (32, 48), 0, dtype=np.int32)
    elif change == "extra":
        overrides["model.layers.1.mlp.extra.weight"] = random_tensor("x", (4,), 0)
    tensors = write_sharded(tmp_path, tiny_config(), overrides=overrides)
    if change == "drop":
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        shard = index["weight_map"].pop(name)
        kept = {n: t for n, t in tensors.items() if index["weight_map"].get(n) == shard}
        write_safetensors(tmp_path / shard, kept)
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    placed = []
    real_put = checkpoint._put_on_default_device
    monkeypatch.setattr(checkpoint, "_put_on_default_device", lambda n, a: placed.append(n) or real_put(n, a))
    pattern = message if change != "extra" else "does not use: \\['model.layers.1.mlp.extra.weight'\\]"
    with pytest.raises(ValueError, match=pattern):
        specjax.load(tmp_path)
    assert placed == []


def test_streamed_params_equal_the_safetensors_packages_read(tmp_path):
    """Shards read tensor by tensor by specjax's own reader give, bit for bit, what the
    safetensors package reads (and safetensors reads what specjax's writer wrote)."""
    from safetensors.numpy import load_file

    write_sharded(tmp_path, tiny_config())
    model = specjax.load(tmp_path, dtype="bfloat16")
    whole = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        whole |= load_file(shard)
    ours = checkpoint.flatten(model.params)
    pairs = [("embed", "model.embed_tokens.weight", False), ("lm_head", "lm_head.weight", True)]
    pairs += [("layers.1.down", "model.layers.1.mlp.down_proj.weight", True)]
    for name, hf_name, transposed in pairs:
        value = np.asarray(ours[name])
        value = value.T if transposed else value
        assert np.array_equal(value.view(np.uint16), whole[hf_name].view(np.uint16)), name
