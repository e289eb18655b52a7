"""Flat, named params: the common currency of the checkpoint loaders and the on-disk cache.

Every loader turns its own tensor names into flat names of our params tree ("embed",
"layers.q", ..., "lm_head"), each a float32 numpy array in our layout (projections `[in, out]`,
per-layer weights stacked on a leading L axis). The query, key and value projections stay apart
here ("layers.q", "layers.k", "layers.v", and their biases), as in HF and GGUF files; the params
hold them fused (`LayerParams.qkv`, see llama.py). `params_from_arrays` checks the arrays against
`expected_shapes(config)` and builds the `LlamaParams` pytree, so every source is validated the
same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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
    param_shapes,
)


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


def collect_layers(
    per_layer: dict[str, dict[int, np.ndarray]], unknown: list[str], num_layers: int, source: str
) -> dict[str, np.ndarray]:
    """Refuse tensors a loader did not recognise, check every layer is present, and stack each
    field's per-layer arrays into the flat "layers.<field>" [L, ...] of the checkpoint layout."""
    if unknown:
        more = " ..." if len(unknown) > 8 else ""
        raise ValueError(
            f"{source} has tensors a Llama-family model does not use: {sorted(unknown)[:8]}{more}"
        )
    arrays = {}
    for field, layers in per_layer.items():
        if sorted(layers) != list(range(num_layers)):
            raise ValueError(
                f"{source}: {field} found for layers {sorted(layers)}, expected 0..{num_layers - 1}"
            )
        arrays[f"layers.{field}"] = np.stack([layers[i] for i in range(num_layers)])
    return arrays


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The flat name -> shape table a checkpoint for `config` must fill exactly; per-layer
    weights are stacked on a leading L axis under "layers.<field>" (checkpoint_layer_shapes)."""
    shapes = param_shapes(config)
    flat = {name: shape for name, shape in flatten(shapes.replace(layers=None)).items()}
    for name, shape in checkpoint_layer_shapes(config).items():
        flat[f"layers.{name}"] = (config.num_layers, *shape)
    return flat


def params_from_arrays(
    config: LlamaConfig,
    arrays: dict[str, np.ndarray],
    source: str,
    put: Callable[[str, np.ndarray], jax.Array] | None = None,
) -> LlamaParams:
    """Check flat arrays against `config` and build float32 `LlamaParams` from them.

    `put(name, host_array)` moves each weight to the devices, one per layer under its name in the
    params ("layers.3.qkv", fused here); the default puts it on the default device, and
    `specjax.sharding.param_placer` sends each device just its slice. Raises ValueError naming
    `source` and every missing, unexpected or misshapen tensor.
    """
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(arrays))
    unexpected = sorted(set(arrays) - set(expected))
    wrong = [
        f"{name}: got {tuple(arrays[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if name in arrays and tuple(arrays[name].shape) != shape
    ]
    if missing or unexpected or wrong:
        problems = []
        if missing:
            problems.append(f"missing {missing}")
        if unexpected:
            problems.append(f"unexpected {unexpected}")
        if wrong:
            problems.append("wrong shapes: " + "; ".join(wrong))
        raise ValueError(f"checkpoint {source} does not match its config: " + ", ".join(problems))
    put = _put_on_default_device if put is None else put

    def get(name):
        return put(name, np.asarray(arrays[name], np.float32)) if name in expected else None

    def layer(i):  # one layer's slices of the stacked [L, ...] arrays, fused and put
        names = checkpoint_layer_shapes(config)
        host = layer_from_checkpoint(
            {name: np.asarray(arrays[f"layers.{name}"][i], np.float32) for name in names}, config
        )
        return LayerParams(**{name: put(f"layers.{i}.{name}", x) for name, x in flatten(host).items()})

    return LlamaParams(
        embed=get("embed"),
        layers=tuple(layer(i) for i in range(config.num_layers)),
        final_norm=get("final_norm"),
        lm_head=get("lm_head"),
    )


def _put_on_default_device(name: str, array: np.ndarray) -> jax.Array:
    return jnp.asarray(array)


def config_to_dict(config: LlamaConfig) -> dict[str, Any]:
    """A JSON-ready dict of a config (the on-disk cache stores it next to the weights)."""
    out = dataclasses.asdict(config)
    out["eos_token_ids"] = list(config.eos_token_ids)
    return out


def config_from_dict(data: dict[str, Any]) -> LlamaConfig:
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
    return LlamaConfig(**data)
