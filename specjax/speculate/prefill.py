"""The prefill: the prompts through the target (in one pass, or in chunks of a fixed size) and
the proposer, and each row's first token (specjax/speculate/loop.py runs the rest)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache, init_cache
from specjax.models.llama import lm_head
from specjax.models.params import LlamaParams
from specjax.speculate.history import TokenHistory
from specjax.speculate.metrics import MetricCounters
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
    B, T = inputs.prompt_tokens.shape
    cache = init_cache(spec.config, B, spec.capacity, spec.cache_dtype, like=params.layers)
    if spec.prefill_chunk is None:
        logits, features, cache = whole_prefill(spec, params, inputs, cache)
    else:
        logits, features, cache = chunked_prefill(spec, params, inputs, cache)
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
    adjusted = adjust(spec, inputs.sampling, logits, history)
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
    )
    state = flag_nonfinite(state, all_finite(logits), live)
    state, num_emitted = commit(spec, inputs, state, first[:, None], jnp.ones((B,), jnp.int32))
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
    reads, width = spec.proposer_reads_features, spec.proposer_feature_width
    hidden_size = spec.config.hidden_size
    dtype = jnp.dtype(spec.dtype)

    def chunk(i, carry):
        cache, last_hidden, features = carry
        b = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        start = (i - (ends[b] - chunks[b])) * C
        tokens = jax.lax.dynamic_slice_in_dim(inputs.prompt_tokens[b], start, C)[None]  # [1, C]
        positions = (start + jnp.arange(C, dtype=jnp.int32))[None]
        row = cache.row(b).replace(lengths=start[None])
        hidden, row_features, row = forward(spec, params, tokens, positions, row)
        cache = cache.with_row(b, row)
        last = lengths[b] - 1 - start  # the row's last prompt token, where this chunk holds it
        holds = (last >= 0) & (last < C)
        at = jax.lax.dynamic_index_in_dim(hidden[0], jnp.clip(last, 0, C - 1), keepdims=False)
        last_hidden = last_hidden.at[b].set(jnp.where(holds, at, last_hidden[b]))
        if reads:
            features = jax.lax.dynamic_update_slice(features, row_features.astype(dtype), (b, start, 0))
        return cache, last_hidden, features

    features = jnp.zeros((B, S, width) if reads else (0,), dtype)
    carry = (cache, jnp.zeros((B, hidden_size), dtype), features)
    cache, last_hidden, features = jax.lax.fori_loop(0, ends[-1], chunk, carry)
    logits = lm_head(params, last_hidden, spec.config)
    return logits, features if reads else None, cache.replace(lengths=lengths)
