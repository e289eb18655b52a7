"""The engine's device programs, one named function each, and the table that compiles them
(`PROGRAMS`). Each takes its static arguments first (bound before jit) and the arrays after:

- `prefill_row`: one request's row (the target's cache, its proposer's state, its first token);
- `start_prompt`, `prompt_chunk`, `finish_prompt`: the same for a long prompt in chunks of a fixed
  size, run one at a time between the running rows' chunks (a `PartialPrefill` in between);
- `write_row`: a prefilled row into a free slot of the running state, the other slots untouched
  (`write_paged_row`: a dense row's cache into a paged state's pool, through its page table);
- `pool_chunks`, `pool_packed`, `pool_row`: a paged engine's prefill, straight into the pool: a
  prompt's chunks from the end of its cached prefix (or several prompts' tokens packed into the
  same passes), then each one's row (written by `write_row`);
- `move_row`: a running row copied into a free slot below it;
- `resize`: the running state grown to a wider width (free rows added) or cut to a narrower one;
- `fill`: the growth back to a width the state narrowed from, into the kept buffers of that state;
- `resume`: the decoding loop over the running state for one chunk (`loop.resume_program`);
- `may_draft`: whether the next chunk runs a drafting program or a quiet one (Dynamic).

A state's per-row leaves hold their rows along one axis each (`batch_axes`: the batch axis, or a
flattened rows-and-heads one in the KV cache); SHARED marks a leaf all rows share (the step
counter, a paged cache's pool), which these programs carry over as it is.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.models.cache import NULL_PAGE
from specjax.models.llama import lm_head
from specjax.sharding import data_degree, model_degree
from specjax.speculate.loop import DecodeState, LoopSpec, prefill, resume_program
from specjax.speculate.prefill import (
    PartialPrefill,
    first_tokens,
    packed_passes,
    prefill_chunk,
    prefill_pages,
)

SHARED = -1  # the batch axis of a leaf that all rows share


def batch_axes(one: DecodeState, two: DecodeState):
    """Per leaf of a DecodeState, the axis that holds its rows (SHARED where it does not grow with
    the batch), from the state's shapes at batch sizes 1 and 2."""
    return jax.tree.map(_differing_axis, one, two)


