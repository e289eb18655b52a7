"""The model's forward under `jax.shard_map`: the one place the compiled loop meets the mesh
(with `mesh_move_slots` and `mesh_write`, the cache updates made outside a forward, which also
read the cache per device).

Inside the shard_map each device runs the ordinary forward (models/llama.py) on its own slice:
its rows of the batch and of the KV cache, its H/m query and K/m kv heads, its F/m of the MLP.
The forward takes its head counts from the weights' shapes, so it needs no local config; the
only addition is the `reduce` hook, here a `psum` over "model" after attention's o projection and
after the MLP's down projection, two all-reduces of [B/d, T, D] per layer.

Only the transformer body is shard_map'd. The LM head, sampling, verification and n-gram lookup
stay plain jnp on global arrays, which jit partitions by the shardings flowing out of here: the
hidden states leave split by row, so those steps run on each data group's rows with no traffic.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from specjax.kernels import backend
from specjax.models import llama
from specjax.models.cache import FreshEntries, KVCache
from specjax.models.config import LlamaConfig
from specjax.models.params import LlamaParams
from specjax.sharding.mesh import DATA, MODEL
from specjax.sharding.specs import cache_specs, cache_specs_like, fresh_specs, params_specs_like, row_spec


def _sum_over_model(x: jax.Array) -> jax.Array:
    return jax.lax.psum(x, MODEL)


def mesh_forward_hidden(
    mesh: Mesh | None,
    params: LlamaParams,
    config: LlamaConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    empty_cache: bool = False,
    tensor_parallel: bool = True,
    fresh_mask=None,
    write: bool = True,
    capture: tuple[int, ...] = (),
) -> tuple[jax.Array, KVCache | FreshEntries] | tuple[jax.Array, KVCache | FreshEntries, jax.Array]:
    """`models.forward_hidden` on `mesh`; with mesh None, the plain single-device call.

    tokens, positions [B, T]; returns hidden [B, T, D] (split by row) and the cache. With
    `tensor_parallel=False` (a replicated draft) every device of a model group holds the whole
    model and runs the same rows: no all-reduce, at the price of repeated compute. `fresh_mask`
    [T, T] (a static numpy array, e.g. a token tree's) replaces the causal mask of the T tokens.
    `write=False` returns the fresh entries instead of the written cache (see FreshEntries).
    `capture` (layer ids) adds the residual streams entering those layers, [B, T, n*D], split by
    row like the hidden states (see models.forward_hidden).
    """
    reduce = _sum_over_model if mesh is not None and tensor_parallel else None
    split_cache = mesh is not None and tensor_parallel and not cache.is_latent
    heads = _local_heads(mesh, cache, split_cache)

    def local(params, tokens, positions, cache):  # each device's slice: [B/d, T], K/m kv heads ...
        out = llama.forward_hidden(
            params,
            config,
            tokens,
            positions,
            cache.replace(paged_heads=heads),
            fresh_mask=fresh_mask,
            empty_cache=empty_cache,
            reduce=reduce,
            write=write,
            capture=capture,
        )
        if write:  # (the cache as the caller's: its kv heads per page whole)
            out = (out[0], out[1].replace(paged_heads=cache.paged_heads), *out[2:])
        return out

    if mesh is None:
        return local(params, tokens, positions, cache)
    params_spec = params_specs_like(params, config, tensor_parallel, mesh)
    cache_spec = cache_specs_like(cache, split_cache)
    written_spec = cache_spec if write else fresh_specs(cache.layout, split_cache)
    rows = row_spec()
    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(params_spec, rows, rows, cache_spec),
        out_specs=(P(*rows, None, None), written_spec) + ((P(*rows, None, None),) if capture else ()),
        # Pallas kernels declare no varying-axes type for their outputs, which check_vma requires
        # of every value inside; the specs above say how everything is split all the same.
        check_vma=not backend.active().pallas_platforms(),
    )
    return sharded(params, tokens, positions, cache)


def _local_heads(mesh: Mesh | None, cache: KVCache, split: bool) -> int:
    """A paged cache's kv heads per page on each device (its pool split over "model" by kv head,
    as a dense cache's rows are); 0 for a dense cache."""
    if cache.pages is None or not split:
        return cache.paged_heads
    return cache.paged_heads // mesh.shape[MODEL]


def mesh_move_slots(mesh: Mesh | None, cache: KVCache, sources: jax.Array) -> KVCache:
    """`cache.move_slots(sources)` (sources [B, D]) on `mesh`: see `_per_device`."""
    return _per_device(mesh, KVCache.move_slots, cache, sources, row_spec())


def mesh_write(mesh: Mesh | None, cache: KVCache, fresh: FreshEntries) -> KVCache:
    """`cache.write(fresh)` (a pass's unwritten entries) on `mesh`: see `_per_device`."""
    return _per_device(mesh, KVCache.write, cache, fresh, fresh_specs(cache.layout, not cache.is_latent))


def _per_device(mesh: Mesh | None, update, cache: KVCache, argument, argument_spec) -> KVCache:
    """`update(cache, argument)` on each device's own rows and kv heads of the target's cache: its
    buffers' entries are ordered per device on a mesh (models/cache.py), so updates run under
    shard_map like the forward that wrote them. With mesh None, the plain call."""
    if mesh is None:
        return update(cache, argument)
    heads = _local_heads(mesh, cache, not cache.is_latent)

    def local(cache, argument):
        return update(cache.replace(paged_heads=heads), argument).replace(paged_heads=cache.paged_heads)

    cache_spec = cache_specs_like(cache, not cache.is_latent)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(cache_spec, argument_spec), out_specs=cache_spec)
    return sharded(cache, argument)


