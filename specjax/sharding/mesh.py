"""The device mesh, and the checks that a model and a batch split over it.

The mesh has two axes. "data" splits the batch: each data group holds its rows of the tokens and
of the KV caches, and a full copy of the weights. "model" splits each layer Megatron-style: every
device of a model group holds H/m query heads, K/m kv heads and F/m of the MLP, and the group sums
its partial attention and MLP outputs with one all-reduce each per layer. These two strings appear
nowhere outside specjax/sharding.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from specjax.checks import check_int
from specjax.models.config import LlamaConfig

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)


def _check_degree(name: str, value) -> None:
    check_int(f"make_mesh: {name}", value, 1)


def make_mesh(model: int = 1, data: int | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh of `data * model` devices.

    model: the tensor-parallel degree (heads and ffw split over it).
    data: the data-parallel degree (batch rows split over it); None takes every device left over,
        `len(devices) // model`.
    devices: default `jax.devices()` (all hosts' devices after `jax.distributed.initialize`).

    `data * model` must divide the device count; a smaller mesh takes the first devices. Devices
    are laid out row-major, so a model group is a run of consecutive devices: on a multi-GPU host
    these share the fastest links, and with several hosts "data" spans hosts while each model
    group stays inside one (as long as `model` divides the devices per host).
    """
    devices = list(jax.devices() if devices is None else devices)
    _check_degree("model", model)
    if data is None:
        if len(devices) % model:
            raise ValueError(
                f"make_mesh: model={model} does not divide the {len(devices)} devices; "
                f"use a model degree in {_divisors(len(devices))}"
            )
        data = len(devices) // model
    _check_degree("data", data)
    size = data * model
    if len(devices) % size:
        raise ValueError(
            f"make_mesh: data * model = {data} * {model} = {size} does not divide the {len(devices)} "
            f"devices; data * model must be one of {_divisors(len(devices))}"
        )
    # Auto axes: code outside shard_map stays plain jnp on global arrays, partitioned by jit.
    grid = np.asarray(devices[:size], dtype=object).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_mesh(mesh) -> Mesh:
    """ValueError unless `mesh` is a jax Mesh with exactly the axes ("data", "model")."""
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (from specjax.sharding.make_mesh), got {type(mesh).__name__}"
        )
    if set(mesh.axis_names) != set(AXES) or len(mesh.axis_names) != len(AXES):
        raise ValueError(
            f"mesh must have the axes {AXES} (specjax.sharding.make_mesh builds one), "
            f"got {tuple(mesh.axis_names)}"
        )
    return mesh


def model_degree(mesh: Mesh) -> int:
    """The tensor-parallel degree: devices that split each layer."""
    return mesh.shape[MODEL]


def data_degree(mesh: Mesh) -> int:
    """The data-parallel degree: groups that split the batch."""
    return mesh.shape[DATA]


def check_model_split(mesh: Mesh, config: LlamaConfig, who: str = "model") -> None:
    """ValueError naming the dimension, unless the query heads, kv heads and ffw size of `config`
    all divide over the mesh's "model" axis. `who` names the model in the message."""
    m = model_degree(mesh)
    dims = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    if config.kv_lora_rank:  # latent attention splits the query heads; its cache is not split
        del dims["num_kv_heads"]
    if config.num_experts:
        dims["moe_intermediate_size"] = config.moe_intermediate_size
    if config.shared_expert_size:
        dims["shared_expert_size"] = config.shared_expert_size
    groups = config.num_heads if config.kv_lora_rank else config.num_kv_heads
    allowed = [d for d in _divisors(groups) if all(v % d == 0 for v in dims.values())]
    for name, value in dims.items():
        if value % m:
            raise ValueError(
                f"mesh: the {who}'s {name}={value} does not divide over the mesh axis {MODEL!r} of "
                f"size {m}; this model splits over a {MODEL!r} size in {allowed}"
            )


def check_batch_split(mesh: Mesh, batch_size: int) -> None:
    """ValueError unless the batch divides over the mesh's "data" axis (`generate` pads the batch
    to a bucket that does: see `specjax.api.batch_bucket`)."""
    d = data_degree(mesh)
    if batch_size % d:
        raise ValueError(
            f"prompts: a batch of {batch_size} rows does not divide over the mesh axis {DATA!r} of "
            f"size {d}; pad it to a multiple of {d}"
        )


REPLICA = "replica"  # the axis of `row_mesh` over which every data group computes the same rows


def row_mesh(mesh: Mesh) -> Mesh:
    """`mesh`'s devices as a (replica, data, model) mesh of shape (D, 1, M), for programs on a
    batch of one (a serving engine's admission), which cannot split over D data groups: every
    data group computes the same row, its model group splitting each layer as on `mesh`. The same
    devices in the same order, so its outputs are `mesh`'s arrays replicated over "data", which
    programs on `mesh` read as they are (no copy: each device holds what it would hold there)."""
    D, M = data_degree(mesh), model_degree(mesh)
    grid = np.asarray(mesh.devices, dtype=object).reshape(D, 1, M)
    return Mesh(grid, (REPLICA, DATA, MODEL), axis_types=(AxisType.Auto,) * 3)
