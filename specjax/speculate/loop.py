"""The compiled decoding program: prefill, then one `lax.while_loop` until every row is done.

Invariant of the loop state: row b's sequence is `tokens[b, :lengths[b]]` (prompt, then
generated tokens) and the target cache holds all of it but the last token, which the next step
feeds in. Everything is a per-row mask or `where`; nothing leaves the device until the end.

How recompilation is avoided: prompts are right-padded to a length bucket and the cache capacity
is rounded up (both in `LoopSpec`, the static part); per-row prompt lengths, `max_new_tokens` and
sampling values (per row: temperature, filters, penalties, bias, stop ids, seeds) are arrays, so a
new prompt, limit or option value inside the same bucket reuses the program.

Randomness is per row: row b draws from its own key (its seed, or the call's key folded with b),
folded with the step number, so a seeded row's output does not depend on the rest of the batch.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import backend
from specjax.models.cache import FreshEntries, KVCache
from specjax.models.llama import stack_layers
from specjax.models.params import LlamaParams
from specjax.sharding import mesh_move_slots
from specjax.speculate.logprobs import LogprobRecords, records
from specjax.speculate.prefill import prefill
from specjax.speculate.proposers.protocol import ProposeContext, UpdateContext
from specjax.speculate.sampling import (
    choose_tokens,
    greedy_argmax,
    warp_logits,
)

# LoopSpec, memory_bytes and num_drafted live in speculate/spec.py; the loop's callers find them here too.
from specjax.speculate.spec import LoopSpec
from specjax.speculate.state import (
    DecodeState,
    GenerationInputs,
    adjust,
    all_finite,
    commit,
    flag_nonfinite,
    row_step,
    step_keys,
    store,
    target_forward,
)
from specjax.speculate.verify import rejection_sample


def _score_last_token(spec: LoopSpec, params: LlamaParams, state: DecodeState, sampling, keys):
    """Feed each row's last token and pick the next: a step without drafts.
    Returns (new tokens [B], finite [B], cache, their logprob records or None)."""
    B = state.tokens.shape[0]
    last = state.tokens[jnp.arange(B), state.lengths - 1]
    logits, _, cache = target_forward(spec, params, last[:, None], (state.lengths - 1)[:, None], state.cache)
    adjusted = adjust(spec, sampling, logits[:, 0], state.history, states=state.grammar_states)
    new, _ = choose_tokens(keys, adjusted, sampling, spec.warp)
    logprobs = records(spec.logprobs, adjusted[:, None], sampling, spec.warp, new[:, None])
    return new, all_finite(logits), cache, logprobs


def plain_step(spec: LoopSpec, params: LlamaParams, state: DecodeState, inputs: GenerationInputs):
    """One token per running row: feed the last token, pick the next."""
    B = state.tokens.shape[0]
    running = ~state.done
    state = state.replace(step=state.step + 1)
    keys = step_keys(state.keys, row_step(state))
    new, finite, cache, logprobs = _score_last_token(spec, params, state, inputs.sampling, keys)
    state, num_emitted = commit(spec, inputs, state, new[:, None], jnp.ones((B,), jnp.int32), logprobs)
    state = flag_nonfinite(state, finite, running)

    m, grow = state.metrics, running.astype(jnp.int32)
    return state.replace(
        cache=cache.advance(num_emitted),
        metrics=m.replace(
            steps=m.steps + grow, target_forwards=m.target_forwards + grow, emitted=m.emitted + num_emitted
        ),
    )


@flax.struct.dataclass
class Verdict:
    """What one verify pass decided, per row (K draft positions: a chain's k, a tree's depth)."""

    candidates: jax.Array  # [B, K+1] accepted drafts, then the target's own token, then -1
    num_accepted: jax.Array  # [B]
    expected: jax.Array  # [B, K] analytic acceptance probability at each position
    drafted_at: jax.Array  # [B, K] bool: a valid draft was tried at the position
    finite: jax.Array  # [B] the logits that were used are finite
    cache: KVCache | FreshEntries  # the target's, with the accepted entries at slots
    #                               lengths .. lengths + n; or the pass's entries, to store there
    path_hidden: jax.Array  # [B, K+1, D] the target's hidden states at the last token and the
    #                         accepted drafts (entry num_accepted: the state the next token came from)
    # The candidates' logprobs under the target's processed distributions (speculate/logprobs.py),
    # [B, K+1, ...]; None when the program computes none
    logprobs: LogprobRecords | None = None


def _score(
    spec: LoopSpec,
    params: LlamaParams,
    state: DecodeState,
    proposal,
    sampling,
    depths,
    fresh_mask,
    write=True,
    parents=None,
):
    """Feed each row's last token and its N drafts (a chain's or a tree's nodes) in one target pass.

    depths [N+1] (numpy) are the position offsets, fresh_mask [N+1, N+1] (numpy) what each fed
    token sees of the others: for a chain, 0..K and the causal mask; parents [N+1] (numpy) a tree's
    (TokenTree.parents), None for a chain. Returns the adjusted logits
    [B, N+1, V] (penalties count the drafts on each token's path), finite [B, N+1] of the raw
    logits, the hidden states [B, N+1, D] and the cache with every fed token written (with
    `write=False`, the fed tokens' entries)."""
    B = state.tokens.shape[0]
    last = state.tokens[jnp.arange(B), state.lengths - 1]
    fed = jnp.concatenate([last[:, None], proposal.draft_tokens], axis=1)  # [B, N+1]
    positions = (state.lengths - 1)[:, None] + jnp.asarray(depths)[None, :]
    logits, hidden, cache = target_forward(spec, params, fed, positions, state.cache, fresh_mask, write)
    finite_at = jnp.all(jnp.isfinite(logits), axis=-1)  # [B, N+1]
    counts = None
    if state.history is not None:  # penalties as they would be after each fed token's path
        counts = state.history.counts_at_nodes(proposal.draft_tokens, proposal.valid, jnp.asarray(fresh_mask))
    states = None  # the constraints' states at each fed token, along its path (see grammar.py)
    if sampling.grammar is not None and parents is None:
        states = sampling.grammar.path_states(
            state.grammar_states, proposal.draft_tokens, spec.config.vocab_size
        )
    elif sampling.grammar is not None:
        states = sampling.grammar.node_states(
            state.grammar_states, proposal.draft_tokens, parents, spec.config.vocab_size
        )
    return adjust(spec, sampling, logits, state.history, counts, states), finite_at, hidden, cache


def _verify_drafts(
    spec: LoopSpec, params: LlamaParams, state: DecodeState, proposal, sampling, keys, write=True
):
    """Score the last token and the K drafts in one target pass and verify them (`verifier`).
    Returns a Verdict."""
    valid = proposal.valid
    K = valid.shape[1]  # spec.k, or fewer when a Dynamic proposer drafts a narrower step
    depths, fresh_mask = np.arange(K + 1), np.tril(np.ones((K + 1, K + 1), bool))
    logits, finite_at, hidden, cache = _score(
        spec, params, state, proposal, sampling, depths, fresh_mask, write
    )
    candidates, num_accepted, expected = verifier(spec).chain(spec.warp, logits, proposal, sampling, keys)
    # Positions after the stop position are never used: a bad value there (say, after an absurd
    # draft token) is not an error of the output.
    finite = jnp.all(finite_at | (jnp.arange(K + 1)[None, :] > num_accepted[:, None]), axis=1)
    logprobs = records(spec.logprobs, logits, sampling, spec.warp, candidates)
    return Verdict(candidates, num_accepted, expected, valid, finite, cache, hidden, logprobs)


def verifier(spec: LoopSpec):
    """What decides each verify pass (speculate/verifiers.py): the one the proposer declares, the
    lossless verifier unless it is a measurement tool (ForcedAcceptance, possibly inside another
    wrapper)."""
    return spec.proposer.capabilities.verifier


def _verify_tree(spec: LoopSpec, params: LlamaParams, state: DecodeState, proposal, sampling, keys):
    """Score the last token and every node of the proposer's token tree in one target pass (the
    tree's attention mask and depths as positions), verify them (`verifier`), and move the
    accepted path's keys and values to the slots a chain would have written them to. Returns a
    Verdict."""
    tree = spec.tree
    B, N, D = state.tokens.shape[0], tree.num_nodes, tree.depth
    rows = jnp.arange(B)
    logits, finite_at, hidden, cache = _score(
        spec, params, state, proposal, sampling, tree.depths, tree.attention_mask, parents=tree.parents
    )
    candidates, num_accepted, path, expected, drafted_at = verifier(spec).tree(
        spec.warp, tree, logits, proposal, sampling, keys
    )
    # Only the nodes on the accepted path are used; every other node's logits may be anything.
    on_path = jnp.zeros((B, N + 1), bool).at[:, 0].set(True)
    on_path = on_path.at[rows[:, None], jnp.where(path >= 0, path, 0)].set(True)
    finite = jnp.all(finite_at | ~on_path, axis=1)
    fed_index = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.maximum(path, 0)], axis=1)  # [B, D+1]
    if not tree.is_chain:  # a chain's accepted nodes already sit where they belong
        # Node i was written at slot (lengths - 1) + i; the path's node at depth d + 1 belongs at
        # lengths + d. Past num_accepted the entries stay put (stale, never committed).
        depth = jnp.arange(D)[None, :]
        source = jnp.where(depth < num_accepted[:, None], fed_index[:, 1:], depth + 1)
        sources = state.lengths[:, None] - 1 + source
        cache = mesh_move_slots(spec.mesh, cache.replace(lengths=state.lengths), sources)
        cache = cache.replace(lengths=state.lengths - 1)
    path_hidden = hidden[rows[:, None], fed_index]  # [B, D+1, D_model]
    # The token at depth d was chosen from the logits of the path's node at depth d (the last token's
    # at 0): only those are needed, [B, D+1, V].
    logprobs = None
    if spec.logprobs is not None:
        logprobs = records(spec.logprobs, logits[rows[:, None], fed_index], sampling, spec.warp, candidates)
    return Verdict(candidates, num_accepted, expected, drafted_at, finite, cache, path_hidden, logprobs)


