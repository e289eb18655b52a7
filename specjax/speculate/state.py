"""The decoding loop's state and the pieces every pass shares: a row's keys, committing tokens,
the target's forward pass with the features its proposer reads.

Invariant of the loop state: row b's sequence is `tokens[b, :lengths[b]]` (prompt, then
generated tokens) and the target cache holds all of it but the last token, which the next step
feeds in (specjax/speculate/loop.py).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.cache import FreshEntries, KVCache
from specjax.models.llama import lm_head
from specjax.models.params import LlamaParams
from specjax.sharding import mesh_forward_hidden, mesh_write
from specjax.speculate.grammar import mask_logits
from specjax.speculate.history import TokenHistory
from specjax.speculate.logprobs import LogprobRecords, TokenLogprobs
from specjax.speculate.metrics import MetricCounters
from specjax.speculate.sampling import SamplingParams, adjust_logits
from specjax.speculate.spec import LoopSpec
from specjax.speculate.stops import StopStrings


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, S] int32: prompt then generated tokens, per row
    lengths: jax.Array  # [B] int32: tokens in the row's sequence
    prompt_lengths: jax.Array  # [B] int32
    max_lengths: jax.Array  # [B] int32: prompt length + max_new_tokens
    done: jax.Array  # [B] bool: stopped (EOS, stop token or string, max_new_tokens, bad logits)
    cache: KVCache  # the target's; holds every token of the sequence but the last
    proposer_state: Any  # the proposer's own (its KV cache, ...), None for plain decoding
    keys: jax.Array  # [B] PRNG keys, one per row; each step folds in the row's own step number
    step: jax.Array  # [] int32: steps the loop has run
    # [B] int32: the loop's step when the row's prefill ran (0 in `generate`; a continuous batch
    # admits rows later). A row's own step number is step - first_step, so a seeded row draws the
    # same numbers whenever it joins (specjax/serve/engine.py).
    first_step: jax.Array
    metrics: MetricCounters
    history: TokenHistory | None  # token counts for the penalties; None when no row has one
    stop_states: jax.Array | None  # [B] int32 stop-string automaton states; None without stops
    nonfinite_step: jax.Array  # [B] int32: first step with NaN / inf target logits, -1 if none
    # The emitted tokens' logprobs, slot by slot beside `tokens` (speculate/logprobs.py); None
    # when the program computes none (LoopSpec.logprobs None)
    logprobs: TokenLogprobs | None = None
    # The prompt tokens' logprobs, [B, prompt_bucket, ...]: column t holds prompt token t + 1's
    # (speculate/prompt_logprobs.py); None when the program computes none
    prompt_logprobs: LogprobRecords | None = None
    # [B] int32 states of the rows' constraint automata (-1: a free row), at the last committed
    # token; None when no row has a constraint (specjax/speculate/grammar.py)
    grammar_states: jax.Array | None = None


@flax.struct.dataclass
class GenerationInputs:
    """The dynamic inputs of one call (arrays only)."""

    prompt_tokens: jax.Array  # [B, prompt_bucket] int32, right-padded
    prompt_lengths: jax.Array  # [B] int32
    max_new_tokens: jax.Array  # [B] int32
    sampling: SamplingParams
    key: jax.Array  # the call's PRNG key
    seeds: jax.Array  # [B] uint32: a row's own seed ...
    seeded: jax.Array  # [B] bool: ... where it has one
    stop_token_ids: jax.Array  # [B, M] int32: EOS and the row's stop token ids, padded with -1
    stop_strings: StopStrings | None = None
    # [B] bool: the rows whose drafts are verified; None: every row's. A row left out makes a
    # plain step's worth of progress per step (its drafts are marked invalid), inside a batch that
    # speculates: a continuous batch's per-request opt-out (specjax/serve/engine.py).
    speculate: jax.Array | None = None
    # [B] int32: the number a row's key folds in where it has no seed (`row_keys`); None: its
    # index b. A serving engine on a data-parallel mesh prefills a request in the row of its
    # device group, numbered 0 there so that it draws what it draws in a batch of one.
    row_numbers: jax.Array | None = None

    @classmethod
    def simple(cls, prompt_tokens, prompt_lengths, max_new_tokens, sampling, key, stop_token_ids=()):
        """Inputs with no seeds and the same stop token ids for every row (tests use this)."""
        B = prompt_tokens.shape[0]
        stop = jnp.asarray([list(stop_token_ids) or [-1]] * B, jnp.int32)
        return cls(
            prompt_tokens=prompt_tokens,
            prompt_lengths=prompt_lengths,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            key=key,
            seeds=jnp.zeros((B,), jnp.uint32),
            seeded=jnp.zeros((B,), bool),
            stop_token_ids=stop,
        )


def row_keys(inputs: GenerationInputs) -> jax.Array:
    """[B] keys: jax.random.key(seed) for a seeded row, the call's key folded with b (or the row's
    `row_numbers` entry) otherwise."""
    B = inputs.seeds.shape[0]
    impl = jax.random.key_impl(inputs.key)
    numbers = jnp.arange(B) if inputs.row_numbers is None else inputs.row_numbers
    derived = jax.vmap(lambda b: jax.random.fold_in(inputs.key, b))(numbers)
    own = jax.vmap(lambda seed: jax.random.key(seed, impl=impl))(inputs.seeds)
    derived, own = jax.random.key_data(derived), jax.random.key_data(own)
    seeded = inputs.seeded.reshape((B,) + (1,) * (own.ndim - 1))
    return jax.random.wrap_key_data(jnp.where(seeded, own, derived), impl=impl)


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
    """keys [B] folded with each row's step number (step [] or [B])."""
    return jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to(step, keys.shape))


