"""What the engine builds before its programs run (specjax/serve/engine.py): its rows' capacity and
the memory check, and the loop's inputs from its slots' requests (`SlotInputs`: per row its
sampling options, stop token ids, stop-string mask and whether it speculates)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import planner, sharding
from specjax.models.cache import cache_bytes
from specjax.planner import MIN_BUCKET
from specjax.serve.engine_config import MAX_STOP_TOKEN_IDS, EngineConfig, admission_bucket
from specjax.speculate.grammar import Grammar
from specjax.speculate.loop import GenerationInputs, LoopSpec
from specjax.speculate.proposers import resolve
from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec
from specjax.speculate.spec import memory_bytes
from specjax.speculate.stops import StopStrings


def engine_capacity(config: EngineConfig, proposer_spec) -> int:
    """Cache slots per row: max_model_len tokens and a verify pass, and room for a long prompt's
    last chunk, whose padding is written past the prompt."""
    capacity = planner.capacity(config.max_model_len, proposer_spec)
    chunk = config.prefill_chunk
    return capacity if chunk is None else max(capacity, -(-config.max_model_len // chunk) * chunk)


def check_engine_mesh(mesh, model, config: EngineConfig, prefiller=None) -> None:
    """ValueError unless the engine can run on `mesh` (None: one device): a ("data", "model")
    mesh that the model's heads and ffw split over, and max_batch slots that divide over its data
    groups (a paged pool too: engine_pages.paged_layout); across processes, without a prefiller
    (whose rows arrive at times of their own)."""
    if mesh is None:
        return
    sharding.check_mesh(mesh)
    sharding.check_model_split(mesh, model.config)
    data = sharding.data_degree(mesh)
    if config.max_batch % data:
        raise ValueError(
            f"max_batch={config.max_batch}: on a mesh the slots split over its {data} data groups; "
            f"give a multiple of {data}"
        )
    if sharding.spans_processes(mesh) and prefiller is not None:
        raise ValueError(
            "prefiller: an engine on a mesh that spans processes prefills its own rows (its "
            "processes admit in lockstep, and a row's arrival is a clock of its own)"
        )


def placed_weights(spec: LoopSpec, model, proposer, proposer_params):
    """The target's and the proposer's weights as the engine's programs read them (one device: in
    the backend's kernels' layout; on `spec.mesh`: split over it, the proposer's as it asks), and
    the spec of a request's own prefill (None: the batch's default; on a mesh, a batch of one on
    `sharding.row_mesh`, the proposer resolved there)."""
    mesh = spec.mesh
    if mesh is None:
        return (*planner.kernel_weights(spec, model.params, proposer_params), None)
    params = sharding.shard_params(model.params, model.config, mesh)
    if proposer_params is not None:
        proposer_params = spec.proposer.place_params(proposer_params, mesh)
    rows = sharding.row_mesh(mesh)
    row_proposer, _ = resolve(proposer, model, spec.warp, rows)
    prefill_spec = dataclasses.replace(spec, batch_size=1, page_size=None, mesh=rows, proposer=row_proposer)
    return params, proposer_params, prefill_spec


def check_memory(config: EngineConfig, spec: LoopSpec, params, pool_bytes: int | None = None) -> None:
    """Refuse a batch whose caches and working memory do not fit (before allocating them): with
    long prompts in chunks, the widest one-pass prefill is a chunk's, beside one more row (the
    prompt in chunks). `pool_bytes`: a paged cache's pool, counted instead of the slots' rows (a
    request's own prefill is still a dense row, beside it)."""
    chunk, length = config.prefill_chunk, config.max_model_len
    longest = length if chunk is None else min(length, chunk)
    rows = config.max_batch + (chunk is not None and length > chunk)
    bucket = min(admission_bucket(longest), spec.capacity)
    spec = dataclasses.replace(spec, prompt_bucket=bucket, batch_size=rows)
    needed, available = memory_bytes(spec, params), planner.available_memory_bytes()
    what = f"max_batch={config.max_batch} and max_model_len={length}: the slots' caches"
    if pool_bytes is not None:
        itemsize = np.dtype(jnp.dtype(spec.cache_dtype)).itemsize
        needed += pool_bytes - cache_bytes(spec.config, config.max_batch - 1, spec.capacity, itemsize)
        what = f"the pool of {pool_bytes / (1 << 30):.2f} GiB and max_batch={config.max_batch}: the rows"
    if available is not None and needed > available:
        gib = 1 << 30
        fix = "max_batch or max_model_len"
        if pool_bytes is not None:
            fix = "pool (num_pages, kv_cache_memory) or max_batch"
        raise ValueError(
            f"{what} ({spec.capacity} slots per row) and working memory need about {needed / gib:.2f} GiB, "
            f"but the device has {available / gib:.2f} GiB free; use a smaller {fix}"
        )


def loop_inputs(
    samplings: Sequence[Sampling],
    stop_ids: Sequence[frozenset],
    speculate: Sequence[bool],
    *,
    vocab_size: int,
    warp: WarpSpec,
    key: jax.Array,
    stop_tables: StopStrings | None,
    stop_masks: Sequence[int],
    grammar: Grammar | None = None,
    prompt_tokens=None,
    prompt_lengths=None,
    max_new_tokens=None,
    seeded: bool = False,
) -> GenerationInputs:
    """Inputs of len(samplings) rows. The prompt's fields default to a one-token prompt with
    nothing to generate (what the loop over running rows reads none of, and what a free row
    holds); `seeded`: the rows' own seeds, where their Sampling has one (a prefill's); `grammar`:
    the constraint tables, with the rows' start states (engine_automata.ConstraintPool)."""
    n = len(samplings)
    params = SamplingParams.of(list(samplings), n, vocab_size).replace(grammar=grammar)
    if warp.logit_bias and params.logit_bias is None:  # the program reads one
        params = params.replace(logit_bias=jnp.zeros((n, vocab_size)))
    table = np.full((n, MAX_STOP_TOKEN_IDS), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        table[i, : len(ids)] = sorted(ids)
    stop_strings = None
    if stop_tables is not None:
        stop_strings = stop_tables.replace(row_mask=jnp.asarray(list(stop_masks), jnp.int32))
    return GenerationInputs(
        prompt_tokens=jnp.zeros((n, 1), jnp.int32) if prompt_tokens is None else jnp.asarray(prompt_tokens),
        prompt_lengths=jnp.asarray(np.ones(n) if prompt_lengths is None else prompt_lengths, jnp.int32),
        max_new_tokens=jnp.asarray(np.zeros(n) if max_new_tokens is None else max_new_tokens, jnp.int32),
        sampling=params,
        key=key,
        seeds=jnp.asarray([(s.seed or 0) if seeded else 0 for s in samplings], jnp.uint32),
        seeded=jnp.asarray([seeded and s.seed is not None for s in samplings], bool),
        stop_token_ids=jnp.asarray(table),
        stop_strings=stop_strings,
        speculate=jnp.asarray(list(speculate), bool),
    )


class SlotInputs:
    """The loop's inputs made from the engine's slots (`slots`, `samplings`: the engine's own
    lists, read as they are when asked), with its vocabulary, warp, key, stop-string tables
    (`stops`, engine_automata.StopStringTables, or None) and constraint tables (`constraints`,
    engine_automata.ConstraintPool, or None)."""

    def __init__(self, slots, samplings, stops, constraints, key, vocab_size: int, warp: WarpSpec):
        self.slots, self.samplings, self.stops, self.constraints = slots, samplings, stops, constraints
        self.key, self.vocab_size, self.warp = key, vocab_size, warp
        self._by_width: dict[int, GenerationInputs] = {}

    def changed(self) -> None:
        """The slots' requests changed (an admission, a move): the inputs are made again."""
        self._by_width = {}

    def at(self, width: int) -> GenerationInputs:
        """The inputs at a program width: the first `width` slots' options (neutral for a free
        slot), made once per change."""
        if width not in self._by_width:
            slots = self.slots[:width]
            self._by_width[width] = self._rows(
                self.samplings[:width],
                [frozenset() if s is None else s.stop_ids for s in slots],
                [s is None or s.request.speculate for s in slots],
            )
        return self._by_width[width]

    def row(self, b: int, prompt, prompt_length: int, max_new_tokens: int, request_id: int, key):
        """Slot b's request's inputs for its prefill (batch 1; its key, or the engine's folded
        with its id)."""
        slot = self.slots[b]
        return self._rows(
            [self.samplings[b]],
            [slot.stop_ids],
            [slot.request.speculate],
            prompt_tokens=prompt,
            prompt_lengths=[prompt_length],
            max_new_tokens=[max_new_tokens],
            key=jax.random.fold_in(self.key, request_id) if key is None else key,
            starts=[slot.constraint_start],
            seeded=True,
        )

    def request_row(self, request, stop_ids, prompt, prompt_length: int, key) -> GenerationInputs:
        """A request's inputs for a prefill outside any slot (a handed-over row: handoff.py), no
        stop strings or constraint."""
        return self._rows(
            [request.sampling],
            [stop_ids],
            [request.speculate],
            prompt_tokens=prompt,
            prompt_lengths=[prompt_length],
            max_new_tokens=[request.max_new_tokens],
            key=key,
            seeded=True,
        )

    def free(self, batch: int = 1, bucket: int = MIN_BUCKET) -> GenerationInputs:
        """Inputs of `batch` one-token prompts (padded to `bucket`) with nothing to generate."""
        prompt = np.zeros((batch, bucket), np.int32)
        return self._rows([Sampling()] * batch, [frozenset()] * batch, [True] * batch, prompt_tokens=prompt)

    def _rows(self, samplings, stop_ids, speculate, key=None, starts=None, **prompts) -> GenerationInputs:
        masks = [0] * len(samplings)
        if self.stops is not None:
            masks = [self.stops.mask(s.stop) for s in samplings]
        grammar = None  # the constraint tables: a prefill's row starts in its automaton's state
        if self.constraints is not None:
            grammar = self.constraints.grammar(starts or [-1] * len(samplings))
        return loop_inputs(
            samplings,
            stop_ids,
            speculate,
            vocab_size=self.vocab_size,
            warp=self.warp,
            key=self.key if key is None else key,
            stop_tables=None if self.stops is None else self.stops.tables,
            grammar=grammar,
            stop_masks=masks,
            **prompts,
        )


def check_warp(sampling: Sampling, have: WarpSpec) -> None:
    """A request may use only the sampling code paths the engine was compiled with (`have`)."""
    need = WarpSpec.of(sampling)
    paths = {
        "top_k": (need.top_k, have.top_k),
        "top_p": (need.top_p, have.top_p),
        "min_p": (need.min_p, have.min_p),
        "penalties": (need.penalties, have.penalties),
        "logit_bias": (need.logit_bias, have.logit_bias),
    }
    missing = [name for name, (wanted, built) in paths.items() if wanted and not built]
    if not need.greedy and have.greedy:
        missing.insert(0, "temperature > 0")
    if missing:
        raise ValueError(
            f"sampling: this engine was built without {', '.join(missing)} (its warp is {have}); "
            "build it with warp=None (every option) to serve such requests"
        )