def _no_drafts(spec: LoopSpec, params: LlamaParams, state: DecodeState, sampling, keys, write=True):
    """What `_verify_drafts` returns when no row drafted anything, at the cost of a one-token pass:
    the target's own token, which is what verification emits for an empty draft. A sampled row
    draws it through `rejection_sample` with nothing drafted, consuming its key exactly as the
    full pass would, so its random stream does not depend on whether other rows drafted."""
    B, K = state.tokens.shape[0], spec.k
    last = state.tokens[jnp.arange(B), state.lengths - 1]
    logits, hidden, cache = target_forward(
        spec, params, last[:, None], (state.lengths - 1)[:, None], state.cache, write=write
    )
    if not write:  # the same shape as the verify branch's entries
        cache = cache.pad_to(K + 1)
    finite = all_finite(logits)  # of the raw logits: a constraint's -inf are no error
    logits = adjust(
        spec,
        sampling,
        logits,
        state.history,
        None if state.history is None else state.history.counts[:, None],
        None if state.grammar_states is None else state.grammar_states[:, None],
    )
    new = greedy_argmax(logits[:, 0])
    if not spec.warp.greedy:
        target_probs = jnp.exp(warp_logits(logits, sampling, spec.warp))  # [B, 1, V]
        nothing = jnp.zeros((B, 0), jnp.int32)
        sampled, _ = rejection_sample(keys, target_probs, jnp.zeros((B, 0, logits.shape[-1])), nothing)
        new = jnp.where(sampling.temperature == 0, new, sampled[:, 0])
    candidates = jnp.concatenate([new[:, None], jnp.full((B, K), -1, jnp.int32)], axis=1)
    zeros = jnp.zeros((B,), jnp.int32)
    path_hidden = jnp.concatenate([hidden, jnp.zeros((B, K) + hidden.shape[2:], hidden.dtype)], axis=1)
    no = jnp.zeros((B, K), bool)
    logprobs = records(spec.logprobs, logits, sampling, spec.warp, new[:, None])
    logprobs = None if logprobs is None else logprobs.pad_to(K + 1)
    return Verdict(candidates, zeros, no.astype(jnp.float32), no, finite, cache, path_hidden, logprobs)


