"""The engine's running batch on the device: its `DecodeState`, the compiled programs that make
and move it, and how its width changes (specjax/serve/engine.py decides what runs; this module
runs it).

The state holds the first `width` slots (1, 2, 4, ..., max_batch: the smallest holding the
running requests). Its target cache is dense (a row of `capacity` slots per slot) or paged
(`PagedLayout`: one pool of pages that every row reads through its page table, the table a
per-row leaf and the pool a leaf all rows share, so that the width's programs move tables and
never the pool's memory).

Every program is compiled ahead of time on its first call (`program`), and a later call whose
shapes differ is an error, never a silent recompilation; `num_compiles` counts them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.models.cache import NULL_PAGE, KVCache, paged_cache
from specjax.serve import engine_programs
from specjax.serve.engine_config import PREFILL_CHUNK
from specjax.serve.engine_programs import IN_ORDER, SHARED, Blocks, without_pool
from specjax.serve.handoff import check_row
from specjax.sharding import cache_specs_like, entry_blocks, fetch, place, row_spec, spans_processes
from specjax.speculate.loop import DecodeState, LoopSpec
from specjax.speculate.spec import pages_pack


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """A paged target cache: `num_pages` pages of `page_size` slots (page 0 the null page) and
    tables of `table_width` pages per row (a row's `capacity` slots). On a mesh of `groups` data
    groups the pool is split over them, group g holding pages g*n.. of n = num_pages/groups, and
    its rows' tables name them by their place there (0..n-1, page 0 its own null page): each
    device reads its group's pages as a pool of its own."""

    page_size: int
    num_pages: int
    table_width: int
    groups: int = 1

    @property
    def group_pages(self) -> int:
        """A data group's pages, its null page among them."""
        return self.num_pages // self.groups

    def free_tables(self, width: int) -> np.ndarray:
        return np.full((width, self.table_width), NULL_PAGE, np.int32)


class EngineBatch:
    """The running state and its programs (module docstring).

    spec: the engine's loop spec (batch_size max_batch; page_size set where `paged`); loops: its
    loop variants by kind (engine_loops.py); window: the tokens a chunk reports per row at most;
    prefill_chunk: a long prompt's chunk (None: none); free_inputs(batch, bucket): the inputs of
    `batch` one-token prompts with nothing to generate (a free slot's)."""

    def __init__(
        self,
        spec: LoopSpec,
        loops: dict[str, LoopSpec],
        widths: list[int],
        window: int,
        prefill_chunk: int | None,
        logprobs: int | None,
        params,
        proposer_params,
        free_inputs: Callable[..., Any],
        paged: PagedLayout | None,
        prefill_spec: LoopSpec | None = None,
    ):
        self.spec, self.loops, self.widths, self.window = spec, loops, widths, window
        # The spec of a request's own prefill: a dense batch of one (its row is written into the
        # running state's cache, dense or paged, by `write`); on a mesh, on its `row_mesh`.
        self.prefill_spec = prefill_spec or dataclasses.replace(spec, batch_size=1, page_size=None)
        self.chunk, self.logprobs, self.paged = prefill_chunk, logprobs, paged
        self.params, self.proposer_params = params, proposer_params
        self.free_inputs = free_inputs
        self.programs: dict[Any, Any] = {}
        self.num_compiles = 0
        self._axes = None  # per leaf of a DecodeState, its rows' axis (`batch_axes`), found once
        self._slot_axes = None  # per leaf of a row, its cache slots' axis (`slot_axes`), found once
        self._input_axes = None  # per leaf of a prefill's inputs, its rows' axis (`input_axes`)
        self.blocks = None  # on a mesh, where its split caches keep each row (`put_row`)
        self.spans = spans_processes(spec.mesh)  # every program's host arguments placed (`run`)
        self.shardings = None  # on a mesh, where every program keeps the state
        # A free slot's row: a one-token request with nothing to generate, prefilled once (so
        # every free slot holds a valid, finished row). Paged, its cache a table of null pages and
        # no pool (`without_pool`: the programs that change the width never touch the pool).
        dense_row = self.run("prefill", spec.prompt_bucket, params, proposer_params, free_inputs())
        # What a request's own prefill makes (a dense row, on a paged engine too), as shapes and
        # shardings: a row made elsewhere must be one (`placed_row`)
        self.row_like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), dense_row
        )
        self.free_row = dense_row
        if paged is not None:  # (on a mesh, compiled: the pool it drops is never made on one device)
            bare = lambda row: without_pool(self._paged(row))  # noqa: E731
            self.free_row = bare(dense_row) if spec.mesh is None else jax.jit(bare)(dense_row)
        # One free slot (widths[0] is 1), a copy: the programs take the state donated, and the
        # free row must outlive it. Paged, with the pool of every page, allocated here once. On a
        # mesh the state is max_batch wide (its only width), every slot free, prefilled as a batch
        # so that its caches are split over the mesh as the loop's shard_map reads them.
        # Paged, the prefill writes straight into the pool (`prefill_pages`), in chunks of
        # `page_chunk` tokens, and the features the proposer reads go into a pool of their own,
        # [N, P, F], beside the target's pages: a cached prefix keeps them (empty where the
        # proposer reads none).
        self.features = None
        self.page_chunk = prefill_chunk or PREFILL_CHUNK
        if spec.mesh is not None:
            state = self._mesh_state(dense_row)
        else:
            state = jax.tree.map(jnp.copy, self.free_row)
            if paged is not None:
                state = _with_pool(state, self._paged(dense_row).cache)
                self.features = jnp.zeros(self._features_shape(), spec.dtype)
        self.state: DecodeState = state
        # The buffers of the widest state the batch narrowed from, while it runs narrower (paged:
        # without the pool): a later growth back to that width writes into them (`resize`).
        # Allocating a wide state anew at every burst of arrivals cost its memory's first touch
        # each time, 0.5-2.6 s for 16 rows of the built-in model here (docs/serving.md), against
        # 0.1 s writing in place.
        self.spare: DecodeState | None = None
        self._compile_width_programs(dense_row)

    def _features_shape(self) -> tuple[int, ...]:
        paged, spec = self.paged, self.spec
        shape = (paged.num_pages, paged.page_size, spec.proposer_feature_width)
        return shape if spec.proposer_reads_features else (0,)

    def _mesh_state(self, dense_row: DecodeState) -> DecodeState:
        """On a mesh, the running state of max_batch free slots, its caches split as the loop's
        shard_map reads them: dense, prefilled as a batch (the shardings every program then keeps);
        paged, the free row repeated into the shardings that prefill would give (compiled, not
        run: no dense cache is allocated) and the pool made on the mesh, split over "model" by kv
        head. Sets `blocks` and `shardings`."""
        spec, mesh, B = self.spec, self.spec.mesh, self.spec.batch_size
        free = self.free_inputs(B)
        if self.paged is None:
            state = self.run("batch_prefill", B, self.params, self.proposer_params, free)
        else:
            dense = self.program("batch_prefill", B, self.params, self.proposer_params, free).output_shardings
            bare = self.bare_shape(B)
            replicated = NamedSharding(mesh, P())
            cache = bare.cache.replace(
                k=tuple(replicated for _ in bare.cache.k),
                v=tuple(replicated for _ in bare.cache.v),
                lengths=dense.cache.lengths,
                pages=NamedSharding(mesh, row_spec()),
            )
            repeat = functools.partial(engine_programs.repeat_rows, self.batch_axes(), B)
            state = jax.jit(repeat, out_shardings=dense.replace(cache=cache))(self.free_row)
            pool = jax.eval_shape(lambda: self._paged(dense_row).cache)
            pool_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs_like(pool))
            # (of a batch of one, its length and table are no data group's: only its buffers are kept)
            pool_shardings = pool_shardings.replace(lengths=replicated, pages=replicated)
            pool = jax.jit(lambda: self._paged(dense_row).cache, out_shardings=pool_shardings)()
            state = _with_pool(state, pool)
            # (the feature pool split by page over "data": each data group its pages')
            by_page = NamedSharding(mesh, row_spec() if spec.proposer_reads_features else P())
            features = jax.jit(lambda: jnp.zeros(self._features_shape(), spec.dtype), out_shardings=by_page)
            self.features = features()
        self.blocks = _entry_blocks(state)
        self.shardings = jax.tree.map(lambda x: x.sharding, state)
        return state

    @property
    def width(self) -> int:
        """The width of the running state."""
        return int(self.state.done.shape[0])

    # ----- the state ---------------------------------------------------------------------------

    def write(self, row: DecodeState, slot: int, table: np.ndarray | None = None) -> None:
        """A prefilled row (a batch of one) into free slot `slot`: dense, or a paged row whose
        cache is in the pool already (`pages_row`); with `table`, a dense row into a paged state,
        its keys and values copied into the pages of `table` ([table_width] page ids: the row's
        pages, then null)."""
        kind = "write" if table is None else "write_paged"
        if self.shardings is not None:  # on a mesh: the row where the program reads it (a paged
            # row's proposer cache, made from the pool's, may come split where the free row was not)
            row = jax.tree.map(_placed, row, self.programs[(kind, self.width)].input_shardings[0][1])
        if table is None:
            self.state = self.run(kind, self.width, self.state, row, jnp.int32(slot))
        else:
            args = (self.state, row, jnp.int32(slot), jnp.asarray(table, jnp.int32))
            self.state = self.run(kind, self.width, *args)

    def placed_row(self, row) -> DecodeState:
        """A row made elsewhere (another engine's devices, or the host: handoff.py) checked against
        this batch's rows (HandoffError for another shape) and put where they are."""
        check_row(row, self.row_like)
        return jax.device_put(row, jax.tree.map(lambda x: x.sharding, self.row_like))

    @property
    def groups(self) -> int:
        """The data groups a paged pool is split over (1 off a data-parallel mesh): the rows of a
        paged prefill's programs, one per group (engine_programs.pool_chunks)."""
        return 1 if self.paged is None else self.paged.groups

    def _no_hidden(self) -> jax.Array:
        """[groups, D] zeros: a paged prefill's hidden states before its first chunk (on a mesh
        whole on every device, where `pool_chunks` returns them)."""
        zeros = np.zeros((self.groups, self.spec.config.hidden_size), jnp.dtype(self.spec.dtype))
        return (
            jnp.asarray(zeros) if self.spec.mesh is None else place(zeros, NamedSharding(self.spec.mesh, P()))
        )

    def _group_rows(self, group: int, value, width: int) -> np.ndarray:
        """[groups, width] int32 zeros, with `value` (its first entries) in row `group`."""
        rows = np.zeros((self.groups, width), np.int32)
        rows[group, : len(value)] = value
        return rows

    def prefill_pages(
        self, table: np.ndarray, prompt, start: int, count: int, last_hidden=None, group: int = 0
    ) -> jax.Array:
        """`count` chunks of a prompt into the pool through its `table` (the pages of data group
        `group`), from position `start` (its cached prefix's end); returns the hidden states at
        its last token once a chunk held it ([groups, D], its row `group`: to pass to the next
        call, then to `pages_row`)."""
        C, cache, R = self.page_chunk, self.state.cache, self.groups
        tokens = self._group_rows(group, prompt, self.spec.capacity + C)
        tables = self._group_rows(group, table, self.paged.table_width)
        starts, lengths = np.zeros(R, np.int32), np.zeros(R, np.int32)
        starts[group], lengths[group] = start, len(prompt)
        if last_hidden is None:
            last_hidden = self._no_hidden()
        args = (self._pool(), self.features, *map(jnp.asarray, (tables, tokens, starts, lengths)))
        args = (*args, jnp.int32(count), last_hidden)
        k, v, self.features, last_hidden = self.run("pool_chunks", C, self.params, *args)
        self.state = _with_pool(self.state, cache.replace(k=k, v=v))
        return last_hidden

    @property
    def packs(self) -> bool:
        """Whether several prompts' prefills share passes (`prefill_packed`): on pages that the
        attention kernel reads in place (LoopSpec.packs_prefill's rule), on one data group (a
        pass's packed tokens would cross the groups' pages)."""
        return (
            self.paged is not None
            and self.groups == 1
            and pages_pack(self.paged.page_size, self.spec.backend, self.spec.config, self.spec.dtype)
        )

    def prefill_packed(self, tables: np.ndarray, prompts: list, starts: list[int]):
        """Prompts' tokens (at most max_batch of them, from starts[i], past their cached prefixes)
        into the pool through their `tables` [n, W], packed into the same passes; returns the
        hidden states [max_batch, D] at their last tokens (row i for prompt i, to `pages_row`)."""
        R, W = self.spec.batch_size, self.paged.table_width
        tokens = np.zeros((R, self.spec.capacity), np.int32)
        table = np.zeros((R, W), np.int32)
        start, length = np.zeros(R, np.int32), np.zeros(R, np.int32)
        for i, prompt in enumerate(prompts):
            tokens[i, : len(prompt)], table[i], start[i], length[i] = (
                prompt,
                tables[i],
                starts[i],
                len(prompt),
            )
        cache = self.state.cache.replace(lengths=jnp.asarray(start), pages=jnp.asarray(table))
        args = (self.params, cache, self.features, *map(jnp.asarray, (table, tokens, start, length)))
        k, v, self.features, last_hidden = self.run("pool_packed", R, *args)
        self.state = _with_pool(self.state, self.state.cache.replace(k=k, v=v))
        return last_hidden

    def _pool(self):
        """The running state's pool as a cache of a row per data group (whose lengths and tables
        the paged prefill's programs set): the pool's buffers alone are the state's, so that a
        program donating them leaves the running rows' lengths and tables as they are."""
        zeros = jnp.zeros((self.groups, self.paged.table_width), jnp.int32)
        return self.state.cache.replace(lengths=zeros[:, 0], pages=zeros)

    def pages_row(self, bucket: int, table: np.ndarray, last_hidden, inputs, group: int = 0) -> DecodeState:
        """The row of a prompt whose chunks are in the pool (in data group `group`'s pages, its
        hidden state row `group` of `last_hidden`; inputs: its prompt padded to `bucket`), without
        the pool, for `write`."""
        tables = jnp.asarray(self._group_rows(group, table, self.paged.table_width))
        args = (self.params, self.proposer_params, self._pool(), self.features, tables)
        return self.run("pool_row", bucket, *args, last_hidden, inputs, jnp.int32(group))

    def precompile_prefills(self, lengths: list[int], bucket_of) -> None:
        """Compile the prefills of prompts of these lengths (`bucket_of(n)`: a one-pass prefill's
        bucket): dense, the one-pass prefill of each bucket up to the chunk (with logprobs, the one
        that scores the prompt too) and a long prompt's chunk and finish per power-of-two bucket;
        paged, the row of each bucket (the chunks are one program, compiled at start)."""
        params, proposer = self.params, self.proposer_params
        chunk = self.chunk
        short = [n for n in lengths if chunk is None or n <= chunk or self.paged is not None]
        for bucket in sorted({bucket_of(n) for n in short}):
            inputs = self.free_inputs(1, bucket)
            if self.paged is None:
                self.program("prefill", bucket, params, proposer, inputs)
            else:
                last_hidden = self._no_hidden()
                tables = jnp.asarray(self.paged.free_tables(self.groups))
                args = (params, proposer, self._pool(), self.features, tables, last_hidden, inputs)
                self.program("pool_row", bucket, *args, jnp.int32(0))
            if self.logprobs is not None:  # a request's prompt_logprobs (or echo's)
                self.program("scored_prefill", bucket, params, proposer, inputs)
        long = [n for n in lengths if n not in short]
        if long:
            partial = self.program("start_prompt", chunk, params)(params)
            tokens, start = jnp.zeros((1, chunk), jnp.int32), jnp.int32(0)
            self.program("prompt_chunk", chunk, params, partial, tokens, start, start)
        for bucket in sorted({min(1 << (n - 1).bit_length(), self.spec.capacity) for n in long}):
            inputs = self.free_inputs(1, bucket)
            self.program("finish_prompt", bucket, params, proposer, partial, inputs)

    def move(self, source: int, slot: int) -> None:
        """The row in slot `source` copied into slot `slot` (a paged row: its table)."""
        self.state = self.run("move", self.width, self.state, jnp.int32(source), jnp.int32(slot))

    def set_tables(self, tables: np.ndarray) -> None:
        """The running rows' page tables [width, table_width] (a host write: no program; on a mesh
        placed where the programs read them)."""
        tables = np.asarray(tables, np.int32)
        tables = jnp.asarray(tables) if self.shardings is None else place(tables, self.shardings.cache.pages)
        self.state = self.state.replace(cache=self.state.cache.replace(pages=tables))

    def finish_row(self, slot: int) -> None:
        """Mark slot `slot`'s row done (its request aborted or preempted)."""
        done = np.array(fetch(self.state.done))
        done[slot] = True
        self.replace(done=done)

    def replace(self, **fields) -> None:
        """The running state with `fields` (host arrays) replaced (on a mesh, placed where the
        programs read them: `sharding.place`, each process its own devices' part)."""
        if self.shardings is None:
            fields = {name: jnp.asarray(value) for name, value in fields.items()}
        else:
            fields = {name: place(value, getattr(self.shardings, name)) for name, value in fields.items()}
        self.state = self.state.replace(**fields)

    def resize(self, width: int) -> None:
        """Bring the running state to `width` slots: its first slots kept, free rows added past
        them (in one program from any width: `_compile_width_programs`) or free slots dropped (one
        program width at a time: a narrower copy is cheap).

        Narrowing keeps the widest state it narrowed from (`spare`), and growth back to exactly
        that width writes into its buffers (`fill`, in place); growth past it drops it first. So
        beside the running state the batch may hold the spare, and while a step up into fresh
        memory runs, the new state too: at most 1.75 times a max_batch-wide state where max_batch
        is a power of two (a spare of max_batch, the running state of a quarter of it growing to
        half), which the engine's memory check does not count. A paged pool is no part of it: these
        programs run on the state without it (`_bare`), and it is put back as it was."""
        pool = None if self.paged is None else self.state.cache
        state = self.state if pool is None else without_pool(self.state)
        spare_width = None if self.spare is None else int(self.spare.done.shape[0])
        if width > self.width and width == spare_width:
            spare, self.spare = self.spare, None
            state = self.run(("fill", self.width), width, spare, state, self.free_row)
        elif width > self.width:
            if spare_width is not None and spare_width < width:
                self.spare = None  # past the width it could serve: its memory goes first
            state = self.run(("resize", width), self.width, state, self.free_row)
        while state.done.shape[0] > width:
            now = int(state.done.shape[0])
            narrower = self.widths[self.widths.index(now) - 1]
            wider = state
            state = self.run(("resize", narrower), now, state, self.free_row)
            if self.spare is None or self.spare.done.shape[0] < wider.done.shape[0]:
                self.spare = wider
        self.state = state if pool is None else _with_pool(state, pool)

    def state_shape(self, width: int):
        """The shapes of a running state `width` slots wide (what the loop compiles for); on a
        mesh (one width) with the state's shardings."""
        if self.spec.mesh is not None:
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state
            )
        shape = self.bare_shape(width)
        if self.paged is None:
            return shape
        return _with_pool(shape, jax.eval_shape(lambda: self.state.cache))

    def bare_shape(self, width: int):
        """The same without a paged pool (what the programs that change the width compile for)."""
        return jax.eval_shape(
            functools.partial(engine_programs.repeat_rows, self.batch_axes(), width), self.free_row
        )

    def _paged(self, dense_row: DecodeState) -> DecodeState:
        """A dense batch-of-one row with its cache replaced by an empty pool of every page and a
        table of null pages."""
        paged = self.paged
        cache = paged_cache(
            self.spec.config,
            paged.free_tables(1),
            paged.page_size,
            paged.num_pages,
            self.spec.cache_dtype,
            like=self.params.layers,
        )
        return dense_row.replace(cache=cache.replace(lengths=dense_row.cache.lengths))

    # ----- programs ----------------------------------------------------------------------------

    def batch_axes(self):
        """Per leaf of a DecodeState, the axis that holds its rows (SHARED by all rows: the step
        counter, a paged pool), found by comparing the prefill's shapes at batch sizes 1 and 2."""
        if self._axes is None:
            axes = engine_programs.batch_axes(*(self._prefill_shapes(n) for n in (1, 2)))
            if self.paged is not None:  # the tables' rows on axis 0; the pool is every row's
                cache = self.free_row.cache
                axes = axes.replace(
                    cache=cache.replace(
                        k=(SHARED,) * len(cache.k), v=(SHARED,) * len(cache.v), lengths=0, pages=0
                    )
                )
            self._axes = axes
        return self._axes

    def input_axes(self):
        """Per leaf of a prefill's inputs (GenerationInputs), the axis that holds its rows, found
        once."""
        if self._input_axes is None:
            self._input_axes = engine_programs.batch_axes(self.free_inputs(1), self.free_inputs(2))
        return self._input_axes

    def slot_axes(self):
        """Per leaf of a request's row, the axis of its cache slots (SHARED: none), found by
        comparing the prefill's shapes at two capacities: what a row sent as bytes keeps only the
        filled part of (handoff.py, `encode_row`)."""
        if self._slot_axes is None:
            shapes = [self._prefill_shapes(1, capacity=self.spec.capacity + n) for n in (0, 16)]
            self._slot_axes = jax.tree.map(
                lambda a, b: next(
                    (i for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if x != y), SHARED
                ),
                *shapes,
            )
        return self._slot_axes

    def _prefill_shapes(self, batch: int, capacity: int | None = None):
        spec = dataclasses.replace(self.prefill_spec, batch_size=batch)
        if capacity is not None:
            spec = dataclasses.replace(spec, capacity=capacity)
        traced = functools.partial(engine_programs.prefill_row, spec)
        return jax.eval_shape(traced, self.params, self.proposer_params, self.free_inputs(batch))

    def run(self, kind, size: int, *args):
        """Call a program, compiled ahead of time on its first call (`program`). On a mesh that
        spans processes, the host's arguments first become global arrays where the program takes
        them (each process fills its own devices' part from its copy: `sharding.place`)."""
        program = self.program(kind, size, *args)
        if self.spans:
            args = jax.tree.map(_placed, args, program.input_shardings[0])
        return program(*args)

    def program(self, kind, size: int, *args):
        """The compiled program (kind, size), compiled for `args` (arrays or their shapes) if it is
        not yet. `size` is the width in slots of the state it takes (a prompt bucket for
        "prefill"); ("resize", to) and ("fill", from) also name the other width."""
        key = (kind, size)
        if key not in self.programs:
            program, statics = self._statics(kind, size)
            with warnings.catch_warnings():
                # finish_prompt donates a long prompt's partial row for its cache, and its other
                # buffers (the features, the last hidden state) have no output to go to.
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                jitted = engine_programs.jitted(program, *statics, out_shardings=self._out_shardings(kind))
                self.programs[key] = jitted.lower(*args).compile()
            self.num_compiles += 1
        return self.programs[key]

    def _out_shardings(self, kind):
        """On a mesh, where a program that returns the running state puts it: where the state's
        first prefill put it (`shardings`), so that every program compiled for the state takes
        what another returned; None elsewhere (the compiler chooses)."""
        if self.shardings is None:
            return None
        if kind in ("write", "write_paged"):
            return self.shardings
        if kind in self.loops:  # (the state, the chunk's tokens, their logprobs)
            return (self.shardings, None, None)
        if kind in ("start_prompt", "prompt_chunk"):  # a long prompt's partial row, between its
            # chunks on every device whole (each chunk's programs compiled for where it lies)
            return NamedSharding(self.spec.mesh, P())
        if kind in ("pool_chunks", "pool_packed"):  # (the pool's keys, values, features, and the
            # hidden states whole on every device, as the first call's zeros and pool_row take them)
            cache = self.shardings.cache
            return (cache.k, cache.v, self.features.sharding, NamedSharding(self.spec.mesh, P()))
        return None

    def _statics(self, kind, size: int) -> tuple[str, tuple]:
        """(the engine_programs kind, its static arguments) of the program (kind, size): a loop by
        its name in `loops` (engine_loops.py), "scored_prefill", or one of
        engine_programs.PROGRAMS; anything else is an error."""
        if kind in self.loops:  # the loop over the running state, `size` slots wide
            return "resume", (dataclasses.replace(self.loops[kind], batch_size=size), self.window)
        one = self.prefill_spec
        if kind == "prefill":  # one request's row, its prompt padded to `size`
            return kind, (dataclasses.replace(one, prompt_bucket=size),)
        if kind == "batch_prefill":  # a mesh's running state of `size` free slots
            return "prefill", (dataclasses.replace(self.spec, batch_size=size, page_size=None),)
        if kind == "scored_prefill":  # the same, scoring the prompt's tokens (Request.prompt_logprobs)
            return "prefill", (dataclasses.replace(one, prompt_bucket=size, prompt_logprobs=self.logprobs),)
        if kind == "pool_packed":  # `size` prompts packed
            return kind, (dataclasses.replace(self.spec, batch_size=size, prefill_chunk=self.page_chunk),)
        if kind in ("pool_chunks", "pool_row"):  # a paged prefill, a row per data group (`size`:
            # the chunk, the bucket)
            paged = dataclasses.replace(self.spec, batch_size=self.groups, prefill_chunk=self.page_chunk)
            if kind == "pool_chunks":
                return kind, (paged,)
            axes = (self.input_axes(), self.batch_axes())
            return kind, (dataclasses.replace(paged, prompt_bucket=size), axes)
        if kind in ("start_prompt", "prompt_chunk", "finish_prompt"):  # a long prompt's (`size`:
            # the chunk, or the bucket the finish pads the prompt to)
            return kind, (dataclasses.replace(one, prompt_bucket=size, prefill_chunk=self.chunk),)
        if kind == "may_draft":
            return kind, (self.spec,)
        axes = self.batch_axes()  # the programs over the running state read its rows' axes
        if kind == "write":
            return kind, (self.spec, axes, self.blocks)
        if kind == "write_paged":
            return kind, (self.spec, axes, self.spec.mesh)
        if kind == "move":
            return kind, (axes, size)
        if isinstance(kind, tuple) and kind[0] == "resize":  # `size` slots wide -> kind[1] wide
            return "resize", (axes, size, kind[1])
        if isinstance(kind, tuple) and kind[0] == "fill":  # kind[1] slots wide -> `size` wide, in place
            return "fill", (axes, kind[1], size)
        raise ValueError(
            f"unknown engine program {kind!r}: a loop ({', '.join(self.loops)}) or one of "
            f"{', '.join(engine_programs.PROGRAMS)}"
        )

    def _compile_width_programs(self, dense_row: DecodeState) -> None:
        """Compile, at start, the small programs that write a prefilled row (`dense_row`'s shapes)
        into the running state at each width, move a row between its slots, move the state to any
        wider width or to the next narrower one, and fill the kept buffers of a wider state from
        any narrower one: a request's arrival or a freed slot never compiles while the engine
        serves."""
        row, slot = self.free_row, jnp.int32(0)
        if self.spec.mesh is not None:  # one width; its rows never move
            self.program("write", self.width, self.state, row, slot)
            if self.paged is not None:
                table = jnp.asarray(self.paged.free_tables(1)[0])
                self.program("write_paged", self.width, self.state, dense_row, slot, table)
                self._compile_paged_prefills()
            return
        for w in self.widths:
            self.program("write", w, self.state_shape(w), row, slot)
            if self.paged is not None:  # (a dense row: a prompt whose logprobs its prefill scores)
                table = jnp.asarray(self.paged.free_tables(1)[0])
                self.program("write_paged", w, self.state_shape(w), dense_row, slot, table)
            if w > 1:
                self.program("move", w, self.state_shape(w), slot, slot)
        for small, big in itertools.combinations(self.widths, 2):
            self.program(("resize", big), small, self.bare_shape(small), row)
        for small, big in itertools.pairwise(self.widths):
            self.program(("resize", small), big, self.bare_shape(big), row)
        for small, big in itertools.combinations(self.widths, 2):
            self.program(("fill", small), big, self.bare_shape(big), self.bare_shape(small), row)
        if self.paged is not None:
            self._compile_paged_prefills()

    def _compile_paged_prefills(self) -> None:
        """The paged prefill's chunks: one program for every prompt (run once on nothing); and
        the packed one, for every admission of several."""
        self.prefill_pages(self.paged.free_tables(1)[0], [0], 0, 0)  # (group 0's row: any)
        if self.packs:
            self.prefill_packed(self.paged.free_tables(0), [], [])


