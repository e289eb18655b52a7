"""One table of logical axes, and the PartitionSpec trees and placements it yields.

Every weight and cache dimension has a logical name; `RULES` maps each name to a mesh axis or to
None (not split). Everything else (param specs, cache specs, placing arrays on a mesh while they
load) is derived from these two tables, so a change of layout is a change of one line.

Tensor parallelism is Megatron's: qkv, gate and up are split by column (kv-head groups, ffw), o
and down by row, so each device computes a slice of the heads and of the MLP from the full
residual stream, and one all-reduce after o and one after down restore the full stream. qkv's
columns go kv head by kv head (models/params.py, `fuse_qkv`), so an even split of them gives each
device whole groups: its query heads with the keys and values they attend with.

A quantized weight (models/quantized.py) splits as its weight does: its values along the same
axes, its scales and offsets ([..., D_in / group, D_out]) with them, along D_out for a column
split, and for a row split along D_in when the groups divide evenly over the devices; one group
(int8's scale per output channel) is then replicated, each device's rows inside it
(`quantized_spec`).

The embedding and the LM head are replicated, not split over the vocabulary. A vocab-split head
gives each device a slice of the logits, but every consumer of the logits needs whole rows:
top-k and top-p sort over the full vocabulary, rejection sampling normalizes max(p - q, 0) over
it, and argmax compares all of it. Each step would then all-gather [B, k+1, V] logits (or
implement a distributed top-k / top-p / rejection sampler); a vocab-split embedding also needs a
masked lookup and one more all-reduce. Replication costs 2 * V * D weights per device (1 V * D
with tied embeddings); docs/scaling.md puts numbers on that trade.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.kernels.quantized import QuantizedWeight
from specjax.models.cache import FreshEntries, KVCache
from specjax.models.checkpoint import flatten
from specjax.models.config import LlamaConfig
from specjax.models.params import LayerParams, LayerStack, LlamaParams, layer_shapes
from specjax.models.tensors import normalize_index
from specjax.sharding.mesh import DATA, MODEL

# Logical axis -> mesh axis (None: every device holds all of it).
RULES: dict[str, str | None] = {
    "batch": DATA,
    "heads": MODEL,  # query heads: the H*E rows of o
    "kv_heads": MODEL,  # kv heads: qkv's K*(G+2)*E columns (by kv-head group), the cache's K axis
    "ffw": MODEL,  # the F columns of gate and up, the F rows of down (an expert's too)
    "experts": None,  # every device holds every expert's slice of F (see models/mlp.py, moe_mlp)
    "embed": None,  # the residual stream D: every device holds all of it
    "vocab": None,  # replicated embedding and head (see the module docstring)
    "slots": None,  # cache positions S
    "head_dim": None,  # E
    "latent": None,  # latent attention's low-rank dims (models/mla.py): every device holds them
}

# The logical axes of each weight, in the weight's own dimension order.
LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("embed",),
    "qkv": ("embed", "kv_heads"),
    "o": ("heads", "embed"),
    "mlp_norm": ("embed",),
    "gate": ("embed", "ffw"),
    "up": ("embed", "ffw"),
    "down": ("ffw", "embed"),
    "qkv_bias": ("kv_heads",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "attn_out_norm": ("embed",),
    "mlp_out_norm": ("embed",),
    "router": ("embed", "experts"),
    "expert_gate": ("experts", "embed", "ffw"),
    "expert_up": ("experts", "embed", "ffw"),
    "expert_down": ("experts", "ffw", "embed"),
    "router_bias": ("experts",),
    "router_score_bias": ("experts",),
    # The experts' gate and up biases split with their F; the down projections' biases (and o's)
    # whole on every device, added once after the sum over the model axis (models/llama.py).
    "expert_gate_bias": ("experts", "ffw"),
    "expert_up_bias": ("experts", "ffw"),
    "expert_down_bias": ("experts", "embed"),
    "shared_gate": ("embed", "ffw"),  # shared experts: split as a dense MLP is
    "shared_up": ("embed", "ffw"),
    "shared_down": ("ffw", "embed"),
    "sinks": ("heads",),  # gpt-oss's sinks split with their query heads
    "o_bias": ("embed",),
    # Latent attention: the query and kv_b columns and o's rows by head, the latents replicated.
    "q_a": ("embed", "latent"),
    "q_a_norm": ("latent",),
    "q_b": ("latent", "heads"),
    "kv_a": ("embed", "latent"),
    "kv_a_norm": ("latent",),
    "kv_b": ("latent", "heads"),
}
MODEL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}
# Each layer's keys [B*K, E, S] and values [B*K, S, E]: rows and kv heads share the leading axis
# (models/cache.py).
KEY_CACHE_AXES = (("batch", "kv_heads"), "head_dim", "slots")
VALUE_CACHE_AXES = (("batch", "kv_heads"), "slots", "head_dim")
FRESH_AXES = ("batch", "slots", "kv_heads", "head_dim")  # a pass's unwritten keys, values [B, T, K, E]
ROW_AXES = ("batch",)  # cache lengths [B], and every per-row array of the loop


def logical_to_spec(axes: tuple[str | tuple[str, ...], ...], tensor_parallel: bool = True) -> P:
    """The PartitionSpec for an array with these logical axes; a tuple of logical axes names one
    merged dimension, split over their mesh axes in that order. Without tensor parallelism (a
    replicated draft) nothing is split over "model"; rows still split over "data"."""

    def mesh_axes(axis):
        names = axis if isinstance(axis, tuple) else (axis,)
        split = [RULES[a] for a in names if RULES[a] is not None and (tensor_parallel or RULES[a] != MODEL)]
        return tuple(split) if len(split) > 1 else (split[0] if split else None)

    return P(*(mesh_axes(a) for a in axes))


def param_specs(config: LlamaConfig, tensor_parallel: bool = True) -> LlamaParams:
    """A LlamaParams tree with a PartitionSpec where `init_params(config)` has an array."""

    def layer(i):
        shapes = layer_shapes(config, i)  # None where the layer has no such weight (biases, ...)
        return LayerParams(
            **{
                field.name: None
                if getattr(shapes, field.name) is None
                else logical_to_spec(LAYER_AXES[field.name], tensor_parallel)
                for field in dataclasses.fields(LayerParams)
            }
        )

    return LlamaParams(
        embed=logical_to_spec(MODEL_AXES["embed"], tensor_parallel),
        layers=tuple(layer(i) for i in range(config.num_layers)),
        final_norm=logical_to_spec(MODEL_AXES["final_norm"], tensor_parallel),
        lm_head=None
        if config.tie_word_embeddings
        else logical_to_spec(MODEL_AXES["lm_head"], tensor_parallel),
    )


def params_specs_like(
    params: LlamaParams, config: LlamaConfig, tensor_parallel: bool = True, mesh: Mesh | None = None
) -> LlamaParams:
    """`param_specs` shaped as `params`, whose layers may be LayerStacks (a program that scans
    layers, models/llama.py): a stack's weights are split as each of its layers is, along their
    own axes, the stacking axis whole on every device. Quantized weights get a spec per field
    (`quantized_spec`, on `mesh`), a tied head's quantized copy the head's spec."""
    specs = param_specs(config, tensor_parallel)
    if specs.lm_head is None and params.lm_head is not None:
        specs = specs.replace(lm_head=logical_to_spec(MODEL_AXES["lm_head"], tensor_parallel))
    specs = specs.replace(layers=_layer_specs_like(params, specs))

    def leaf(spec, weight):
        return quantized_spec(spec, weight, mesh) if isinstance(weight, QuantizedWeight) else spec

    return jax.tree.map(leaf, specs, params, is_leaf=lambda x: isinstance(x, P) or x is None)


def quantized_spec(spec: P, weight: QuantizedWeight, mesh: Mesh | None) -> QuantizedWeight:
    """The specs of a quantized weight's fields (a QuantizedWeight of PartitionSpecs) for a
    weight split by `spec`: values as the weight; scales and offsets with them, but replicated
    along D_in where a row split has one group. Groups that do not divide evenly over the devices
    of a row split are a ValueError."""
    *lead, rows, columns = tuple(spec) + (None,) * (len(weight.shape) - len(tuple(spec)))
    groups = weight.scales.shape[-2]
    names = () if rows is None else (rows if isinstance(rows, tuple) else (rows,))
    parts = 1 if mesh is None else math.prod(mesh.shape[name] for name in names)
    scales = P(*lead, rows, columns)
    if parts > 1 and groups % parts:
        if groups != 1:
            raise ValueError(
                f"a quantized weight of shape {weight.shape} has {groups} groups of {weight.group} "
                f"inputs, which do not split evenly over the {parts} devices its rows are split on; "
                "quantize with groups that do (int4's group_size) or use another model degree"
            )
        scales = P(*lead, None, columns)
    offsets = None if weight.offsets is None else scales
    return QuantizedWeight(P(*lead, rows, columns), scales, offsets, bits=weight.bits, group=weight.group)


def _layer_specs_like(params: LlamaParams, specs: LlamaParams) -> tuple:
    """Each layer's specs, shaped as params.layers (LayerStacks: see `params_specs_like`)."""
    layers, first = [], 0
    for element in params.layers:
        if isinstance(element, LayerStack):
            stacked = jax.tree.map(
                lambda spec: P(None, *spec), specs.layers[first], is_leaf=lambda x: isinstance(x, P)
            )
            layers.append(LayerStack(stacked))
            first += element.count
        else:
            layers.append(specs.layers[first])
            first += 1
    return tuple(layers)