def _differing_axis(one, two) -> int:
    """The axis along which a leaf grows with the batch (SHARED when it does not)."""
    axes = [i for i, (a, b) in enumerate(zip(one.shape, two.shape, strict=True)) if a != b]
    assert len(axes) <= 1 and all(two.shape[i] == 2 * one.shape[i] for i in axes), (one, two)
    return axes[0] if axes else SHARED


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How a per-row leaf's rows axis is ordered on a mesh: in row order (model 1), or, for a KV
    cache split over ("data", "model") (`sharding.entry_blocks`), device block by device block:
    [data, model, rows of a data group, entries of a row's kv heads on one device]."""

    data: int = 1
    model: int = 1


IN_ORDER = Blocks()


def put_row(axes, state, row, slot, blocks=None):
    """`state` with slot `slot` replaced by `row` (a batch of one) in every per-row leaf. `blocks`
    (a Blocks per leaf; None: all in order) says where a mesh's split caches keep a row's entries:
    the row's own (a batch of one on `sharding.row_mesh`) are [model, entries] in order, written
    into each device's block, where they are (no leaf is reordered, so nothing crosses devices)."""

    def write(axis, big, small, order=IN_ORDER):
        if axis == SHARED:
            return big
        if order.model == 1:
            return jax.lax.dynamic_update_slice_in_dim(big, small, slot * small.shape[axis], axis)
        D, M, per_row = order.data, order.model, small.shape[axis]
        rows = big.shape[axis] // per_row // D  # a data group's
        view = big.reshape(*big.shape[:axis], D, M, rows, per_row // M, *big.shape[axis + 1 :])
        part = small.reshape(*small.shape[:axis], 1, M, 1, per_row // M, *small.shape[axis + 1 :])
        at = [jnp.int32(0)] * view.ndim
        at[axis], at[axis + 2] = slot // rows, slot % rows
        return jax.lax.dynamic_update_slice(view, part, at).reshape(big.shape)

    if blocks is None:
        return jax.tree.map(write, axes, state, row)
    return jax.tree.map(write, axes, state, row, blocks)


def take_row(axes, state, slot, width: int):
    """Slot `slot` of a `width`-slot state, as a batch of one."""

    def read(axis, x):
        if axis == SHARED:
            return x
        size = x.shape[axis] // width
        return jax.lax.dynamic_slice_in_dim(x, slot * size, size, axis)

    return jax.tree.map(read, axes, state)


def repeat_rows(axes, batch: int, row):
    """A batch of `batch` copies of `row` (a batch of one)."""

    def repeat(axis, x):
        return x if axis == SHARED else jnp.concatenate([x] * batch, axis)

    return jax.tree.map(repeat, axes, row)


# ----- the programs ------------------------------------------------------------------------------


def prefill_row(spec: LoopSpec, params, proposer_params, inputs) -> DecodeState:
    """One request's row, a batch of one whose prompt is padded to `spec.prompt_bucket`."""
    with spec.backend.tracing():
        return prefill(spec, params, proposer_params, inputs)


def start_prompt(spec: LoopSpec, params) -> PartialPrefill:
    """A long prompt's row before its first chunk (an empty cache of `spec.capacity` slots)."""
    return PartialPrefill.empty(spec, params, 1, spec.capacity)


def prompt_chunk(spec: LoopSpec, params, partial: PartialPrefill, tokens, start, length) -> PartialPrefill:
    """The row after its prompt's chunk tokens [1, spec.prefill_chunk] at position `start` (the
    prompt has `length` tokens): one program whatever the prompt's length."""
    with spec.backend.tracing():
        return prefill_chunk(spec, params, partial, jnp.int32(0), tokens, start, length)


def finish_prompt(spec: LoopSpec, params, proposer_params, partial: PartialPrefill, inputs) -> DecodeState:
    """The row of a prompt whose chunks have all run: its proposer's state and its first token,
    as `prefill_row` makes them (inputs: the prompt padded to a bucket; the proposer reads that
    many positions of the features)."""
    with spec.backend.tracing():
        logits = lm_head(params, partial.last_hidden, spec.config)
        bucket = inputs.prompt_tokens.shape[1]
        features = partial.features[:, :bucket] if spec.proposer_reads_features else None
        cache = partial.cache.replace(lengths=inputs.prompt_lengths)
        return first_tokens(spec, params, proposer_params, inputs, logits, features, cache)


def write_row(spec: LoopSpec, axes, blocks, state: DecodeState, row: DecodeState, slot) -> DecodeState:
    """A prefilled row into free slot `slot` of the running state. Its steps count from here (its
    own step numbers, so a seeded row draws as it would alone), and its proposer state joins the
    batch's (Dynamic's schedule: one k for the batch; the slot is free, so ~done marks the rows
    running beside it). `blocks`: where a mesh's split caches keep each row (`put_row`; None off
    a mesh)."""
    row = row.replace(first_step=jnp.broadcast_to(state.step, (1,)))
    if spec.proposer is not None:
        joined = spec.proposer.join(state.proposer_state, row.proposer_state, ~state.done)
        row = row.replace(proposer_state=joined)
    return put_row(axes, state, row, slot, blocks)


def write_paged_row(
    spec: LoopSpec, axes, mesh, state: DecodeState, row: DecodeState, slot, table
) -> DecodeState:
    """`write_row` into a paged state: the dense row's keys and values copied into the pool's
    pages `table` ([W] page ids, the row's pages then null ones: the slots past what the row holds
    land in the null page), and the row's table and length into slot `slot`. On a `mesh` the pool
    is split over ("data", "model"), data group g holding its n pages (`table` names them 0..n-1)
    and each of its devices their kv heads, so its entries are ordered device by device: group
    g's page p's kv head h is entry (g*M + h // (K/M)) * n*K/M + p*K/M + h % (K/M)."""
    cache = state.cache
    K, P, W = cache.paged_heads, cache.page_size, table.shape[0]
    M, D = (1, 1) if mesh is None else (model_degree(mesh), data_degree(mesh))
    n, heads = cache.k[0].shape[-3] // K // D, jnp.arange(K, dtype=table.dtype)
    group = slot // (state.done.shape[0] // D)  # the slot's data group, whose pages the row takes
    device = group * M + heads // (K // M)  # [K] the device block holding each kv head
    entries = device * (n * K // M) + table[:, None] * (K // M) + heads % (K // M)  # [W, K]

    def into_pages(pool, dense, keys: bool):
        # dense keys [..., K, E, S] / values [..., K, S, E] -> [..., W, K, E, P] / [..., W, K, P, E]
        slot_axis = dense.ndim - 1 if keys else dense.ndim - 2
        pad = [(0, 0)] * dense.ndim
        pad[slot_axis] = (0, W * P - dense.shape[slot_axis])
        dense = jnp.pad(dense, pad)
        split = (*dense.shape[:slot_axis], W, P, *dense.shape[slot_axis + 1 :])
        pages = jnp.moveaxis(dense.reshape(split), slot_axis, dense.ndim - 3)
        lead = (slice(None),) * (pool.ndim - 3)
        return pool.at[(*lead, entries)].set(pages.astype(pool.dtype))

    k = tuple(into_pages(pool, dense, True) for pool, dense in zip(cache.k, row.cache.k, strict=True))
    v = tuple(into_pages(pool, dense, False) for pool, dense in zip(cache.v, row.cache.v, strict=True))
    state = state.replace(cache=cache.replace(k=k, v=v))
    row = row.replace(cache=state.cache.replace(lengths=row.cache.lengths, pages=table[None]))
    return write_row(spec, axes, None, state, row, slot)


def without_pool(state):
    """A paged state (or row) without its pool: empty arrays in its place, so that a program that
    takes or makes it neither copies nor donates the pool, every row's."""
    cache = state.cache
    empty = [tuple(jnp.zeros((0,), buffer.dtype) for buffer in buffers) for buffers in (cache.k, cache.v)]
    return state.replace(cache=cache.replace(k=empty[0], v=empty[1]))


def pool_pages(tables, num_pages: int):
    """Page tables [R, W] of R rows, one per data group in order (R = 1 off a data-parallel mesh),
    as ids in the whole pool of `num_pages` (group r's pages are r*n.. of n = num_pages / R):
    what an array indexed by page outside the model's per-device code reads (the feature pool)."""
    R = tables.shape[0]
    return tables + (jnp.arange(R, dtype=tables.dtype) * (num_pages // R))[:, None]


def _feature_rows(features, tables, extra: int = 0):
    """Rows' features [R, W*P + extra, F] read from a feature pool [N, P, F] through their tables
    [R, W] (one row per data group: `pool_pages`; zeros past their pages' slots)."""
    R, (N, _, F) = tables.shape[0], features.shape
    rows = features[pool_pages(tables, N)].reshape(R, -1, F)
    return jnp.pad(rows, ((0, 0), (0, extra), (0, 0)))


def pool_chunks(spec: LoopSpec, params, cache, features, tables, tokens, starts, lengths, count, last_hidden):
    """`count` chunks of R = spec.batch_size prompts (one per data group, a group with nothing to
    prefill a row of length 0; R = 1 off a data-parallel mesh): prompt r (tokens [R, L],
    `lengths`) from position starts[r], into the pool of `cache` (a paged cache: its buffers are
    the pool, donated) through its table (tables [R, W]), and into the feature pool [N, P, F]
    where the proposer reads features ([0] otherwise). Returns (the pool's keys, its values, the
    feature pool, the hidden states at the prompts' last tokens once a chunk held them: [R, D],
    carried from `last_hidden`). One program whatever the prompts' lengths and the prefixes they
    found cached."""
    with spec.backend.tracing():
        view = cache.replace(lengths=starts, pages=tables)
        put = None
        if spec.proposer_reads_features:
            (R, W), N, P = tables.shape, features.shape[0], spec.page_size
            nulls = pool_pages(jnp.full((R, 1), NULL_PAGE, tables.dtype), N)
            pages = jnp.concatenate([pool_pages(tables, N), nulls], axis=1)  # [R, W + 1]: W, null

            def put(features, positions, token_features, active):
                index = jnp.where(active[:, None] & (positions < W * P), positions // P, W)  # W: null
                page = jnp.take_along_axis(pages, index, axis=1)  # [R, C]
                return features.at[page, positions % P].set(token_features.astype(features.dtype))

        last_hidden, features, (k, v) = prefill_pages(
            spec, params, view, tokens, starts, lengths, count, (last_hidden, features), put
        )
        return k, v, features, last_hidden


def pool_packed(spec: LoopSpec, params, cache, features, tables, tokens, starts, lengths):
    """Several prompts' tokens into the pool at once, packed (`packed_passes`: laid end to end, C
    one-token rows a pass, where the attention kernel reads pages in place): prompt r (tokens
    [R, L], tables [R, W]) from position starts[r], past its cached prefix, to lengths[r] (rows
    with nothing to run: start = length). Returns (the pool's keys, its values, the feature pool
    [N, P, F] with their features, the hidden states [R, D] at their last tokens). One program
    for every admission of up to R prompts."""
    with spec.backend.tracing():
        view = cache.replace(lengths=starts, pages=tables)
        P = spec.page_size

        def put(features, row, position, token_features, tables):  # into its page (padding: null)
            pages = tables[row, position // P]
            return features.at[pages, position % P].set(token_features.astype(features.dtype))

        reads = spec.proposer_reads_features
        last_hidden, features, (k, v) = packed_passes(
            spec, params, view, tokens, starts, lengths, features, put if reads else None
        )
        return k, v, features, last_hidden


def pool_row(
    spec: LoopSpec, axes, params, proposer_params, cache, features, tables, last_hidden, inputs, group
):
    """The row of a prompt whose chunks are in the pool (`pool_chunks`, whose R rows' tables and
    hidden states these are; the prompt's is row `group`): its proposer's state from the prompt's
    features read back from the feature pool (the cached prefix's with them), the target's cache
    through its table, and its first token, as `prefill_row` makes them; without the pool
    (`without_pool`: the row is written into the running state by `write_row`). With R > 1 (a
    data-parallel mesh, each group reading its own pages) all R rows are made, from the request's
    inputs (`inputs`, a batch of one; its key folded as row 0's), and row `group` kept: `axes`,
    (the rows' axes of the inputs, of the state)."""
    with spec.backend.tracing():
        R = tables.shape[0]
        if R > 1:
            inputs = repeat_rows(axes[0], R, inputs).replace(row_numbers=jnp.zeros((R,), jnp.int32))
        logits = lm_head(params, last_hidden, spec.config)
        bucket = inputs.prompt_tokens.shape[1]
        rows = _feature_rows(features, tables)[:, :bucket] if spec.proposer_reads_features else None
        view = cache.replace(lengths=inputs.prompt_lengths, pages=tables)
        state = first_tokens(spec, params, proposer_params, inputs, logits, rows, view)
        if R > 1:
            state = take_row(axes[1], state, group, R)
        return without_pool(state)


def move_row(axes, width: int, state: DecodeState, source, slot) -> DecodeState:
    """The row in slot `source` of a `width`-slot state copied into slot `slot`."""
    return put_row(axes, state, take_row(axes, state, source, width), slot)


def resize(axes, width: int, new_width: int, state: DecodeState, free_row: DecodeState) -> DecodeState:
    """A `width`-slot state at `new_width` slots: its first slots kept, free rows added past them
    or slots past new_width dropped."""
    if new_width < width:
        return jax.tree.map(
            lambda axis, x: (
                x
                if axis == SHARED
                else jax.lax.slice_in_dim(x, 0, x.shape[axis] // width * new_width, axis=axis)
            ),
            axes,
            state,
        )
    extra = repeat_rows(axes, new_width - width, free_row)
    return jax.tree.map(
        lambda axis, x, y: x if axis == SHARED else jnp.concatenate([x, y], axis), axes, state, extra
    )


def fill(axes, narrow: int, width: int, spare: DecodeState, state: DecodeState, free_row) -> DecodeState:
    """A `narrow`-slot state grown to `width` slots in the buffers of `spare` (a state of that
    width kept since the state narrowed from it): the state's rows, then free rows."""

    def put(axis, into, rows):
        if axis == SHARED:
            return rows
        return jax.lax.dynamic_update_slice_in_dim(into, rows, 0, axis)

    # One free row at a time: the free rows repeated would be a temporary as large.
    return jax.lax.fori_loop(
        narrow,
        width,
        lambda slot, into: put_row(axes, into, free_row, slot),
        jax.tree.map(put, axes, spare, state),
    )


def resume(spec: LoopSpec, window: int, params, proposer_params, state, inputs, max_steps, reported):
    """The decoding loop over the running state for one chunk (`loop.resume_program`)."""
    return resume_program(spec, params, proposer_params, state, inputs, max_steps, reported, window)


def may_draft(spec: LoopSpec, state: DecodeState):
    """[] whether a running row may draft at the next step (which of Dynamic's programs runs)."""
    return spec.proposer.may_draft(state.proposer_state, ~state.done)


@dataclasses.dataclass(frozen=True)
class Program:
    """A kind of engine program: the function, and which of its arguments the engine donates
    (a state updated in place)."""

    function: object
    donate: tuple[int, ...] = ()


# By kind: what `Engine` compiles; an unknown kind is an error (`compiled`). "resume" is the loop,
# compiled once per loop spec (the full, lean and quiet ones) and width.
PROGRAMS = {
    "prefill": Program(prefill_row),
    "start_prompt": Program(start_prompt),
    "prompt_chunk": Program(prompt_chunk, donate=(1,)),
    "finish_prompt": Program(finish_prompt, donate=(2,)),
    "write": Program(write_row, donate=(0,)),
    "write_paged": Program(write_paged_row, donate=(0,)),
    "pool_chunks": Program(pool_chunks, donate=(1, 2)),
    "pool_packed": Program(pool_packed, donate=(1, 2)),
    "pool_row": Program(pool_row),
    "move": Program(move_row, donate=(0,)),
    "resize": Program(resize),  # (its output has another shape: nothing to donate to)
    "fill": Program(fill, donate=(0,)),
    "resume": Program(resume, donate=(2,)),
    "may_draft": Program(may_draft),
}


def jitted(kind: str, *static, out_shardings=None):
    """Program `kind` with its static arguments bound, jitted (donating what it donates);
    `out_shardings` (a prefix tree of its outputs; None where the compiler chooses) fixes where
    its outputs go, as a mesh's running state must stay (the programs are compiled for it)."""
    if kind not in PROGRAMS:
        raise ValueError(f"engine program kind {kind!r} is not one of {', '.join(PROGRAMS)}")
    program = PROGRAMS[kind]
    function = functools.partial(program.function, *static)
    if out_shardings is None:
        return jax.jit(function, donate_argnums=program.donate)
    return jax.jit(function, donate_argnums=program.donate, out_shardings=out_shardings)