def _pad_verdict(verdict: Verdict, K: int) -> Verdict:
    """A verdict over fewer draft positions, padded to K (nothing drafted or accepted there)."""
    width = verdict.expected.shape[1]
    if width == K:
        return verdict

    def pad(x, value):
        return jnp.concatenate([x, jnp.full((x.shape[0], K - width) + x.shape[2:], value, x.dtype)], axis=1)

    cache = verdict.cache
    return verdict.replace(
        candidates=pad(verdict.candidates, -1),
        expected=pad(verdict.expected, 0.0),
        drafted_at=pad(verdict.drafted_at, False),
        path_hidden=pad(verdict.path_hidden, 0.0),
        cache=cache if isinstance(cache, KVCache) else cache.pad_to(K + 1),
        logprobs=None if verdict.logprobs is None else verdict.logprobs.pad_to(K + 1),
    )


def _propose(spec: LoopSpec, params, proposer_params, state: DecodeState, inputs, keys, width=None):
    """Draft, at `width` for a Dynamic proposer that switches widths. Returns (Proposal over
    spec.k positions, proposer state)."""
    context = ProposeContext(
        target_params=params,
        params=proposer_params,
        tokens=state.tokens,
        lengths=state.lengths,
        keys=keys[:, 0],
        sampling=inputs.sampling,
        history=state.history,
        width=width,
        grammar_states=state.grammar_states,
    )
    with jax.named_scope("propose"):
        proposal, proposer_state = spec.proposer.propose(context, state.proposer_state)
    if inputs.speculate is not None:
        proposal = proposal.replace(valid=proposal.valid & inputs.speculate[:, None])
    return proposal, proposer_state