def cache_specs(layout: int | tuple[int | None, ...], tensor_parallel: bool = True) -> KVCache:
    """A KVCache tree of PartitionSpecs: rows on "data", kv heads on "model" (the buffers' merged
    leading axis is split over both: each device holds its rows' entries for its kv heads).
    `layout`: the number of layers (a buffer each), or a cache's `layout` (a stack's buffer has
    its layers on a leading axis, whole on every device). A latent-attention cache (one entry
    per row, `KVCache.is_latent`) takes tensor_parallel=False: every device of a model group holds
    its rows' latents, which all its heads read."""
    keys = logical_to_spec(KEY_CACHE_AXES, tensor_parallel)
    values = logical_to_spec(VALUE_CACHE_AXES, tensor_parallel)
    layout = (None,) * layout if isinstance(layout, int) else layout
    return KVCache(
        k=tuple(_stacked(keys, n) for n in layout),
        v=tuple(_stacked(values, n) for n in layout),
        lengths=row_spec(),
    )


def cache_specs_like(cache: KVCache, tensor_parallel: bool = True) -> KVCache:
    """`cache_specs` for `cache` as it is: a paged cache's page tables [B, W] split by row like its
    lengths, its pool split as a dense cache's rows are (pages for rows: each device holds every
    page of its kv heads, or on a "data" axis its group's pages)."""
    specs = cache_specs(cache.layout, tensor_parallel)
    if cache.pages is None:
        return specs
    return specs.replace(pages=row_spec(), paged_heads=cache.paged_heads)


