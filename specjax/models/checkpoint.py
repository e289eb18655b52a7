"""Flat, named weights: the common currency of the checkpoint loaders and the on-disk cache.

Every loader maps its own tensor names onto flat names of our params tree in the checkpoint
layout: "embed", "layers.3.q", "layers.3.k", ..., "final_norm", "lm_head", each an unread
`LazyTensor` (models/tensors.py) in our layout (matrices `[in, out]`). The query, key and value
projections stay apart here ("layers.3.q", ... and their biases), as in HF and GGUF files; the
params hold them fused (`LayerParams.qkv`, see params.py). A mixture's experts are one tensor per
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

from specjax.kernels.quantized import QuantizedWeight, dequantize, is_fp8
from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.params import (
    LayerParams,
    LlamaParams,
    checkpoint_layer_shapes,
    checkpoint_shapes,
    layer_from_checkpoint,
    layer_shapes,
    read_fused_qkv,
)
from specjax.models.quantized import check_quantization, quantize
from specjax.models.tensors import WEIGHT_DTYPES, LazyTensor, of_array

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# The projections in the checkpoint layout (q, k and v apart): what quantization applies to, with
# the LM head. Norms, biases, the router and the embedding stay float.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up", "expert_down")


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
    expected = checkpoint_shapes(config)
    head = tensors.get("lm_head")
    if config.tie_word_embeddings and head is not None and head.quantized:
        expected["lm_head"] = (config.hidden_size, config.vocab_size)  # a tied head's quantized copy
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
    quantization: str | None = None,
    group_size: int | None = None,
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

    Quantized weights (models/quantized.py): tensors that read as a QuantizedWeight (a GGUF's
    blocks, an FP8 checkpoint's weights: `LazyTensor.quantized`) are kept so where they are
    projections or the head, and `quantization` "int8", "int4" (groups of `group_size`) or "fp8"
    quantizes every projection and the LM head as it is read (from float32 values, whatever
    `dtype`; a kept weight in another format from its dequantized values), a tied head into a
    quantized copy in `lm_head`. Kept weights that are not projections are dequantized. Such
    weights are read whole and then placed (`put` or `place` receive the QuantizedWeight in host
    memory), even on a mesh.
    """
    tensors = {name: t if isinstance(t, LazyTensor) else of_array(t, name) for name, t in tensors.items()}
    group = check_quantization(quantization, group_size)
    check_tensors(config, tensors, source)
    target = np.dtype(jnp.dtype(dtype_name(dtype)))
    if quantization == "int4":
        _check_groups(config, group, source)
    weights = HostWeights(
        config, tensors, target, quantization if quantization in ("int8", "int4", "fp8") else None, group
    )
    quantized = weights.quantize_to is not None or any(t.quantized for t in tensors.values())
    if place is not None and not quantized:
        return _params_from_slices(config, tensors, target, place)
    if place is not None:
        put = _placing_whole(place)
    put = _put_on_default_device if put is None else put

    def layer(i):  # read, fused and put, before the next layer is read
        placed = {name: put(f"layers.{i}.{name}", x) for name, x in weights.layer(i).items()}
        return LayerParams(**({"qkv": None} | placed))  # (qkv None: latent attention's layers)

    embed = put("embed", weights.read("embed"))
    layers = tuple(layer(i) for i in range(config.num_layers))
    head = weights.head()
    return LlamaParams(
        embed=embed,
        layers=layers,
        final_norm=put("final_norm", weights.read("final_norm")),
        lm_head=None if head is None else put("lm_head", head),
    )


def _check_groups(config: LlamaConfig, group: int, source: str) -> None:
    """int4's groups must divide the inputs of every weight quantized: a ValueError naming those
    they do not, before anything is read."""
    shapes = checkpoint_shapes(config) | {"lm_head": (config.hidden_size, config.vocab_size)}
    bad = [
        f"{name} ({shape[-2]} inputs)"
        for name, shape in shapes.items()
        if (name == "lm_head" or name.rsplit(".", 1)[-1] in PROJECTIONS) and shape[-2] % group
    ]
    if bad:
        hint = "; use group_size=32" if group != 32 else ""
        raise ValueError(
            f"load: quantization='int4' with group_size={group}: the groups do not divide the inputs "
            f"of {_first(bad)} in {source}{hint}"
        )


@dataclasses.dataclass(frozen=True)
class HostWeights:
    """The weights of a checkpoint in host memory as the params hold them: read, converted to
    `target`, q, k and v fused, projections quantized (`quantize_to` "int8" or "int4", in groups of
    `group`) or kept quantized as the tensors read."""

    config: LlamaConfig
    tensors: dict[str, LazyTensor]
    target: np.dtype
    quantize_to: str | None
    group: int | None

    def read(self, name: str, projection: bool = False):
        values = self.tensors[name].read()
        if isinstance(values, QuantizedWeight):
            if projection and self.quantize_to in (None, _format(values)):
                return values
            # Not a projection (an FP8 checkpoint's latent attention, its shared experts), or
            # asked in another format: the float32 values, converted or quantized as a float's.
            values = np.asarray(dequantize(values, jnp.float32))
        if projection and self.quantize_to:  # quantized from float32 values
            return values if values.dtype == np.float32 else values.astype(np.float32)
        return values if values.dtype == self.target else values.astype(self.target)

    def finish(self, host, projection: bool):
        """A fused weight as the params hold it."""
        if isinstance(host, QuantizedWeight):
            return host
        if projection and self.quantize_to:
            return quantize(host, self.quantize_to, self.group)
        return host if host.dtype == self.target else host.astype(self.target)

    def layer(self, i: int) -> dict[str, Any]:
        """Layer i's weights by LayerParams field (absent ones left out)."""
        names = checkpoint_layer_shapes(self.config, i)
        read = {name: self.read(f"layers.{i}.{name}", name in PROJECTIONS) for name in names}
        fused = layer_from_checkpoint(read, self.config)
        fields = {f.name: getattr(fused, f.name) for f in dataclasses.fields(LayerParams)}
        return {
            name: self.finish(x, name == "qkv" or name in PROJECTIONS)
            for name, x in fields.items()
            if x is not None
        }

    def head(self):
        """The LM head [D, V] as the params hold it: the checkpoint's (or its quantized copy of a
        tied head); with quantize_to, a tied head's quantized copy; else None (tied)."""
        if "lm_head" in self.tensors:
            return self.finish(self.read("lm_head", True), True)
        if self.quantize_to:
            return quantize(self.read("embed", True).T, self.quantize_to, self.group)
        return None


def _format(w: QuantizedWeight) -> str | None:
    """The `quantization` a kept weight is already in: "fp8" for FP8 values, else None (a GGUF's
    blocks, kept only by quantization="gguf", which quantizes nothing at load)."""
    return "fp8" if is_fp8(w) else None


def _placing_whole(place):
    """A `put(name, host)` from a `place(name, shape, read_index)`: a weight read whole in host
    memory (a quantized one, or any beside it), each device still receiving only its slice."""

    def put(name, host):
        if isinstance(host, QuantizedWeight):
            return place(name, host.shape, host)
        return place(name, host.shape, lambda index: host[index])

    return put


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
