"""The compiled decoding program: prefill, then one `lax.while_loop` until every row is done.

Invariant of the loop state: row b's sequence is `tokens[b, :lengths[b]]` (prompt, then
generated tokens) and the target cache holds all of it but the last token, which the next step
feeds in. Everything is a per-row mask or `where`; nothing leaves the device until the end.

How recompilation is avoided: prompts are right-padded to a length bucket and the cache capacity
is rounded up (both in `LoopSpec`, the static part); per-row prompt lengths, `max_new_tokens` and
sampling values are arrays, so a new prompt or limit inside the same bucket reuses the program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache, init_cache
from specjax.models.config import LlamaConfig
from specjax.models.llama import LlamaParams, lm_head
from specjax.sharding import mesh_forward_hidden
from specjax.speculate.metrics import MetricCounters
from specjax.speculate.sampling import SamplingParams, WarpSpec, sample_tokens, warp_logits
from specjax.speculate.verify import expected_acceptance, greedy_verify, rejection_sample


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about one generation program; equal specs share one compilation."""

    config: LlamaConfig
    batch_size: int
    prompt_bucket: int  # prompts are right-padded to this many tokens
    capacity: int  # slots per row in the token buffer and the KV cache
    warp: WarpSpec
    eos_token_ids: tuple[int, ...]
    proposer: Any = None  # a proposer spec (see speculate/proposers), None for plain decoding
    mesh: Any = None  # a jax Mesh: the target's forward runs under shard_map on it (specjax/sharding)

    @property
    def k(self) -> int:
        return 0 if self.proposer is None else self.proposer.k


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, S] int32: prompt then generated tokens, per row
    lengths: jax.Array  # [B] int32: tokens in the row's sequence
    prompt_lengths: jax.Array  # [B] int32
    max_lengths: jax.Array  # [B] int32: prompt length + max_new_tokens
    done: jax.Array  # [B] bool: stopped at EOS or at max_new_tokens
    cache: KVCache  # the target's; holds every token of the sequence but the last
    proposer_state: Any  # the proposer's own (its KV cache, ...), None for plain decoding
    key: jax.Array  # PRNG key; each step folds in its step number
    step: jax.Array  # [] int32
    metrics: MetricCounters
    nonfinite: jax.Array  # [B] bool: the target produced a NaN or inf logit for this row


@flax.struct.dataclass
class GenerationInputs:
    """The dynamic inputs of one call (arrays only)."""

    prompt_tokens: jax.Array  # [B, prompt_bucket] int32, right-padded
    prompt_lengths: jax.Array  # [B] int32
    max_new_tokens: jax.Array  # [B] int32
    sampling: SamplingParams
    key: jax.Array


def _is_eos(spec: LoopSpec, tokens: jax.Array) -> jax.Array:
    eos = jnp.asarray(spec.eos_token_ids or (-1,), jnp.int32)
    return jnp.any(tokens[..., None] == eos, axis=-1)


def _all_finite(logits: jax.Array) -> jax.Array:
    """[B, ..., V] -> [B]: no NaN or inf anywhere in the row."""
    return jnp.all(jnp.isfinite(logits).reshape(logits.shape[0], -1), axis=-1)


def _write_rows(tokens: jax.Array, starts: jax.Array, new: jax.Array) -> jax.Array:
    """Write new [B, T] into tokens [B, S] at column starts[b] of each row."""
    return jax.vmap(lambda row, start, values: jax.lax.dynamic_update_slice(row, values, (start,)))(
        tokens, starts, new
    )


def prefill(spec: LoopSpec, params: LlamaParams, proposer_params, inputs: GenerationInputs) -> DecodeState:
    """Run the prompts through the target (and the proposer) and sample each row's first token."""
    B, T = inputs.prompt_tokens.shape
    rows = jnp.arange(B)
    cache = init_cache(spec.config, B, spec.capacity)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, cache = mesh_forward_hidden(
        spec.mesh, params, spec.config, inputs.prompt_tokens, positions, cache, empty_cache=True
    )
    # Only each row's last prompt position needs logits (right padding follows it).
    logits = lm_head(params, hidden[rows, inputs.prompt_lengths - 1])  # [B, V]
    cache = cache.advance(inputs.prompt_lengths)
    first = sample_tokens(jax.random.fold_in(inputs.key, 0), logits, inputs.sampling, spec.warp)
    proposer_state = None
    if spec.proposer is not None:
        proposer_state = spec.proposer.init(
            params, proposer_params, inputs.prompt_tokens, inputs.prompt_lengths, spec.capacity
        )

    tokens = jnp.zeros((B, spec.capacity), jnp.int32).at[:, :T].set(inputs.prompt_tokens)
    tokens = _write_rows(tokens, inputs.prompt_lengths, first[:, None])
    lengths = inputs.prompt_lengths + 1
    max_lengths = inputs.prompt_lengths + inputs.max_new_tokens
    ones = jnp.ones((B,), jnp.int32)
    return DecodeState(
        tokens=tokens,
        lengths=lengths,
        prompt_lengths=inputs.prompt_lengths,
        max_lengths=max_lengths,
        done=_is_eos(spec, first) | (lengths >= max_lengths),
        cache=cache,
        proposer_state=proposer_state,
        key=inputs.key,
        step=jnp.zeros((), jnp.int32),
        metrics=MetricCounters.zeros(B, spec.k).replace(target_forwards=ones, emitted=ones),
        nonfinite=~_all_finite(logits),
    )