def fresh_specs(layout: int | tuple[int | None, ...], tensor_parallel: bool = True) -> FreshEntries:
    """A FreshEntries tree of PartitionSpecs: rows on "data", kv heads on "model" (`layout` as
    for `cache_specs`)."""
    entries = logical_to_spec(FRESH_AXES, tensor_parallel)
    layout = (None,) * layout if isinstance(layout, int) else layout
    return FreshEntries(
        k=tuple(_stacked(entries, n) for n in layout), v=tuple(_stacked(entries, n) for n in layout)
    )


def _stacked(spec: P, layers: int | None) -> P:
    """A buffer's spec, with a stack's leading layer axis (not split) where `layers` is not None."""
    return spec if layers is None else P(None, *spec)


def row_spec() -> P:
    """[B, ...] arrays split by row over "data"."""
    return logical_to_spec(ROW_AXES)


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def place(x, sharding: NamedSharding) -> jax.Array:
    """`x` (a host or device array, the same value in every process) as a global array with
    `sharding`; a no-op for an array already placed so.

    On a mesh inside one process this is `jax.device_put`. On a mesh that spans processes,
    `device_put` cannot build the array (no process may address every device): each process fills
    only its own devices, from its own copy of the value, with `jax.make_array_from_callback`, so
    no process needs another's data. A PRNG key travels as its key data."""
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # one process; or a global array already, resharded
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = place(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(
    params: LlamaParams, config: LlamaConfig, mesh: Mesh, tensor_parallel: bool = True
) -> LlamaParams:
    """Params placed on `mesh` (a no-op for arrays already placed so)."""
    return jax.tree.map(place, params, _named(mesh, params_specs_like(params, config, tensor_parallel, mesh)))


def replicate(tree, mesh: Mesh):
    """Every array of `tree` whole on every device of `mesh` (small proposer params: heads)."""
    whole = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: place(x, whole), tree)