def _verify(spec: LoopSpec, params, state: DecodeState, proposal, inputs, keys, width=None, write=True):
    """Score and verify a proposal (its first `width` drafts when given): a Verdict padded to spec.k
    positions; with `write=False` it holds the pass's entries, not the written cache."""
    with jax.named_scope("verify"):
        if spec.tree is not None:
            return _verify_tree(spec, params, state, proposal, inputs.sampling, keys[:, 1])
        if width is not None:  # verify only the drafted width
            proposal = jax.tree.map(lambda x: x[:, : max(width, 1)], proposal)
        return _pad_verdict(
            _verify_drafts(spec, params, state, proposal, inputs.sampling, keys[:, 1], write), spec.k
        )


def _skip(spec: LoopSpec, params, state: DecodeState, proposal, inputs, keys, write=True):
    """`_verify` when no running row drafted: a one-token pass (see `_no_drafts`)."""
    with jax.named_scope("verify"):
        return _no_drafts(spec, params, state, inputs.sampling, keys[:, 1], write)


def _propose_and_verify(
    spec: LoopSpec, params, proposer_params, state: DecodeState, inputs, keys, write=True
):
    """Draft, score and verify. Returns (Verdict padded to spec.k positions, proposer state,
    valid [B, K])."""
    proposal, proposer_state = _propose(spec, params, proposer_params, state, inputs, keys)
    valid = proposal.valid
    verify = functools.partial(_verify, spec, params, inputs=inputs, keys=keys, write=write)
    if spec.proposer.capabilities.always_drafts:
        verdict = verify(state, proposal)
    else:
        skip = functools.partial(_skip, spec, params, inputs=inputs, keys=keys, write=write)
        verdict = jax.lax.cond(jnp.any(valid & ~state.done[:, None]), verify, skip, state, proposal)
    return verdict, proposer_state, valid