def mesh_dense(mesh: Mesh | None, cache: KVCache) -> KVCache:
    """`cache.dense()` on `mesh`: a paged cache's rows gathered from its pool on each device (the
    pool's entries are ordered per device, its kv heads split over "model"), a dense cache as it
    is. With mesh None, the plain call."""
    if mesh is None or cache.pages is None:
        return cache.dense()
    split = not cache.is_latent
    heads = _local_heads(mesh, cache, split)

    def local(cache):
        return cache.replace(paged_heads=heads).dense()

    in_spec, out_spec = cache_specs_like(cache, split), cache_specs(cache.layout, split)
    return jax.shard_map(local, mesh=mesh, in_specs=(in_spec,), out_specs=out_spec)(cache)


def mesh_entries_by_row(mesh: Mesh | None, cache: KVCache) -> KVCache:
    """A cache split over ("data", "model") as a tensor-parallel model's is, its entries put in the
    order of one split over "data" alone (a replicated draft's, `tensor_parallel=False`).

    Seen whole, a split cache's merged axis is the devices' blocks one after another, data-major:
    block (d, m) holds rows d*B/D .. of kv heads m*K/M .., b-major. Split over "data" alone, block
    d holds its rows with every kv head. Reordering [D, M, B/D, K/M] to [D, B/D, M, K/M] turns one
    into the other; with mesh None, a model degree of 1 or a latent cache (never split over
    "model"), the order is already the same."""
    if mesh is None or mesh.shape[MODEL] == 1 or cache.is_latent:
        return cache
    D, M, B = mesh.shape[DATA], mesh.shape[MODEL], cache.batch_size

    def reorder(buffer: jax.Array) -> jax.Array:
        axis = buffer.ndim - 3  # the merged axis: after a stack's layer axis
        lead, entries, rest = buffer.shape[:axis], buffer.shape[axis], buffer.shape[axis + 1 :]
        K = entries // B
        blocks = buffer.reshape(*lead, D, M, B // D, K // M, *rest)
        return jax.numpy.swapaxes(blocks, axis + 1, axis + 2).reshape(buffer.shape)

    return cache.replace(k=tuple(map(reorder, cache.k)), v=tuple(map(reorder, cache.v)))