def _placed(value, sharding):
    """A program's argument where the program reads it (`sharding.place`: a host value becomes a
    global array, each process filling its own devices; a device array is resharded); one whose
    sharding is not a mesh's (an argument the program does not read) as it is."""
    return place(value, sharding) if isinstance(sharding, NamedSharding) else value


def _entry_blocks(state: DecodeState):
    """Per leaf of a mesh's running state, how its rows are ordered over the devices
    (engine_programs.Blocks): a KV cache buffer split over "model" device block by device block
    (its merged rows-and-heads axis, `sharding.entry_blocks`), everything else in order."""

    def blocks(node):
        if not isinstance(node, KVCache):
            return jax.tree.map(lambda _: IN_ORDER, node)
        order = [Blocks(*b) if (b := entry_blocks(x, x.ndim - 3)) else IN_ORDER for x in (*node.k, *node.v)]
        n = len(node.k)
        return node.replace(
            k=tuple(order[:n]),
            v=tuple(order[n:]),
            lengths=IN_ORDER,
            pages=jax.tree.map(lambda _: IN_ORDER, node.pages),
        )

    return jax.tree.map(blocks, state, is_leaf=lambda x: isinstance(x, KVCache))


def _with_pool(state, pool):
    """`state` (a bare one, or its shapes) with the pool buffers of cache `pool` put back."""
    return state.replace(cache=state.cache.replace(k=pool.k, v=pool.v))