def _commit(spec: LoopSpec, state: DecodeState, candidates: jax.Array, num_candidates: jax.Array):
    """Append the first num_candidates[b] of candidates [B, T] to each running row, cut at the
    first EOS and at the row's max length. Returns (tokens, lengths, done, num_emitted)."""
    running = ~state.done
    T = candidates.shape[1]
    position = jnp.arange(T)[None, :]
    eos_at = _is_eos(spec, candidates) & (position < num_candidates[:, None])
    first_eos = jnp.min(jnp.where(eos_at, position, T), axis=1)  # T when there is none
    num_emitted = jnp.minimum(num_candidates, first_eos + 1)
    num_emitted = jnp.minimum(num_emitted, state.max_lengths - state.lengths)
    num_emitted = jnp.where(running, num_emitted, 0)
    # Tokens past num_emitted land beyond the row's end: never read, later overwritten.
    tokens = _write_rows(state.tokens, state.lengths, candidates)
    lengths = state.lengths + num_emitted
    done = state.done | (running & ((first_eos < num_emitted) | (lengths >= state.max_lengths)))
    return tokens, lengths, done, num_emitted


def _target_forward(spec: LoopSpec, params: LlamaParams, tokens, positions, cache: KVCache):
    """The target's logits [B, T, V] and cache after feeding tokens [B, T] in a decoding step;
    its body runs under shard_map on `spec.mesh` when there is one."""
    hidden, cache = mesh_forward_hidden(spec.mesh, params, spec.config, tokens, positions, cache)
    return lm_head(params, hidden), cache


def _score_last_token(spec: LoopSpec, params: LlamaParams, state: DecodeState, sampling, key):
    """Feed each row's last token and sample the next: a step without drafts.
    Returns (new tokens [B], logits [B, 1, V], cache)."""
    B = state.tokens.shape[0]
    last = state.tokens[jnp.arange(B), state.lengths - 1]
    logits, cache = _target_forward(spec, params, last[:, None], (state.lengths - 1)[:, None], state.cache)
    return sample_tokens(key, logits[:, 0], sampling, spec.warp), logits, cache


def plain_step(
    spec: LoopSpec, params: LlamaParams, state: DecodeState, sampling: SamplingParams
) -> DecodeState:
    """One token per running row: feed the last token, sample the next."""
    B = state.tokens.shape[0]
    running = ~state.done
    step = state.step + 1
    new, logits, cache = _score_last_token(spec, params, state, sampling, jax.random.fold_in(state.key, step))
    tokens, lengths, done, num_emitted = _commit(spec, state, new[:, None], jnp.ones((B,), jnp.int32))

    m, grow = state.metrics, running.astype(jnp.int32)
    return state.replace(
        tokens=tokens,
        lengths=lengths,
        done=done,
        cache=cache.advance(num_emitted),
        step=step,
        metrics=m.replace(
            steps=m.steps + grow, target_forwards=m.target_forwards + grow, emitted=m.emitted + num_emitted
        ),
        nonfinite=state.nonfinite | (running & ~_all_finite(logits)),
    )


def _verify_drafts(spec: LoopSpec, params: LlamaParams, state: DecodeState, proposal, sampling, key):
    """Score the last token and the K drafts in one target pass and verify them.
    Returns (candidates [B, K+1], num_accepted [B], expected acceptance [B, K], finite [B], cache)."""
    B, K = state.tokens.shape[0], spec.k
    draft, valid = proposal.draft_tokens, proposal.valid
    last = state.tokens[jnp.arange(B), state.lengths - 1]
    fed = jnp.concatenate([last[:, None], draft], axis=1)  # [B, K+1]
    positions = (state.lengths - 1)[:, None] + jnp.arange(K + 1)[None, :]
    logits, cache = _target_forward(spec, params, fed, positions, state.cache)  # [B, K+1, V]

    if spec.warp.greedy:
        candidates, num_accepted = greedy_verify(logits, draft, valid)
        expected = (draft == jnp.argmax(logits[:, :K], axis=-1)).astype(jnp.float32)
    else:
        target_probs = jnp.exp(warp_logits(logits, sampling, spec.warp))
        draft_probs = proposal.draft_probs
        if draft_probs is None:  # a deterministic proposer: q is one-hot on the draft token
            draft_probs = jax.nn.one_hot(draft, logits.shape[-1], dtype=jnp.float32)
        candidates, num_accepted = rejection_sample(key, target_probs, draft_probs, draft, valid)
        expected = expected_acceptance(target_probs, draft_probs)
    return candidates, num_accepted, expected, _all_finite(logits), cache