def row_step(state: DecodeState) -> jax.Array:
    """[B] each row's own step number."""
    return state.step - state.first_step


def all_finite(logits: jax.Array) -> jax.Array:
    """[B, ..., V] -> [B]: no NaN or inf anywhere in the row."""
    return jnp.all(jnp.isfinite(logits).reshape(logits.shape[0], -1), axis=-1)


def flag_nonfinite(state: DecodeState, finite: jax.Array, running: jax.Array) -> DecodeState:
    """Record the first step at which a running row's logits went bad, and stop the row there."""
    bad = running & ~finite
    first = bad & (state.nonfinite_step < 0)
    return state.replace(
        nonfinite_step=jnp.where(first, row_step(state), state.nonfinite_step), done=state.done | bad
    )


def write_rows(tokens: jax.Array, starts: jax.Array, new: jax.Array) -> jax.Array:
    """Write new [B, T] into tokens [B, S] at column starts[b] of each row."""
    return jax.vmap(lambda row, start, values: jax.lax.dynamic_update_slice(row, values, (start,)))(
        tokens, starts, new
    )


def adjust(
    spec: LoopSpec, sampling: SamplingParams, logits, history: TokenHistory | None, counts=None, states=None
):
    """Logit bias and penalties, then the rows' constraints: tokens the automaton forbids at
    states [B, ...] (logits' positions; the grammar's states there) get -inf. counts default to
    the history's (the next position's)."""
    if history is None:
        adjusted = adjust_logits(logits, sampling, spec.warp)
    else:
        counts = history.counts if counts is None else counts
        adjusted = adjust_logits(logits, sampling, spec.warp, counts, history.in_prompt)
    return mask_logits(sampling.grammar, adjusted, states)