def smallest_width(widths, valid: jax.Array, running: jax.Array) -> jax.Array:
    """[] index into `widths` (ascending, static) of the smallest width covering every running row's
    drafts (valid [B, K] is a prefix mask per row); 0 when `widths` starts at 0 and none drafted."""
    need = jnp.max(jnp.where(running, jnp.sum(valid, axis=1), 0))
    return jnp.minimum(jnp.searchsorted(jnp.asarray(widths), need), len(widths) - 1)


def _verify_at_widths(spec: LoopSpec, params, proposer_params, state: DecodeState, inputs, keys):
    """`_propose_and_verify` for a chain proposer with `verify_widths` (a Hybrid whose parts draft
    different numbers of tokens): draft once, then verify at the smallest of those widths covering
    every running row's drafts, or make a one-token pass when no running row drafted. A batch-wide
    `lax.switch`: a step whose rows drafted with the shorter part pays for its width only."""
    proposal, proposer_state = _propose(spec, params, proposer_params, state, inputs, keys)
    widths = (0, *spec.proposer.capabilities.verify_widths)
    branch = smallest_width(widths, proposal.valid, ~state.done)
    verdict = jax.lax.switch(branch, _passes(spec, params, inputs, keys, widths), state, proposal)
    return verdict, proposer_state, proposal.valid


def _passes(spec: LoopSpec, params, inputs, keys, widths) -> list:
    """The branches of a switch over verify widths (0 first): the one-token pass, then a verify
    pass at each width, every one leaving the cache to `store`."""
    return [functools.partial(_skip, spec, params, inputs=inputs, keys=keys, write=False)] + [
        functools.partial(_verify, spec, params, inputs=inputs, keys=keys, width=w, write=False)
        for w in widths[1:]
    ]


def _propose_and_verify_widths(spec: LoopSpec, params, proposer_params, state: DecodeState, inputs, keys):
    """`_propose_and_verify` for a proposer with `widths` (0 first): draft at the smallest width
    covering every running row's k, then verify that width, or make a one-token pass (the width-0
    branch) when no running row drafted. Two switches: one switch whose branches each drafted,
    verified and held their own one-token pass compiled that pass once per width, a third of a
    Dynamic(NGram) program's size (docs/benchmarks.md, "What a compiled program holds")."""
    widths = spec.proposer.capabilities.widths
    assert widths[0] == 0, widths
    running = ~state.done
    if widths == (0,):  # a quiet program's step (DynamicSpec.chunk_programs): no row drafts, and
        # the one-token pass writes the cache itself, as plain decoding's does
        proposal, proposer_state = _propose(spec, params, proposer_params, state, inputs, keys, width=0)
        return _skip(spec, params, state, proposal, inputs, keys), proposer_state, proposal.valid
    need = spec.proposer.needed_width(state.proposer_state, running)
    branch = jnp.searchsorted(jnp.asarray(widths), need)  # the smallest width >= need
    drafts = [
        functools.partial(_propose, spec, params, proposer_params, inputs=inputs, keys=keys, width=w)
        for w in widths
    ]
    proposal, proposer_state = jax.lax.switch(branch, drafts, state)
    if not spec.proposer.capabilities.always_drafts:
        branch = jnp.where(jnp.any(proposal.valid & running[:, None]), branch, 0)
    verdict = jax.lax.switch(branch, _passes(spec, params, inputs, keys, widths), state, proposal)
    return verdict, proposer_state, proposal.valid


