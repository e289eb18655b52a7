"""What every proposer returns, and the checks all proposers share."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.checks import check_int
from specjax.speculate.grammar import mask_draft_logits
from specjax.speculate.proposers.protocol import (
    FINAL_HIDDEN,
    Capabilities,
    InitContext,
    ProposeContext,
    ProposerSpec,
    UpdateContext,
)
from specjax.speculate.sampling import adjust_logits, choose_tokens
from specjax.speculate.tree import MAX_SPECULATIVE_TOKENS


@flax.struct.dataclass
class Proposal:
    """Up to K draft tokens per row.

    draft_probs is the exact (warped) distribution each draft token was drawn from, or None for a
    deterministic proposer (its q is one-hot on the draft token). valid is a prefix mask: a row
    may draft fewer than K tokens, or none.
    """

    draft_tokens: jax.Array  # [B, K] int32
    valid: jax.Array  # [B, K] bool
    draft_probs: jax.Array | None = None  # [B, K, V] float32


def check_k(owner: str, k) -> None:
    check_int(f"{owner} k", k, 1, MAX_SPECULATIVE_TOKENS)


class Stateless(ProposerSpec):
    """Defaults for a proposer spec that keeps no state of its own (NGram, or a researcher's own
    rule over the tokens): no memory, nothing to set up after the prefill, nothing to catch up on.
    A subclass supplies `k` and `propose` (see protocol.py), and `capabilities` where it is not a
    chain drafter's that drafts k every step."""

    capabilities = Capabilities(stateless=True)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return 0

    def init(self, ctx: InitContext):
        return None

    def update(self, ctx: UpdateContext, state):
        return state

    def observe(self, ctx: ProposeContext, state):
        return state


@flax.struct.dataclass
class LastHiddenState:
    hidden: jax.Array  # [B, D] the target's final-normed hidden state the last token came from


class FromLastHidden(ProposerSpec):
    """Defaults for a proposer spec that drafts from one hidden state per row (Medusa, the MLP
    speculator): the target's, at the token before the last committed one (the state the last
    token was predicted from). A subclass is a frozen dataclass with `hidden_size`, `k` and a
    `max_accepted` field (None), and supplies `propose`."""

    hidden_size: int
    max_accepted: int | None

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(target_features=FINAL_HIDDEN, catches_up=True, accepts=self.max_accepted)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return batch_size * self.hidden_size * 4

    def init(self, ctx: InitContext) -> LastHiddenState:
        rows = jnp.arange(ctx.prompt_tokens.shape[0])
        return LastHiddenState(hidden=ctx.target_features[rows, ctx.prompt_lengths - 1])

    def update(self, ctx: UpdateContext, state: LastHiddenState) -> LastHiddenState:
        rows = jnp.arange(ctx.path_features.shape[0])
        return LastHiddenState(hidden=ctx.path_features[rows, ctx.num_accepted])

    def accepting(self, K: int):
        """Itself, reading the hidden state after up to K accepted drafts (`update` takes any)."""
        return self if K <= self.accepts else dataclasses.replace(self, max_accepted=K)

    def observe(self, ctx: ProposeContext, state: LastHiddenState) -> LastHiddenState:
        return state  # nothing to catch up on: `update` keeps the one hidden state it drafts from


def draft_distribution(proposal: Proposal, vocab_size: int) -> jax.Array:
    """q of each draft [B, K, V]: its own, or one-hot for a deterministic proposer."""
    if proposal.draft_probs is not None:
        return proposal.draft_probs.astype(jnp.float32)
    return jax.nn.one_hot(proposal.draft_tokens, vocab_size, dtype=jnp.float32)


def draft_keys(keys: jax.Array, k: int) -> jax.Array:
    """One key per row [B] -> one per draft position and row [k, B]."""
    return jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, k))(keys), 0, 1)


def choose_draft(keys, logits, sampling, warp, history, counts, states=None):
    """One draft token per row from a drafter's logits [B, V], adjusted and warped exactly as the
    target's are (bias, penalties with `counts` [B, V] as they would stand after the drafts so
    far, the rows' constraints at `states` [B], the automaton states along the drafts so far or
    None, then temperature and filters). Returns (tokens [B], probs [B, V]: the distribution each
    was drawn from, None when every row is greedy, counts with the tokens added, the states after
    the tokens)."""
    if history is not None:
        logits = adjust_logits(logits, sampling, warp, counts, history.in_prompt)
    else:
        logits = adjust_logits(logits, sampling, warp)
    if states is not None:
        logits = mask_draft_logits(sampling.grammar, logits, states)
    token, probs = choose_tokens(keys, logits, sampling, warp)
    if history is not None:
        counts = counts.at[jnp.arange(token.shape[0]), token].add(1)
    if states is not None:
        states = sampling.grammar.step(states, token, logits.shape[-1])
    return token, probs, counts, states


def kept_inputs(owner, target, build: Callable[[Any], Any]):
    """`build(target)`, kept on `owner` (a user-facing proposer object) while `target.params`
    lives: every call with the same model gets the same params object, so that the gather of a
    draft vocabulary's head columns runs once and the CPU panel copy made for that object
    (api._with_panels) is found again."""
    kept = owner.__dict__.get("_kept_inputs")
    if kept is not None and kept[0]() is target.params:
        return kept[1]
    inputs = build(target)
    object.__setattr__(owner, "_kept_inputs", (weakref.ref(target.params), inputs))
    return inputs


@flax.struct.dataclass
class HeadInputs:
    """The params of a trained-head proposer (Medusa, EAGLE): the head's own, and the target's LM
    head restricted to the head's draft vocabulary (models/draft_vocab.py), gathered once per call."""

    head: Any  # MedusaParams or EagleParams
    head_matrix: jax.Array  # [D, W]
    vocab: jax.Array  # [W] int32: draft-vocabulary index -> token id