def commit(
    spec: LoopSpec,
    inputs: GenerationInputs,
    state: DecodeState,
    candidates,
    num_candidates,
    logprobs: LogprobRecords | None = None,
):
    """Append the first num_candidates[b] of candidates [B, T] to each running row, cut at the
    first stop (EOS, a stop token id, the end of a stop string) and at the row's max length; with
    the candidates' logprob records (when the state keeps logprobs), write them beside the tokens.

    Tokens past a stop are neither written into the sequence nor counted. Returns the state with
    tokens, lengths, done, history and stop states updated, and num_emitted [B]."""
    running = ~state.done
    B, T = candidates.shape
    position = jnp.arange(T)[None, :]
    real = position < num_candidates[:, None]
    stop_at = jnp.any(candidates[..., None] == inputs.stop_token_ids[:, None, :], axis=-1)
    if inputs.stop_strings is not None:
        states_after, string_stop = inputs.stop_strings.advance(state.stop_states, candidates)
        stop_at |= string_stop
    first_stop = jnp.min(jnp.where(stop_at & real, position, T), axis=1)  # T when there is none
    num_emitted = jnp.minimum(num_candidates, first_stop + 1)
    num_emitted = jnp.minimum(num_emitted, state.max_lengths - state.lengths)
    num_emitted = jnp.where(running, num_emitted, 0)
    # Tokens past num_emitted land beyond the row's end: never read, later overwritten.
    tokens = write_rows(state.tokens, state.lengths, candidates)
    kept = state.logprobs
    if logprobs is not None:  # (a program computing none leaves the buffers as they are: the
        # serving engine runs such programs for chunks in which no request asked for logprobs)
        kept = kept.write(state.lengths, logprobs)
    lengths = state.lengths + num_emitted
    done = state.done | (running & ((first_stop < num_emitted) | (lengths >= state.max_lengths)))
    stop_states = state.stop_states
    if inputs.stop_strings is not None:
        last = states_after[jnp.arange(B), jnp.maximum(num_emitted - 1, 0)]
        stop_states = jnp.where(num_emitted > 0, last, stop_states)
    history = state.history
    if history is not None:
        history = history.add(candidates, num_emitted)
    grammar_states = state.grammar_states
    if inputs.sampling.grammar is not None:
        after = inputs.sampling.grammar.advance(grammar_states, candidates, spec.config.vocab_size)
        last = after[jnp.arange(B), jnp.maximum(num_emitted - 1, 0)]
        grammar_states = jnp.where(num_emitted > 0, last, grammar_states)
    new_state = state.replace(
        tokens=tokens,
        lengths=lengths,
        done=done,
        history=history,
        stop_states=stop_states,
        grammar_states=grammar_states,
        logprobs=kept,
    )
    return new_state, num_emitted


def target_forward(
    spec: LoopSpec, params: LlamaParams, tokens, positions, cache: KVCache, fresh_mask=None, write=True
):
    """The target's logits [B, T, V], the features its proposer drafts from [B, T, .] (see
    `forward`) and cache after feeding tokens [B, T] in a decoding step (fresh_mask [T, T]: a
    tree's, or None for a chain); its body runs under shard_map on `spec.mesh` when there is one.
    `write=False` (inside the batch-wide cond) returns the fresh entries in place of the cache,
    for `store` after the cond."""
    hidden, features, cache = forward(
        spec, params, tokens, positions, cache, fresh_mask=fresh_mask, write=write
    )
    return lm_head(params, hidden, spec.config), features, cache


def forward(spec: LoopSpec, params: LlamaParams, tokens, positions, cache: KVCache, **options):
    """(final-normed hidden states [B, T, D], the proposer's features, cache). The features are
    the hidden states, or, for a proposer whose capabilities name feature layers (EAGLE-3), the
    residual streams entering those layers side by side [B, T, n*D], taken in the same pass."""
    layers = None if spec.proposer is None else spec.proposer.capabilities.feature_layers
    if not layers:
        hidden, cache = mesh_forward_hidden(
            spec.mesh, params, spec.config, tokens, positions, cache, **options
        )
        return hidden, hidden, cache
    hidden, cache, features = mesh_forward_hidden(
        spec.mesh, params, spec.config, tokens, positions, cache, capture=layers, **options
    )
    return hidden, features, cache


def store(spec: LoopSpec, cache: KVCache, written: KVCache | FreshEntries) -> KVCache:
    """The cache after a verdict: the one its pass wrote, or `cache` with the pass's entries."""
    if isinstance(written, KVCache):
        return written
    return mesh_write(spec.mesh, cache, written)
