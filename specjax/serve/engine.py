"""Continuous batching over the compiled loop: requests join and leave a running batch.

The engine keeps up to `max_batch` slots on the device: one `DecodeState` of the first `width`
slots (the smallest of 1, 2, 4, ..., max_batch holding the running requests; the slots past it
are free), with a cache of `max_model_len` tokens (and a verify pass's room) per row. Compiled
programs move it, each compiled ahead of time (docs/serving.md):

- prefill (one per prompt bucket, on first use or at `precompile`): one request's row (the
  target's cache, its proposer's state, its first token); write (one per width, at start) puts
  it into a free slot, the other slots untouched;
- a prompt longer than `prefill_chunk` tokens is prefilled in chunks instead, one chunk per
  `step` between the running rows' chunks (all of them back to back when nothing else runs):
  start_prompt and prompt_chunk (one program each, whatever the prompt's length), then
  finish_prompt (one per power-of-two bucket: the proposer's state and the first token) and
  write. One long prompt is in chunks at a time; shorter ones are admitted beside it;
- move (one per width, at start): a running row copied into a free slot below it, when requests
  finishing have left the others fitting a narrower width for more than `narrow_after` chunks;
- resize (at start: one per pair of widths up, one per neighbouring pair down): the state grown
  to a wider width in one program (free rows added) or one width down (free slots dropped), run
  only when the width changes;
- fill (one per pair of widths, at start): the growth back to a width the state narrowed from,
  written in place into the buffers of that wider state, kept since;
- resume (`loop.resume_program`, one per width, on first use or at `precompile`): the decoding
  loop over the state, for at most `chunk_steps` steps (`admission_steps` while a slot is free),
  or until a row finishes; only each row's new tokens and the metric counters come back to the
  host. A lean variant serves the chunks whose requests are all greedy without penalties or bias,
  and with `EngineConfig.logprobs` a variant of each computes logprobs for the chunks in which a
  request asked for them (engine_loops.py);
- the state stays on the device between calls (donated: updated in place).

On a paged cache (EngineConfig.page_size; engine_batch.py, engine_pages.py) the rows' caches are
one pool of pages that each row reads through its page table; a prompt is prefilled straight into
its pages, from the end of the prefix the prefix cache holds of it (pool_chunks: one program; a
long prompt's chunks one per `step`, as above), and its row made from them (pool_row, one per
bucket); tables change between chunks as rows grow, and the newest request is preempted when the
pool runs out (started again later, its tokens regenerated, not sent twice).

Everything that makes `generate` exact holds per row: a request's greedy tokens are those of
`generate` on it alone, and a seeded request draws the same numbers whatever runs beside it and
whenever it joins (its steps are numbered from its own prefill, `DecodeState.first_step`).

Sampling options are per-row arrays, so one program serves every request: the engine's
`WarpSpec` enables every option by default (the filters look at `TOP_P_CANDIDATES` logits and
sort when a row keeps more, as `generate` does). Stop strings use one automaton over the stop
strings of the running requests; when a request brings new ones, the automaton is rebuilt and the
running rows carried over to it (`StopStringSet.move_states`), in tables of a fixed size
(`max_stop_states`) so that the programs never recompile for it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import planner
from specjax.checks import is_int
from specjax.models.model import Model
from specjax.serve import engine_loops
from specjax.serve.engine_admission import Admissions
from specjax.serve.engine_automata import ConstraintPool, StopStringTables
from specjax.serve.engine_batch import EngineBatch
from specjax.serve.engine_config import (
    MAX_STOP_TOKEN_IDS,
    EngineConfig,
    EngineStats,
    Request,
    Update,
    admission_bucket,
    check_request,
)
from specjax.serve.engine_inputs import (
    SlotInputs,
    check_engine_mesh,
    check_memory,
    check_warp,
    engine_capacity,
    placed_weights,
)
from specjax.serve.engine_pages import DenseRows, SlotPages, paged_layout
from specjax.serve.engine_rows import COUNTERS, PromptInChunks, Restart, Running, row_counters
from specjax.serve.handoff import Handoffs, can_hand_over, encode_row
from specjax.serve.lockstep import Follower, Leader, lockstep_for
from specjax.sharding import data_degree, fetch
from specjax.speculate.logprobs import Logprobs
from specjax.speculate.loop import LoopSpec, program_params
from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.proposers import resolve
from specjax.speculate.sampling import Sampling
from specjax.speculate.stops import cut_text

MIN_BUCKET = planner.MIN_BUCKET


class Engine(Admissions):
    """A batch of `config.max_batch` slots that requests join and leave (see the module's docstring).

    Drive it from one thread: `add` requests, call `step` while `has_work`, read the Updates.

    model: a specjax Model; proposer: any proposer `generate` takes (None: plain decoding).
    config: an EngineConfig (its fields' docstrings say what each does); or its fields as keyword
    arguments, `Engine(model, proposer, max_batch=16, chunk_steps=8)`.

    `stats` (EngineStats) says where the time went: admissions, and chunks and steps by width.
    `num_compiles` counts the programs compiled: the empty batch's prefill, one admission per
    prompt bucket, and the loop at each width (a lean one for all-greedy chunks, the full one for
    the rest; with Dynamic, a quiet variant of each for chunks in which no row drafts, and a
    check of which runs), each on first use unless `precompile` compiled it before.
    """

    def __init__(
        self,
        model: Model,
        proposer=None,
        config: EngineConfig | None = None,
        mesh=None,
        prefiller=None,
        lockstep_address: str | None = None,
        **options,
    ):
        planner.check_model(model)
        if config is not None and options:
            raise ValueError(f"Engine: give a config or its fields ({', '.join(options)}), not both")
        if config is None:
            config = EngineConfig(**options)
        elif not isinstance(config, EngineConfig):
            raise ValueError(f"config must be a specjax.EngineConfig, got {type(config).__name__}")
        context = model.config.max_position_embeddings
        if config.max_model_len is None:
            config = dataclasses.replace(config, max_model_len=context)
        if config.max_model_len > context:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context of {context} tokens"
            )
        self.model, self.proposer, self.config = model, proposer, config
        self.prefiller = prefiller  # where requests' rows come from by default (`add`)
        self._fitting_narrower = 0  # chunks in a row whose running requests fit a narrower width
        warp = config.sampling_paths
        check_engine_mesh(mesh, model, config, prefiller)
        self.mesh = mesh
        backend = planner.backend_for(
            model, config.kernels, config.matmul_precision, config.scan_layers, mesh
        )
        proposer_spec, proposer_params = resolve(proposer, model, warp, mesh)
        resolved_params = proposer_params
        page_size = planner.check_page_size(config.page_size, model.config, None)  # (a mesh: below)
        capacity = engine_capacity(config, proposer_spec)
        if page_size is not None:  # whole pages: a row's table covers its capacity exactly
            capacity = -(-capacity // page_size) * page_size
        self.spec = LoopSpec(
            config=model.config,
            batch_size=config.max_batch,
            prompt_bucket=MIN_BUCKET,
            capacity=capacity,
            page_size=page_size,
            warp=warp,
            proposer=proposer_spec,
            mesh=mesh,
            dtype=model.params.dtype.name,
            cache_dtype=planner.cache_dtype_of(model, config.cache_dtype),
            backend=backend,
            logprobs=planner.check_logprobs(config.logprobs, model.config.vocab_size),
        )
        layout = paged_layout(config, self.spec, groups=1 if mesh is None else data_degree(mesh))
        self._pages = None if layout is None else SlotPages(layout, config, self.spec)
        # What the KV cache holds and how much of it is in use (`kv_cache.summary()`, `.usage`,
        # `.capacity_tokens`, `.prefix_counts`, `.reset_prefix_cache()`), dense or paged
        self.kv_cache = DenseRows(config, self.spec) if self._pages is None else self._pages
        check_memory(self.config, self.spec, model.params, None if layout is None else self._pages.bytes)
        params, proposer_params, prefill_spec = placed_weights(self.spec, model, proposer, proposer_params)
        if backend.scans_layers:  # once: stacked layers are a copy, not to be made every chunk
            with backend.tracing():
                params, proposer_params = jax.jit(program_params, static_argnums=0)(
                    self.spec, params, proposer_params
                )
        self._params, self._proposer_params = params, proposer_params
        loops = engine_loops.loop_specs(self.spec, proposer, model, resolved_params)
        # On a mesh, one width: the rows' caches are split over its devices, and moving rows
        # between widths would move them between devices (a free slot costs its masked compute).
        self._widths = config.widths if mesh is None else [config.max_batch]
        self.k = self.spec.k
        window = config.chunk_steps * (self.k + 1) + 1
        self._key = jax.random.key(0) if config.key is None else planner.as_key(config.key)
        self._eos = frozenset(planner.eos_ids(model))
        self._chunk = config.prefill_chunk
        self.stats = EngineStats()

        self._ids = itertools.count()
        self._in_chunks: PromptInChunks | None = None  # the long prompt being prefilled, if any
        # Requests preempted (paged: the pool ran out), waiting to start again: the tokens each had
        # reported, which its new start regenerates without sending them twice
        self._restarts: dict[int, Restart] = {}
        self._pending: list = []  # admissions of this step whose packed prefill is to run
        self._handoffs = Handoffs()  # rows asked of prefillers (handoff.py), by request id
        self._failed: list[Update] = []  # the final Updates of requests whose rows never came
        self._admitted = itertools.count()  # admission order: the newest is preempted first
        self._waiting: collections.deque[tuple[int, Request]] = collections.deque()
        self._slots: list[Running | None] = [None] * config.max_batch
        self._samplings: list[Sampling] = [Sampling()] * config.max_batch
        self._stops = None  # the running requests' stop strings' automaton (engine_automata.py)
        if model.tokenizer is not None:
            self._stops = StopStringTables(
                model.tokenizer, model.config.vocab_size, config.max_batch, config.max_stop_states
            )
        self._constraints = None  # their constraints' automata (engine_automata.py)
        if config.constraint_states is not None:
            self._constraints = ConstraintPool(
                model.tokenizer,
                model.config.vocab_size,
                self._eos,
                config.constraint_states,
                config.constraint_edges,
            )
        self._inputs = SlotInputs(
            self._slots,
            self._samplings,
            self._stops,
            self._constraints,
            self._key,
            model.config.vocab_size,
            warp,
        )
        # The running part of the batch on the device (engine_batch.py): the state of the first
        # `width` slots, the smallest program width holding the running requests (slots past it
        # are free). It is kept at that width between chunks and resized only when the width
        # changes: a chunk that sliced its slots out of a max_batch-wide state and wrote them
        # back copied their KV cache twice (docs/serving.md).
        self._batch = EngineBatch(
            self.spec,
            loops,
            self._widths,
            window,
            self._chunk,
            config.logprobs,
            params,
            proposer_params,
            self._inputs.free,
            paged=layout,
            prefill_spec=prefill_spec,
        )
        # the loop's step counter, as the host last saw it
        self._step_count = int(fetch(self._batch.state.step))
        # On a mesh that spans processes, process 0 leads and the others follow (lockstep.py)
        self._lockstep = lockstep_for(mesh, lockstep_address)

    # ----- the public face -------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def chunk_steps(self) -> int:
        return self.config.chunk_steps

    @property
    def admission_steps(self) -> int:
        return self.config.admission_steps

    @property
    def narrow_after(self) -> int:
        return self.config.narrow_after

    @property
    def num_compiles(self) -> int:
        """Programs compiled so far (the class docstring says which)."""
        return self._batch.num_compiles

    @property
    def compiled(self) -> set:
        """The compiled programs' names: (kind, width or prompt bucket) pairs, as ("lean", 4)."""
        return set(self._batch.programs)

    @property
    def width(self) -> int:
        """The running state's width in slots (1, 2, 4, ... max_batch)."""
        return self._batch.width

    @property
    def num_waiting(self) -> int:
        """Requests not yet decoding: queued, or a long prompt part-way through its chunks."""
        return len(self._waiting) + (self._in_chunks is not None)

    @property
    def num_running(self) -> int:
        return sum(slot is not None for slot in self._slots)

    @property
    def has_work(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0

    def add(self, request: Request, prefiller=None) -> int:
        """Check a request and queue it; returns its id. ValueError naming what is wrong.

        prefiller: where its row comes from instead of this engine's prefill (handoff.py: a
        `LocalPrefiller` or `RemotePrefiller`; default the engine's `prefiller`), asked at once off
        this thread; the request is admitted when its row has arrived. A request a row cannot
        carry is prefilled here."""
        checked = self._checked(request)
        request_id = self._queue(checked)
        if isinstance(self._lockstep, Leader):
            self._lockstep.added(request)
        prefiller = self.prefiller if prefiller is None else prefiller
        if prefiller is not None and can_hand_over(checked):
            if checked.key is None:  # (the key this engine's own prefill would use)
                checked = dataclasses.replace(checked, key=jax.random.fold_in(self._key, request_id))
            self._handoffs.ask(request_id, checked, prefiller, self._batch.row_like)
        return request_id

    def prefill(self, request: Request):
        """The row of `request` (a DecodeState of a batch of one, on this engine's devices) for a
        decode engine to admit without prefilling (handoff.py), its prompt in one pass or in
        chunks as this engine would prefill it; nothing is queued here. ValueError as `add`'s,
        and for a request a row cannot carry (`can_hand_over`)."""
        request = self._checked(request)
        if not can_hand_over(request):
            raise ValueError(
                "prefill: a handed-over row carries no stop strings, constraint or prompt_logprobs"
            )
        key = request.key if request.key is not None else jax.random.fold_in(self._key, next(self._ids))
        n, params, proposer = len(request.prompt), self._params, self._proposer_params
        long = self._chunk is not None and n > self._chunk
        bucket = min(1 << (n - 1).bit_length(), self.spec.capacity) if long else self._bucket(n)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :n] = request.prompt
        inputs = self._inputs.request_row(request, self._stop_ids(request), padded, n, key)
        if not long:
            return self._batch.run("prefill", bucket, params, proposer, inputs)
        prompt = PromptInChunks(
            -1, request, self._batch.run("start_prompt", self._chunk, params), self._chunk
        )
        while not prompt.complete:
            prompt.partial = self._batch.run(
                "prompt_chunk", self._chunk, params, prompt.partial, *prompt.next_chunk()
            )
        return self._batch.run("finish_prompt", bucket, params, proposer, prompt.partial, inputs)

    def prefill_bytes(self, request: Request) -> bytes:
        """`prefill`'s row as bytes for a decode engine in another process (handoff.py,
        `encode_row`): only the slots the prompt and its first token filled, so that what crosses
        grows with the prompt, not with max_model_len."""
        row = self.prefill(request)
        return encode_row(row, self._batch.slot_axes(), len(request.prompt) + 1)

    def _checked(self, request: Request) -> Request:
        """The request checked (ValueError naming what is wrong), its prompt as ids and its key
        a PRNG key."""
        pool = None if self._pages is None else self._pages.capacity_tokens
        prompt = check_request(
            request, self.model.config.vocab_size, self.max_model_len, self.config.logprobs, pool
        )
        planner.check_token_options([request.sampling], self.model)
        if request.sampling.constraint is not None:
            self._check_constraint(request.sampling.constraint)
        check_warp(request.sampling, self.spec.warp)
        stop_ids = self._stop_ids(request)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"sampling.stop_token_ids: {len(stop_ids)} stop token ids with EOS, at most "
                f"{MAX_STOP_TOKEN_IDS} per request"
            )
        if self._stops is not None and request.sampling.stop:
            self._stops.check(request.sampling.stop)
        if request.key is not None:
            request = dataclasses.replace(request, key=planner.as_key(request.key))
        return dataclasses.replace(request, prompt=prompt)

    def _queue(self, request: Request) -> int:
        request_id = next(self._ids)
        self._waiting.append((request_id, request))
        return request_id

    def prepare(self, sampling: Sampling) -> None:
        """Compile now, on the calling thread, what a request's options need on the host before
        `add` (its constraint's automaton, cached; seconds for a nested JSON schema), so that a
        server calls it off the thread that steps the engine and the running rows do not wait.
        ValueError as `add`'s."""
        if sampling.constraint is not None:
            self._check_constraint(sampling.constraint)

    def abort(self, request_id: int) -> list[Update]:
        """Drop a waiting or running request: its final Update (finish_reason "abort"), or [] if
        it is not here (finished already, or never added)."""
        if isinstance(self._lockstep, Leader):
            self._lockstep.aborted(request_id)
        for i, (waiting_id, _) in enumerate(self._waiting):
            if waiting_id == request_id:
                del self._waiting[i]
                self._restarts.pop(request_id, None)
                self._handoffs.drop(request_id)
                return [self._final(request_id, [], "abort", None)]
        if self._in_chunks is not None and self._in_chunks.request_id == request_id:
            self._in_chunks = None  # (its partial row's memory goes with it; its pages now)
            if self._pages is not None:
                self._pages.drop(request_id)
            return [self._final(request_id, [], "abort", None)]
        for b, slot in enumerate(self._slots):
            if slot is not None and slot.request_id == request_id:
                self._batch.finish_row(b)
                self._free(b)
                return [self._final(request_id, [], "abort", None)]
        return []

    def step(self) -> list[Update]:
        """Admit waiting requests into free slots, run the loop for one chunk, report."""
        if isinstance(self._lockstep, Leader):
            self._lockstep.step()
        start, admitted = time.perf_counter(), self.stats.admissions
        # The state grows once to the width that the requests admitted below will need (they take
        # the lowest free slots): growing one width at a time copied most rows several times.
        free = [b for b, slot in enumerate(self._slots) if slot is None][: len(self._waiting)]
        if free:
            self._batch.resize(max(self._batch.width, min(w for w in self._widths if w > free[-1])))
        chunks = self.stats.prompt_chunks
        self._admit_waiting()
        if self.stats.admissions > admitted or self.stats.prompt_chunks > chunks:
            partial = None if self._in_chunks is None else self._in_chunks.partial
            jax.block_until_ready((self._batch.state, partial))  # (the prefills' time, not the next chunk's)
            self.stats.admission_s += time.perf_counter() - start
        failed, self._failed = self._failed, []  # requests whose rows never came (handoff.py)
        if self.num_running == 0:
            if self._waiting and all(self._handoffs.waits_for(i) for i, _ in self._waiting):
                time.sleep(0.001)  # (nothing to run until a row arrives)
            return failed
        # The chunk runs over the first `width` slots only: the smallest program width holding
        # the running requests, once they have fit it for more than narrow_after chunks.
        # Admission fills the lowest free slot, and requests left past that width by others
        # finishing move down into free slots: free slots past it cost nothing, so a lightly
        # loaded engine steps at the cost of its few rows, not of max_batch or of where its last
        # requests happened to sit.
        width = min(w for w in self._widths if w >= self.num_running)
        if width < self._batch.width:  # narrow only once it has held for narrow_after chunks
            self._fitting_narrower += 1
            # ... and not when every running request ends within this chunk (the tail of a burst
            # whose rows finish a few steps apart): the moves and the copy into a narrower state
            # cost more than its cheaper steps would save over one chunk (docs/serving.md).
            if self._fitting_narrower <= self.narrow_after or self._steps_left() <= self.chunk_steps:
                width = self._batch.width
            else:  # narrowing: the count starts again, so that a later narrowing waits too
                self._fitting_narrower = 0
        else:
            self._fitting_narrower = 0
        self._move_below(width)
        self._batch.resize(width)
        reported = np.asarray([0 if s is None else s.reported for s in self._slots[:width]], np.int32)
        # A chunk whose requests are all greedy without penalties or bias runs the lean program;
        # one in which a request asked for logprobs, a variant computing them; one in which no
        # row may draft, its quiet variant (engine_loops.py).
        running = [s for s in self._slots if s is not None]
        asked = any(s.request.logprobs is not None for s in running)
        kind = engine_loops.chunk_kind(self._batch.loops, [s.request.sampling for s in running], asked)
        quiet = engine_loops.quiet_kind(kind)
        if quiet in self._batch.loops and not self._batch.run("may_draft", width, self._batch.state):
            kind = quiet
        # While a slot is free, an arrival could take it: the chunk is short, so that a request
        # that comes while it runs waits little for its prefill. A chunk always ends when a row
        # finishes: its last tokens go out at once and its slot is free for the next request.
        # (So is it while a long prompt runs its chunks: one per chunk of the running rows.)
        pending = None in self._slots or self._in_chunks is not None
        max_steps = self.admission_steps if pending else self.chunk_steps
        if self._pages is not None:
            self._grow_rows(max_steps)
            tables = self._pages.take_changed(width)
            if tables is not None:
                self._batch.set_tables(tables)
        start = time.perf_counter()
        self._batch.state, window, logprobs = self._batch.run(
            kind,
            width,
            self._params,
            self._proposer_params,
            self._batch.state,
            self._inputs.at(width),
            jnp.int32(max_steps),
            jnp.asarray(reported),
        )
        state = self._batch.state
        window, logprobs, lengths, done, nonfinite, counters, step = fetch(
            (window, logprobs, state.lengths, state.done, state.nonfinite_step, state.metrics, state.step)
        )
        self.stats.add_chunk(
            width, int(step) - self._step_count, time.perf_counter() - start, engine_loops.is_quiet(kind)
        )
        self._step_count = int(step)
        updates = failed
        for b, slot in enumerate(self._slots):
            if slot is not None:
                updates.append(
                    self._report(b, slot, window, lengths[b], done[b], nonfinite[b], counters, logprobs)
                )
        return updates

    def _steps_left(self) -> int:
        """The most steps the running requests can still take: their largest count of tokens
        left to generate (each step commits at least one token a row; a stop ends one sooner)."""
        return max(s.request.max_new_tokens - len(s.tokens) for s in self._slots if s is not None)

    def precompile(self, prompt_lengths: Sequence[int] = ()) -> int:
        """Compile now what a chunk or an admission would otherwise compile on first use: the
        loop at every width (the lean variant and the full one, with logprobs the full one that
        computes them; with Dynamic, the quiet variant of each and the check of which one a chunk
        runs), and the prefill of the buckets of `prompt_lengths` (with logprobs, also the prefill
        that scores the prompt). A server calls it before taking requests: a program compiled while the
        engine serves stalls every running request for as long as it compiles (tens of seconds for
        a speculative loop on a small CPU). Returns the number of programs it compiled."""
        lengths = list(prompt_lengths)
        for length in lengths:
            if not is_int(length) or not (1 <= length <= self.max_model_len):
                raise ValueError(
                    f"prompt_lengths holds {length!r}: lengths must be integers in [1, {self.max_model_len}]"
                )
        before = self.num_compiles
        self._batch.precompile_prefills([int(n) for n in lengths], self._bucket)
        for width in self._widths:
            args = (
                self._params,
                self._proposer_params,
                self._batch.state_shape(width),
                self._inputs.at(width),
                jnp.int32(self.chunk_steps),
                jnp.zeros((width,), jnp.int32),
            )
            for kind in self._batch.loops:
                self._batch.program(kind, width, *args)
            if "resume-quiet" in self._batch.loops:
                self._batch.program("may_draft", width, self._batch.state_shape(width))
        return self.num_compiles - before

    def follow(self) -> None:
        """On a process other than 0 of a mesh that spans processes: make process 0's engine's
        calls (its adds, aborts and steps, lockstep.py) until it closes; a step that fails fails
        there too, and both go on."""
        if not isinstance(self._lockstep, Follower):
            raise ValueError(
                "follow: only an engine on a process other than 0 of a mesh spanning processes follows"
            )
        for message in self._lockstep.messages():
            try:
                self._lockstep.apply(self, message)
            except Exception as error:  # (the leader's step failed as well; its caller recovers)
                warnings.warn(f"a step failed as on process 0: {error}", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """On process 0 of a mesh that spans processes: let the other processes' `follow` return."""
        if isinstance(self._lockstep, Leader):
            self._lockstep.close()

    def run(self, requests: Sequence[Request]) -> dict[int, list[int]]:
        """Add requests and step until all are done: their new tokens by request id (for tests and
        scripts; a server reads `step`'s Updates as they come)."""
        ids = [self.add(r) for r in requests]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        while self.has_work:
            for update in self.step():
                tokens[update.request_id] += update.tokens
        return tokens

    def _bucket(self, length: int) -> int:
        """The prefill bucket of a prompt of `length` tokens (at most the cache's capacity)."""
        return min(admission_bucket(length), self.spec.capacity)

    def _free(self, b: int) -> None:
        if self._slots[b] is not None and self._samplings[b].constraint is not None:
            self._constraints.release(self._samplings[b].constraint)
        if self._pages is not None:
            self._pages.release(b)
        self._slots[b] = None
        self._samplings[b] = Sampling()

    def _report(self, b, slot: Running, window, length, done, nonfinite, counters, logprobs) -> Update:
        """Row b's Update after a chunk (window [B, ...] the chunk's new tokens by row)."""
        new = window[b, : length - slot.reported].tolist()
        slot.reported = int(length)
        before, slot.tokens = len(slot.tokens), slot.tokens + new
        # A restarted request's row regenerates what it had reported: sent once, and checked
        again = max(0, min(len(slot.resend) - before, len(new)))
        diverged = new[:again] != slot.resend[before : before + again]
        new = [] if diverged else new[again:]
        if diverged:  # it ends here, with an error, rather than with an answer not its own
            warnings.warn(
                f"request {slot.request_id}: started again after a preemption, it did not regenerate "
                "the tokens it had reported (a near-tie decided otherwise); it ends with an error",
                RuntimeWarning,
                stacklevel=2,
            )
            self._batch.finish_row(b)
            done = True
        if self._pages is not None and not self.spec.proposer_reads_features:
            # its generated tokens' full pages too (their cache holds every token but the last);
            # not where the proposer reads features, which only the prefill keeps with the pages
            self._pages.register(slot.request_id, [*slot.request.prompt, *slot.tokens[:-1]])
        now = row_counters(counters, b)
        delta = {name: now[name] - slot.seen[name] for name in COUNTERS}
        slot.seen = now
        reason = None
        if done:
            reason = "error" if nonfinite >= 0 or diverged else self._finish_reason(slot)
        update = Update(
            request_id=slot.request_id,
            tokens=new,
            finished=bool(done),
            finish_reason=reason,
            num_drafts=int(delta["drafting_steps"]),
            num_draft_tokens=int(delta["drafted"]),
            num_accepted_tokens=int(delta["accepted"]),
            accepted_per_pos=np.asarray(delta["accepted_at"]).astype(int).tolist(),
            prompt_logprobs=slot.prompt_logprobs,
        )
        slot.prompt_logprobs = None  # (sent with the first Update)
        slot.updated = True
        if slot.request.logprobs is not None:
            update.logprobs = Logprobs.of_row(logprobs, new, b, again).first(slot.request.logprobs)
        if done:
            row = jax.tree.map(lambda x: np.asarray(x)[b : b + 1], counters)
            elapsed = time.perf_counter() - slot.started
            update.metrics = SpecMetrics.from_counters(row, k=self.k, compile_time_s=0.0, run_time_s=elapsed)
            self._free(b)
        return update

    def _finish_reason(self, slot: Running) -> str:
        """As `generate`'s finish_reasons: "stop" at EOS, a stop token id or a stop string (even
        on the row's last allowed token), "length" when it ran out of new tokens."""
        request, tokens, cut = slot.request, slot.tokens, False
        if request.sampling.stop and self.model.tokenizer is not None:
            text = self.model.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = cut_text(text, request.sampling.stop) != text
        at_limit = len(tokens) == request.max_new_tokens
        eos = () if request.ignore_eos else None
        return planner.finish_reasons(self.model, [tokens], [request.sampling], [at_limit], [cut], eos)[0]

    def _stop_ids(self, request: Request) -> frozenset:
        """The token ids that end the request: EOS (unless it ignores it) and its stop token ids."""
        eos = frozenset() if request.ignore_eos else self._eos
        return eos | frozenset(request.sampling.stop_token_ids)

    def _final(self, request_id, tokens, reason, metrics) -> Update:
        return Update(request_id, tokens, True, reason, 0, 0, 0, [0] * self.k, metrics)

    # ----- options and stop strings ------------------------------------------------------------

    def _check_constraint(self, regex: str) -> None:
        if self._constraints is None:
            raise ValueError(
                "sampling regex / json_schema / choice: this engine was built without constraint "
                "tables; build it with EngineConfig(constraint_states=N)"
            )
        self._constraints.check(regex)

    def _fits(self, b: int, request: Request) -> bool:
        """Whether the request's stop strings and its constraint fit the automata beside the
        running requests' (with slot b about to take it): else it waits (engine_automata.py)."""
        sampling = request.sampling
        if self._stops is not None and not self._stops.fits(self._running_stop_strings(b), sampling.stop):
            return False
        return self._constraints is None or self._constraints.can_place(sampling.constraint)

    def _running_stop_strings(self, b: int) -> set[str]:
        """The stop strings of the requests running in slots other than b."""
        others = [i for i, slot in enumerate(self._slots) if slot is not None and i != b]
        return {s for i in others for s in self._samplings[i].stop}

    def _move_below(self, width: int) -> None:
        """Move the requests running in slots past `width` into free slots below it (their rows
        copied; the state they leave behind is dropped when the state narrows to `width`)."""
        free = [b for b in range(width) if self._slots[b] is None]
        for b in range(width, self.max_batch):
            if self._slots[b] is not None:
                to = free.pop(0)
                self._batch.move(b, to)
                if self._pages is not None:
                    self._pages.move(b, to)
                self._slots[to], self._samplings[to] = self._slots[b], self._samplings[b]
                self._slots[b], self._samplings[b] = None, Sampling()  # (its constraint moved along)
                self._inputs.changed()
