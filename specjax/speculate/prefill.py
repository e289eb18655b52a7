"""The prefill: the prompts through the target (in one pass, or in chunks of a fixed size) and
the proposer, and each row's first token (specjax/speculate/loop.py runs the rest)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.cache import NULL_PAGE, KVCache, identity_pages, init_cache, paged_cache
from specjax.models.llama import lm_head
from specjax.models.params import LlamaParams
from specjax.speculate.history import TokenHistory
from specjax.speculate.logprobs import TokenLogprobs, records
from specjax.speculate.metrics import MetricCounters
from specjax.speculate.prompt_logprobs import scored_whole_prefill
from specjax.speculate.proposers.protocol import InitContext
from specjax.speculate.sampling import choose_tokens
from specjax.speculate.spec import LoopSpec
from specjax.speculate.state import (
    DecodeState,
    GenerationInputs,
    adjust,
    all_finite,
    commit,
    flag_nonfinite,
    forward,
    row_keys,
    step_keys,
)


def prefill(spec: LoopSpec, params: LlamaParams, proposer_params, inputs: GenerationInputs) -> DecodeState:
    """Run the prompts through the target (and the proposer) and pick each row's first token.

    A row with no token to generate (max_new_tokens 0: a padding row of a batch bucket) is done
    from the start: it never commits a token, never counts in the metrics, never holds the loop."""
    B = inputs.prompt_tokens.shape[0]
    cache = empty_target_cache(spec, params, B)
    if spec.prompt_logprobs is not None:  # one pass that scores every prompt token too
        logits, features, cache, scored = scored_whole_prefill(spec, params, inputs, cache)
        state = first_tokens(spec, params, proposer_params, inputs, logits, features, cache)
        return state.replace(prompt_logprobs=scored)
    if spec.prefill_chunk is None:
        logits, features, cache = whole_prefill(spec, params, inputs, cache)
    elif spec.packs_prefill:
        logits, features, cache = packed_prefill(spec, params, inputs, cache)
    else:
        logits, features, cache = chunked_prefill(spec, params, inputs, cache)
    return first_tokens(spec, params, proposer_params, inputs, logits, features, cache)


def empty_target_cache(spec: LoopSpec, params: LlamaParams, batch: int) -> KVCache:
    """The target's empty cache of `spec.capacity` slots per row: dense, or in pages of
    `spec.page_size` (each row its own, in order)."""
    if spec.page_size is None:
        return init_cache(spec.config, batch, spec.capacity, spec.cache_dtype, like=params.layers)
    pages, num_pages = identity_pages(batch, spec.capacity, spec.page_size)
    return paged_cache(spec.config, pages, spec.page_size, num_pages, spec.cache_dtype, like=params.layers)


def first_tokens(
    spec: LoopSpec, params: LlamaParams, proposer_params, inputs: GenerationInputs, logits, features, cache
) -> DecodeState:
    """The prefill after the target's pass over the prompts: the proposer's state (from the
    prompts, the target's features [B, T, F] or None, its cache), each row's first token picked
    from logits [B, V] at its last prompt token, and the loop's state."""
    B, T = inputs.prompt_tokens.shape
    proposer_state = None
    if spec.proposer is not None:
        context = InitContext(
            target_params=params,
            params=proposer_params,
            prompt_tokens=inputs.prompt_tokens,
            prompt_lengths=inputs.prompt_lengths,
            capacity=spec.capacity,
            target_features=features,
            target_cache=cache,
        )
        with jax.named_scope("propose"):
            proposer_state = spec.proposer.init(context)
    history = None
    if spec.warp.penalties:
        history = TokenHistory.of_prompts(inputs.prompt_tokens, inputs.prompt_lengths, spec.config.vocab_size)
    keys = row_keys(inputs)
    grammar = inputs.sampling.grammar
    grammar_states = None if grammar is None else grammar.start
    adjusted = adjust(spec, inputs.sampling, logits, history, states=grammar_states)
    first, _ = choose_tokens(step_keys(keys, jnp.zeros((), jnp.int32)), adjusted, inputs.sampling, spec.warp)

    zeros = jnp.zeros((B,), jnp.int32)
    live = inputs.max_new_tokens > 0
    state = DecodeState(
        tokens=jnp.zeros((B, spec.capacity), jnp.int32).at[:, :T].set(inputs.prompt_tokens),
        lengths=inputs.prompt_lengths,
        prompt_lengths=inputs.prompt_lengths,
        max_lengths=inputs.prompt_lengths + inputs.max_new_tokens,
        done=~live,
        cache=cache,
        proposer_state=proposer_state,
        keys=keys,
        step=jnp.zeros((), jnp.int32),
        first_step=zeros,
        metrics=MetricCounters.zeros(B, spec.k),
        history=history,
        stop_states=None if inputs.stop_strings is None else zeros,
        nonfinite_step=zeros - 1,
        logprobs=TokenLogprobs.empty(spec.logprobs, B, spec.capacity),
        grammar_states=grammar_states,
    )
    state = flag_nonfinite(state, all_finite(logits), live)
    first_logprobs = records(spec.logprobs, adjusted[:, None], inputs.sampling, spec.warp, first[:, None])
    state, num_emitted = commit(
        spec, inputs, state, first[:, None], jnp.ones((B,), jnp.int32), first_logprobs
    )
    forwards = live.astype(jnp.int32)
    return state.replace(metrics=state.metrics.replace(target_forwards=forwards, emitted=num_emitted))


def whole_prefill(spec: LoopSpec, params: LlamaParams, inputs: GenerationInputs, cache: KVCache):
    """The prompts [B, prompt_bucket] in one pass into the empty cache: (logits [B, V] at each
    row's last prompt token, the proposer's features [B, T, F] or None, the cache holding the
    prompts). Right padding past a row's prompt is computed and left stale."""
    B, T = inputs.prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, features, cache = forward(spec, params, inputs.prompt_tokens, positions, cache, empty_cache=True)
    logits = lm_head(params, hidden[jnp.arange(B), inputs.prompt_lengths - 1], spec.config)  # [B, V]
    return logits, features if spec.proposer_reads_features else None, cache.advance(inputs.prompt_lengths)


def chunked_prefill(spec: LoopSpec, params: LlamaParams, inputs: GenerationInputs, cache: KVCache):
    """`whole_prefill` in chunks of C = `spec.prefill_chunk` tokens of one row each, a
    `lax.while_loop` over a row's chunks and then the next row's: the only pass it compiles has C
    tokens, whatever the prompts' lengths, and it computes each row's prompt rounded up to C
    rather than every row padded to the longest (12 Spec-Bench prompts of 3,884 tokens, padded to
    16 rows of 1,296, were 20,736 tokens). Each chunk is a decoding pass over the row's cache (it
    attends to the slots earlier chunks wrote and, causally, to itself), so a family's windows,
    sinks and latent attention hold as in any verify pass; its padding past the prompt lands in
    slots past the row's length, stale until overwritten (`planner.capacity` leaves room for it).

    The proposer's features, where it reads them, are gathered into [B, S, F] for its `init`."""
    C = spec.prefill_chunk
    B, S = inputs.prompt_tokens.shape
    lengths = inputs.prompt_lengths
    chunks = -(-lengths // C)  # [B] a row's chunks
    ends = jnp.cumsum(chunks)  # chunk i belongs to the first row b with i < ends[b]
    reads = spec.proposer_reads_features

    def chunk(i, partial):
        b = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        start = (i - (ends[b] - chunks[b])) * C
        tokens = jax.lax.dynamic_slice_in_dim(inputs.prompt_tokens[b], start, C)[None]  # [1, C]
        return prefill_chunk(spec, params, partial, b, tokens, start, lengths[b])

    partial = PartialPrefill.empty(spec, params, B, S, cache)
    partial = jax.lax.fori_loop(0, ends[-1], chunk, partial)
    logits = lm_head(params, partial.last_hidden, spec.config)
    features = partial.features if reads else None
    return logits, features, partial.cache.replace(lengths=lengths)


def packed_prefill(spec: LoopSpec, params: LlamaParams, inputs: GenerationInputs, cache: KVCache):
    """`chunked_prefill` with the rows' prompt tokens packed: the batch's prompts laid end to end
    (row 0's tokens, then row 1's, ...: no padding between them) and run C = `spec.prefill_chunk`
    tokens a pass, a pass holding the end of one row's prompt and the start of the next's. It
    computes the batch's prompt tokens rounded up to one C in all, where one row a chunk rounds
    every row up (12 Spec-Bench prompts of 3,395 tokens were 21 chunks of 256: 5,376 positions).

    On a paged cache (`spec.page_size`) whose attention kernel reads the pages in place: a pass is
    a decoding pass of C rows of one token each, token j of the pass being the row of its prompt
    row's page table, at its position, with that many committed slots. Its key and value are
    written first, into its row's pages, so it attends to its row's earlier tokens (earlier passes'
    and this one's, which share the row's pages) and to itself: causal attention within each row,
    none across rows. The padding past the batch's last token is a row of null pages, written
    where nothing reads."""
    B, S = inputs.prompt_tokens.shape
    lengths = inputs.prompt_lengths
    reads = spec.proposer_reads_features

    def put(features, row, position, token_features, tables):  # row B (padding) is dropped
        return features.at[row, position].set(token_features.astype(features.dtype), mode="drop")

    empty = PartialPrefill.empty(spec, params, B, S, cache)
    starts = jnp.zeros_like(lengths)
    last_hidden, features, (k, v) = packed_passes(
        spec, params, cache, inputs.prompt_tokens, starts, lengths, empty.features, put if reads else None
    )
    logits = lm_head(params, last_hidden, spec.config)
    return logits, features if reads else None, cache.replace(k=k, v=v, lengths=lengths)


def packed_passes(
    spec: LoopSpec, params: LlamaParams, cache: KVCache, tokens, starts, lengths, features, put
):
    """The passes of `packed_prefill` over rows' prompt tokens [B, S] from position starts[b] to
    lengths[b] (a row's tokens before its start are in its pages already: a cached prefix; a row
    with start = length has none to run), laid end to end and run C = `spec.prefill_chunk` a
    pass, as C one-token rows written first (cache: the pool, and each row's table [B, W]).
    `put(features, row, position, token_features [C, F], tables)` stores a pass's features
    (row B: padding) where the proposer reads them (None: nowhere). Returns (the hidden states
    [B, D] at each row's last token, the features, the pool's (keys, values))."""
    C = spec.prefill_chunk
    B, S = tokens.shape
    counts = lengths - starts
    ends = jnp.cumsum(counts)  # token j of the stream belongs to the first row b with j < ends[b]
    total = ends[-1]
    tables = jnp.concatenate([cache.pages, jnp.zeros_like(cache.pages[:1])])  # [B + 1, W]: row B null

    def one_pass(i, partial):
        last_hidden, features, pools = partial
        j = i * C + jnp.arange(C, dtype=jnp.int32)  # [C] the pass's places in the stream
        row = jnp.searchsorted(ends, j, side="right").astype(jnp.int32)  # B past the last token
        real = j < total
        row = jnp.where(real, row, B)
        of = jnp.minimum(row, B - 1)
        position = jnp.where(real, starts[of] + j - (ends - counts)[of], 0)
        ids = tokens[of, jnp.clip(position, 0, S - 1)]
        view = cache.replace(k=pools[0], v=pools[1], lengths=position, pages=tables[row])
        hidden, token_features, view = forward(spec, params, ids[:, None], position[:, None], view)
        last = jnp.where(real & (position == lengths[of] - 1), row, B)  # B: dropped
        last_hidden = last_hidden.at[last].set(hidden[:, 0], mode="drop")
        if put is not None:
            features = put(features, row, position, token_features[:, 0], tables)
        return last_hidden, features, (view.k, view.v)

    last_hidden = jnp.zeros((B, spec.config.hidden_size), jnp.dtype(spec.dtype))
    start = (last_hidden, features, (cache.k, cache.v))
    return jax.lax.fori_loop(0, -(-total // C), one_pass, start)


def prefill_pages(spec: LoopSpec, params: LlamaParams, cache, tokens, starts, lengths, count, carry, put):
    """`count` chunks of C = spec.prefill_chunk tokens of each of R prompts into a paged cache
    (the pool, and each row's table [R, W]), row r's first at position starts[r] (its pages before
    it hold a cached prefix: a multiple of the page size); tokens [R, L] the prompts, padded by at
    least C past their `lengths`. Each chunk is a decoding pass of R rows of C tokens, as
    `prefill_chunk`'s: it attends to the slots earlier chunks wrote and, causally, to itself; a
    row whose prompt has run out (a length of 0: a row with nothing to prefill) reads and writes
    the null page. `carry`: (the hidden states [R, D] at each row's last prompt token, from an
    earlier call, or zeros; the features the proposer reads). `put(features, positions [R, C],
    token_features [R, C, F], active [R])` stores a chunk's features (None: nowhere). The serving
    engine runs a prompt's chunks into its pages this way (specjax/serve/engine.py), all of them at
    once or one between its running rows' chunks, one prompt a data group. Returns (the hidden
    states, the features, the pool's (keys, values))."""
    C = spec.prefill_chunk
    R = tokens.shape[0]
    offsets = jnp.arange(C, dtype=jnp.int32)

    def chunk(i, partial):
        last_hidden, features, (k, v) = partial
        at = starts + i * C  # [R]
        active = at < lengths
        piece = jax.vmap(lambda row, a: jax.lax.dynamic_slice_in_dim(row, a, C))(tokens, at)  # [R, C]
        positions = at[:, None] + offsets
        pages = jnp.where(active[:, None], cache.pages, NULL_PAGE)
        view = cache.replace(k=k, v=v, lengths=at, pages=pages)
        hidden, token_features, view = forward(spec, params, piece, positions, view)
        last = lengths - 1 - at  # a row's last prompt token, where this chunk holds it
        holds = active & (last >= 0) & (last < C)
        at_last = hidden[jnp.arange(R), jnp.clip(last, 0, C - 1)]
        last_hidden = jnp.where(holds[:, None], at_last, last_hidden)
        if put is not None:
            features = put(features, positions, token_features, active)
        return last_hidden, features, (view.k, view.v)

    last_hidden, features = carry
    return jax.lax.fori_loop(0, count, chunk, (last_hidden, features, (cache.k, cache.v)))


@flax.struct.dataclass
class PartialPrefill:
    """Prompts part-way through their chunks (`prefill_chunk`): the target's cache holding the
    chunks run so far, each row's final-normed hidden state at its last prompt token (once a
    chunk held it), and the proposer's features at the prompts' positions ([B, S, F]; [0] where
    the proposer reads none). `chunked_prefill` carries one through its loop; the serving engine
    keeps one between its steps, so that a long prompt's chunks run between the running rows'
    decoding steps (specjax/serve/engine.py)."""

    cache: KVCache
    last_hidden: jax.Array  # [B, D]
    features: jax.Array

    @classmethod
    def empty(cls, spec: LoopSpec, params: LlamaParams, batch: int, slots: int, cache=None):
        """Nothing run yet, for `batch` rows of prompts up to `slots` tokens (cache: the empty
        target cache to fill, or None for a new one of `spec.capacity` slots)."""
        if cache is None:
            cache = empty_target_cache(spec, params, batch)
        dtype = jnp.dtype(spec.dtype)
        reads = spec.proposer_reads_features
        features = jnp.zeros((batch, slots, spec.proposer_feature_width) if reads else (0,), dtype)
        return cls(cache, jnp.zeros((batch, spec.config.hidden_size), dtype), features)


def prefill_chunk(spec: LoopSpec, params: LlamaParams, partial: PartialPrefill, b, tokens, start, length):
    """`partial` after row b's chunk of C = spec.prefill_chunk prompt tokens [1, C] at positions
    start.. (start a multiple of C; the row's prompt has `length` tokens, the chunk's tokens past
    it are padding). The chunk is a decoding pass over the row's cache: it attends to the slots
    earlier chunks wrote and, causally, to itself; its padding lands in slots past the prompt,
    stale until overwritten."""
    C = spec.prefill_chunk
    positions = (start + jnp.arange(C, dtype=jnp.int32))[None]
    row = partial.cache.row(b).replace(lengths=start[None])
    hidden, row_features, row = forward(spec, params, tokens, positions, row)
    last = length - 1 - start  # the row's last prompt token, where this chunk holds it
    holds = (last >= 0) & (last < C)
    at = jax.lax.dynamic_index_in_dim(hidden[0], jnp.clip(last, 0, C - 1), keepdims=False)
    last_hidden = partial.last_hidden.at[b].set(jnp.where(holds, at, partial.last_hidden[b]))
    features = partial.features
    if spec.proposer_reads_features:
        features = jax.lax.dynamic_update_slice(features, row_features.astype(features.dtype), (b, start, 0))
    return PartialPrefill(partial.cache.with_row(b, row), last_hidden, features)