def speculative_step(
    spec: LoopSpec, params: LlamaParams, proposer_params, state: DecodeState, inputs: GenerationInputs
) -> DecodeState:
    """Propose, score all drafts in one target pass (a chain of k, or a token tree), verify, commit.

    A proposer that may draft nothing (an n-gram miss) gets a one-token pass on the steps where
    no row of the batch drafted: a batch-wide `lax.cond`, since the k+1-token pass costs 1.5x a
    one-token pass on CPU. Likewise a Dynamic proposer with `widths` drafts and verifies only as
    many tokens as its running rows' largest k needs, and a proposer with `verify_widths` (a Hybrid
    of a long and a short drafter) verifies only as many as its running rows drafted: a batch-wide
    `lax.switch` over those widths. Rows never branch individually.
    """
    K = spec.k
    running = ~state.done
    state = state.replace(step=state.step + 1)
    keys = jax.vmap(jax.random.split)(step_keys(state.keys, row_step(state)))  # [B, 2]

    capabilities = spec.proposer.capabilities
    widths = capabilities.widths
    verify_widths = None if spec.tree is not None else capabilities.verify_widths
    # Passes inside a cond or switch leave the cache to `store` (see FreshEntries). A tree's
    # verifier writes, since it moves entries after writing them (tree proposers always draft,
    # so no cond holds their pass).
    write = spec.tree is not None or (widths is None and capabilities.always_drafts)
    if widths is not None:
        verdict, proposer_state, valid = _propose_and_verify_widths(
            spec, params, proposer_params, state, inputs, keys
        )
    elif verify_widths is not None:
        verdict, proposer_state, valid = _verify_at_widths(spec, params, proposer_params, state, inputs, keys)
    else:
        verdict, proposer_state, valid = _propose_and_verify(
            spec, params, proposer_params, state, inputs, keys, write=write
        )
    num_accepted = verdict.num_accepted
    with jax.named_scope("commit"):
        state, num_emitted = commit(
            spec, inputs, state, verdict.candidates, num_accepted + 1, verdict.logprobs
        )
    ended_at_stop = running & state.done & (state.lengths < state.max_lengths)
    state = flag_nonfinite(state, verdict.finite, running)
    with jax.named_scope("propose"):  # the proposer catching up on the verdict
        context = UpdateContext(path_features=verdict.path_hidden, num_accepted=num_accepted, running=running)
        proposer_state = spec.proposer.update(context, proposer_state)

    m = state.metrics
    live = running[:, None]
    position = jnp.arange(K)[None, :]
    # In a step that ends its row at a stop (EOS, a stop id or string), accepted drafts count only
    # up to it: the target "agreeing" with drafts past the end of the text is no acceptance, and
    # counting it would inflate a proposer that drafts through EOS (a constraint's forced EOS).
    # Drafts accepted past the row's max length do count: the target did accept them.
    num_accepted = jnp.where(ended_at_stop, jnp.minimum(num_accepted, num_emitted), num_accepted)
    drafted_at = live & verdict.drafted_at
    accepted_at = live & (position < num_accepted[:, None])
    drafting = running & jnp.any(valid, axis=1)  # the step verified a draft of the row
    reached_at = drafted_at & (position <= num_accepted[:, None])
    metrics = m.replace(
        steps=m.steps + running,
        drafting_steps=m.drafting_steps + drafting,
        target_forwards=m.target_forwards + running,
        drafted=m.drafted + jnp.sum(live & valid, axis=1),
        drafted_at=m.drafted_at + drafted_at,
        accepted=m.accepted + jnp.where(running, num_accepted, 0),
        emitted=m.emitted + num_emitted,
        accepted_at=m.accepted_at + accepted_at,
        reached_at=m.reached_at + reached_at,
        accept_hist=m.accept_hist
        + (drafting[:, None] & (jnp.arange(K + 1)[None, :] == num_accepted[:, None])),
        expected_accept_at=m.expected_accept_at + jnp.where(drafted_at, verdict.expected, 0.0),
    )
    cache = store(spec, state.cache, verdict.cache)
    return state.replace(cache=cache.advance(num_emitted), proposer_state=proposer_state, metrics=metrics)


