"""Flat, named weights: the common currency of the checkpoint loaders and the on-disk cache.

Every loader maps its own tensor names onto flat names of our params tree in the checkpoint
layout: "embed", "layers.3.q", "layers.3.k", ..., "final_norm", "lm_head", each an unread
`LazyTensor` (models/tensors.py) in our layout (matrices `[in, out]`). The query, key and value
projections stay apart here ("layers.3.q", ... and their biases), as in HF and GGUF files; the
params hold them fused (`LayerParams.qkv`, see llama.py). A mixture's experts are one tensor per
weight and layer ("layers.3.expert_gate" [X, D, F]).

`params_from_tensors` checks every name, shape and stored dtype against the config before it
reads anything, then reads, converts and places the weights layer by layer: the host holds one
layer's tensors at a time, so loading a checkpoint needs about its parameters' size on the
devices plus one layer (or the embedding, the largest single tensor) in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.llama import (
    LayerParams,
    LlamaParams,
    checkpoint_layer_shapes,
    layer_from_checkpoint,
    layer_shapes,
    read_fused_qkv,
)
from specjax.models.tensors import WEIGHT_DTYPES, LazyTensor, of_array

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"embed": leaf, "layers.0.q": leaf, ...} for a params-shaped dataclass tree; None leaves dropped."""
    flat = {}
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        name = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            flat.update(flatten(value, prefix=f"{name}."))
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):  # per-layer params
            for i, item in enumerate(value):
                flat.update(flatten(item, prefix=f"{name}.{i}."))
        elif value is not None:
            flat[name] = value
    return flat


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The flat name -> shape table a checkpoint for `config` must fill exactly."""
    shapes = {"embed": (config.vocab_size, config.hidden_size)}
    for i in range(config.num_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in checkpoint_layer_shapes(config, i).items()}
    shapes["final_norm"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def dtype_name(dtype: Any) -> str:
    """ "float32", "bfloat16" or "float16" for a dtype given as a name or a dtype; ValueError
    naming `dtype` otherwise."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def check_tensors(config: LlamaConfig, tensors: Mapping[str, LazyTensor], source: str) -> None:
    """ValueError naming `source` and every missing, unexpected, misshapen or wrongly typed
    tensor, before anything is read."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {_first(missing)}")
    if unexpected:
        problems.append(f"unexpected {_first([tensors[name].source for name in unexpected])}")
    wrong = [
        f"{tensors[name].source} ({name}): got {tuple(tensors[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:8]))
    bad_types = [
        f"{tensors[name].source} is {tensors[name].dtype.name}"
        for name in expected
        if name in tensors and tensors[name].dtype.name not in WEIGHT_DTYPES
    ]
    if bad_types:
        problems.append(f"dtypes other than {', '.join(WEIGHT_DTYPES)}: " + "; ".join(bad_types[:8]))
    if problems:
        raise ValueError(f"checkpoint {source} does not match its config: " + ", ".join(problems))


def _first(names: list[str]) -> list[str]:
    """At most 8 names, and how many more there are."""
    return names[:8] + ([f"... {len(names) - 8} more"] if len(names) > 8 else [])


def params_from_tensors(
    config: LlamaConfig,
    tensors: Mapping[str, LazyTensor | np.ndarray],
    source: str,
    dtype: Any = "float32",
    put: Callable[[str, np.ndarray], jax.Array] | None = None,
    place: Callable[[str, tuple[int, ...], Callable], jax.Array] | None = None,
) -> LlamaParams:
    """Check flat tensors against `config`, then build `LlamaParams` of `dtype` from them.

    Reads one layer's tensors at a time, converts them to `dtype` and fuses q, k and v; `put(name,
    host_array)` moves each weight to the devices under its name in the params ("layers.3.qkv");
    the default puts it on the default device, and `specjax.sharding.param_placer` sends each
    device just its slice. Raises ValueError naming `source` and every missing, unexpected,
    misshapen or wrongly typed tensor before reading any.

    `place(name, shape, read_index)` (instead of `put`) builds each weight from slices:
    `read_index(index)` returns the weight's values at `index` (one slice per axis), reading only
    those from the checkpoint where its tensors allow (safetensors files do). On a mesh, each
    process then reads just what its own devices hold (`specjax.sharding.slice_placer`).
    """
    tensors = {name: t if isinstance(t, LazyTensor) else of_array(t, name) for name, t in tensors.items()}
    check_tensors(config, tensors, source)
    target = np.dtype(jnp.dtype(dtype_name(dtype)))
    if place is not None:
        return _params_from_slices(config, tensors, target, place)
    put = _put_on_default_device if put is None else put

    def read(name):
        values = tensors[name].read()
        return values if values.dtype == target else values.astype(target)

    def get(name):
        return put(name, read(name)) if name in tensors else None

    def layer(i):  # read, fused and put, before the next layer is read
        names = checkpoint_layer_shapes(config, i)
        host = layer_from_checkpoint({name: read(f"layers.{i}.{name}") for name in names}, config)
        placed = {name: put(f"layers.{i}.{name}", x) for name, x in flatten(host).items()}
        return LayerParams(**({"qkv": None} | placed))  # (qkv None: latent attention's layers)

    embed = get("embed")
    layers = tuple(layer(i) for i in range(config.num_layers))
    return LlamaParams(embed=embed, layers=layers, final_norm=get("final_norm"), lm_head=get("lm_head"))


def _params_from_slices(config: LlamaConfig, tensors: dict[str, LazyTensor], target: np.dtype, place):
    """`params_from_tensors` with `place`: each weight built from the slices it is asked for."""

    def reader(name):
        def read_index(index):
            values = tensors[name].read_index(index)
            return values if values.dtype == target else values.astype(target)

        return read_index

    def get(name):
        return place(name, tensors[name].shape, reader(name)) if name in tensors else None

    def layer(i):
        shapes = flatten(layer_shapes(config, i))
        fields = {}
        for name, shape in shapes.items():
            flat = f"layers.{i}.{name}"
            if name in ("qkv", "qkv_bias"):
                suffix = "" if name == "qkv" else "_bias"
                q, k, v = (reader(f"layers.{i}.{part}{suffix}") for part in "qkv")
                fused = functools.partial(read_fused_qkv, q, k, v, config=config)
                fields[name] = place(flat, shape, fused)
            else:
                fields[name] = place(flat, shape, reader(flat))
        return LayerParams(**({"qkv": None} | fields))

    embed = get("embed")
    layers = tuple(layer(i) for i in range(config.num_layers))
    return LlamaParams(embed=embed, layers=layers, final_norm=get("final_norm"), lm_head=get("lm_head"))


def _put_on_default_device(name: str, array: np.ndarray) -> jax.Array:
    # device_put copies a strided view (a transposed weight) straight into the device buffer;
    # jnp.asarray made a contiguous host copy first, one more tensor's worth of memory.
    return jax.device_put(array)


def config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    """A JSON-ready dict of a config (the on-disk cache stores it next to the weights)."""
    out = dataclasses.asdict(config)
    for name in ("eos_token_ids", "layer_types", "dense_layers"):
        if out[name] is not None:
            out[name] = list(out[name])
    return out


def config_from_dict(data: dict[str, Any]) -> LlamaConfig:
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    for name in ("eos_token_ids", "layer_types", "dense_layers"):
        if data.get(name) is not None:
            data[name] = tuple(data[name])
    return LlamaConfig(**data)