def _no_drafts(spec: LoopSpec, params: LlamaParams, state: DecodeState, sampling, key):
    """What `_verify_drafts` returns when no row drafted anything, at the cost of a one-token pass:
    the target's own token, which is what verification emits for an empty draft."""
    B, K = state.tokens.shape[0], spec.k
    new, logits, cache = _score_last_token(spec, params, state, sampling, key)
    candidates = jnp.concatenate([new[:, None], jnp.full((B, K), -1, jnp.int32)], axis=1)
    zeros = jnp.zeros((B,), jnp.int32)
    return candidates, zeros, jnp.zeros((B, K), jnp.float32), _all_finite(logits), cache


def speculative_step(
    spec: LoopSpec, params: LlamaParams, proposer_params, state: DecodeState, sampling: SamplingParams
) -> DecodeState:
    """Propose k tokens, score all k+1 positions in one target pass, verify, commit.

    A proposer that may draft nothing (an n-gram miss) gets a one-token pass on the steps where
    no row of the batch drafted: a batch-wide `lax.cond`, since the k+1-token pass costs 1.5x a
    one-token pass on CPU. Rows never branch individually.
    """
    K = spec.k
    running = ~state.done
    step = state.step + 1
    draft_key, verify_key = jax.random.split(jax.random.fold_in(state.key, step))

    proposal, proposer_state = spec.proposer.propose(
        params, proposer_params, state.proposer_state, state.tokens, state.lengths, draft_key, sampling
    )
    valid = proposal.valid

    def verify(state):
        return _verify_drafts(spec, params, state, proposal, sampling, verify_key)

    def skip(state):
        return _no_drafts(spec, params, state, sampling, verify_key)

    if spec.proposer.always_drafts:
        candidates, num_accepted, expected, finite, cache = verify(state)
    else:
        any_draft = jnp.any(valid & running[:, None])
        candidates, num_accepted, expected, finite, cache = jax.lax.cond(any_draft, verify, skip, state)
    tokens, lengths, done, num_emitted = _commit(spec, state, candidates, num_accepted + 1)

    m = state.metrics
    live = running[:, None]
    position = jnp.arange(K)[None, :]
    accepted_at = live & (position < num_accepted[:, None])
    reached_at = live & valid & (position <= num_accepted[:, None])
    metrics = m.replace(
        steps=m.steps + running,
        drafting_steps=m.drafting_steps + (running & valid[:, 0]),
        target_forwards=m.target_forwards + running,
        drafted=m.drafted + jnp.sum(live & valid, axis=1),
        drafted_at=m.drafted_at + (live & valid),
        accepted=m.accepted + jnp.where(running, num_accepted, 0),
        emitted=m.emitted + num_emitted,
        accepted_at=m.accepted_at + accepted_at,
        reached_at=m.reached_at + reached_at,
        accept_hist=m.accept_hist + (live & (jnp.arange(K + 1)[None, :] == num_accepted[:, None])),
        expected_accept_at=m.expected_accept_at + jnp.where(live & valid, expected, 0.0),
    )
    return state.replace(
        tokens=tokens,
        lengths=lengths,
        done=done,
        cache=cache.advance(num_emitted),
        proposer_state=proposer_state,
        step=step,
        metrics=metrics,
        nonfinite=state.nonfinite | (running & ~finite),
    )


def generate_program(
    spec: LoopSpec, params: LlamaParams, proposer_params, inputs: GenerationInputs
) -> DecodeState:
    """The whole generation, to be jitted with `spec` static: prefill + one while_loop."""
    state = prefill(spec, params, proposer_params, inputs)

    def cond(state: DecodeState) -> jax.Array:
        return jnp.any(~state.done) & (state.step < spec.capacity)

    def body(state: DecodeState) -> DecodeState:
        if spec.proposer is None:
            return plain_step(spec, params, state, inputs.sampling)
        return speculative_step(spec, params, proposer_params, state, inputs.sampling)

    return jax.lax.while_loop(cond, body, state)