def generate_program(
    spec: LoopSpec, params: LlamaParams, proposer_params, inputs: GenerationInputs
) -> DecodeState:
    """The whole generation, to be jitted with `spec` static: prefill + one while_loop, traced
    under `spec.backend` (its kernels and matmul precision)."""
    with (spec.backend or backend.active()).tracing():
        params, proposer_params = program_params(spec, params, proposer_params)
        state = prefill(spec, params, proposer_params, inputs)

        def cond(state: DecodeState) -> jax.Array:
            return jnp.any(~state.done) & (state.step < spec.capacity)

        step = functools.partial(decoding_step, spec, params, proposer_params, inputs=inputs)
        return jax.lax.while_loop(cond, step, state)


def program_params(spec: LoopSpec, params: LlamaParams, proposer_params):
    """The weights as the program's backend reads them: on one that scans layers, each run of
    layers stacked (a copy of their weights, made once per program before its loop), a draft
    model's own layers too."""
    if not (spec.backend or backend.active()).scans_layers:
        return params, proposer_params
    params = stack_layers(params, spec.config)
    if spec.proposer is not None and proposer_params is not None:  # a draft model's own layers
        proposer_params = spec.proposer.stack_layers(proposer_params)
    return params, proposer_params


def decoding_step(spec: LoopSpec, params, proposer_params, state: DecodeState, inputs) -> DecodeState:
    """One step of the loop: plain or speculative."""
    if spec.proposer is None:
        return plain_step(spec, params, state, inputs)
    return speculative_step(spec, params, proposer_params, state, inputs)


def resume_program(
    spec: LoopSpec,
    params: LlamaParams,
    proposer_params,
    state: DecodeState,
    inputs: GenerationInputs,
    max_steps: jax.Array,
    reported: jax.Array,
    window: int,
) -> tuple[DecodeState, jax.Array, LogprobRecords | None]:
    """Run the loop from `state` for at most max_steps [] steps, or until a row finishes (its
    slot is free for the next request), or until every row is done.

    The continuous batch's chunk (specjax/serve/engine.py): `params` as `program_params` made
    them (the engine stacks its weights once, not every chunk). Returns the state and, so that
    only new tokens go to the host, tokens [B, window] of each row from column reported[b] on
    (the host's count of the row's tokens it has seen; `window` static, >= the tokens a chunk
    can commit past it), and their logprob records [B, window, ...] (None where the state keeps
    none)."""
    with (spec.backend or backend.active()).tracing():
        first_step, done_before = state.step, state.done

        def cond(state: DecodeState) -> jax.Array:
            freed = jnp.any(state.done & ~done_before)
            under = state.step - first_step < max_steps
            go_on = jnp.any(~state.done) & under & ~freed
            ends = (
                None if spec.proposer is None else spec.proposer.ends_chunk(state.proposer_state, ~state.done)
            )
            if ends is not None:  # Dynamic's programs for steps that draft and for those that don't
                # (DynamicSpec.chunk_programs), after at least one step
                go_on &= ~ends | (state.step == first_step)
            return go_on

        step = functools.partial(decoding_step, spec, params, proposer_params, inputs=inputs)
        state = jax.lax.while_loop(cond, step, state)
        columns = jnp.minimum(reported[:, None] + jnp.arange(window)[None, :], spec.capacity - 1)
        logprobs = None if state.logprobs is None else state.logprobs.window(columns)
        return state, jnp.take_along_axis(state.tokens, columns, axis=1), logprobs