def param_placer(config: LlamaConfig, mesh: Mesh) -> Callable[[str, np.ndarray], jax.Array]:
    """A `put(flat_name, host_array)` for the checkpoint loaders: builds each weight from host
    memory slice by slice, each device receiving only its own slice, so that no device ever holds
    a full copy of a split weight. With several hosts, each host fills only its own devices."""
    shardings = flatten(_named(mesh, param_specs(config)))

    def put(name: str, array: np.ndarray) -> jax.Array:
        if isinstance(array, QuantizedWeight):
            return _place_quantized(mesh, name, array)
        return jax.make_array_from_callback(array.shape, shardings[name], lambda index: array[index])

    return put


def _place_quantized(mesh: Mesh, name: str, weight: QuantizedWeight) -> QuantizedWeight:
    """A quantized weight (in host memory, whole) placed on `mesh` under its flat name, each
    device receiving its slices of the fields (`quantized_spec`)."""
    axes = MODEL_AXES["lm_head"] if name == "lm_head" else LAYER_AXES[name.rsplit(".", 1)[-1]]
    specs = quantized_spec(logical_to_spec(axes), weight, mesh)
    return jax.tree.map(place, weight, _named(mesh, specs))


def slice_placer(config: LlamaConfig, mesh: Mesh) -> Callable[[str, tuple[int, ...], Callable], jax.Array]:
    """A `place(flat_name, shape, read_index)` for `checkpoint.params_from_tensors`: builds each
    weight with `jax.make_array_from_callback`, asking `read_index` only for the slices this
    process's own devices hold, each distinct slice once (the devices of a data group hold the same
    slices). With several processes, each reads only its part of every split weight. A quantized
    weight comes read whole (a QuantizedWeight in host memory in place of `read_index`): its
    fields are placed from it, each device receiving its slices."""
    shardings = flatten(_named(mesh, param_specs(config)))

    def place(name: str, shape: tuple[int, ...], read_index: Callable) -> jax.Array:
        if isinstance(read_index, QuantizedWeight):
            return _place_quantized(mesh, name, read_index)
        if name not in shardings:  # a tied head's copy, read whole (`_placing_whole`)
            shardings[name] = NamedSharding(mesh, logical_to_spec(MODEL_AXES[name]))
        read = {}

        def fill(index):
            key = tuple((s.start, s.stop) for s in normalize_index(index, shape))
            if key not in read:
                read[key] = read_index(tuple(slice(*k) for k in key))
            return read[key]

        return jax.make_array_from_callback(tuple(shape), shardings[name], fill)

    return place


def fetch(tree):
    """Device arrays -> host numpy arrays of their global shape. Unlike `jax.device_get` this also
    works when an array spans several processes: each process then receives the whole array,
    gathered with `multihost_utils.process_allgather` (one call, every process taking part)."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(get, tree)


def shard_rows(tree, mesh: Mesh, batch_size: int):
    """Arrays with a leading batch dim split by row over "data"; other leaves (a PRNG key)
    replicated. Every process passes the whole batch (the same in each) and fills only its own
    devices' rows (see `place`)."""

    def put(x):
        rows = x.ndim >= 1 and x.shape[0] == batch_size
        return place(x, NamedSharding(mesh, row_spec() if rows else P()))

    return jax.tree.map(put, tree)


def entry_blocks(array: jax.Array, axis: int) -> tuple[int, int] | None:
    """(data degree, model degree) where `array` (a placed global array: a KV cache's buffer) is
    split along `axis` over ("data", "model"), whose entries are then ordered device by device
    (block (d, m) holding rows d*B/D.. of kv heads m*K/M..: models/cache.py); None where that
    axis holds its rows in order (not split over "model", or a model degree of 1). Read from
    the buffer's sharding as the shard_map that wrote it left it (sharding/forward.py)."""
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape.get(MODEL, 1) == 1:
        return None
    spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
    names = spec[axis] if isinstance(spec[axis], tuple) else (spec[axis],)
    if MODEL not in names:
        return None
    return sharding.mesh.shape.get(DATA, 1), sharding.mesh.shape[MODEL]
