"""Drafting what a row's constraint forces (Sampling(regex=...), json_schema, choice): where the
automaton's state allows exactly one token (a JSON schema's keys and punctuation, the rest of a
choice once it is unambiguous), that token is the draft, for free: no model runs. A row without a
constraint, or at a state that allows several tokens, drafts nothing (valid False from there).

Deterministic (q one-hot), so verification stays lossless; the target's own mask makes every
forced draft's p the target's renormalised probability of it, 1 where the constraint forces it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.speculate.proposers.base import Proposal, Stateless, check_k
from specjax.speculate.proposers.protocol import Capabilities, ProposeContext, Proposer


@dataclasses.dataclass(frozen=True)
class GrammarDraft(Stateless, Proposer):
    """Up to `k` tokens the row's constraint forces from its current automaton state.
    `vocab_size` is the target's, set by `spec`."""

    k: int = 8
    vocab_size: int = 0

    def __post_init__(self):
        check_k("GrammarDraft", self.k)

    capabilities = Capabilities(always_drafts=False, narrows=True, stateless=True)

    def spec(self, target=None, warp=None, mesh=None) -> GrammarDraft:
        return self if target is None else dataclasses.replace(self, vocab_size=target.config.vocab_size)

    def with_k(self, k: int) -> GrammarDraft:
        return dataclasses.replace(self, k=k)

    def narrowed(self, k: int) -> GrammarDraft:
        return dataclasses.replace(self, k=k)

    def propose(self, ctx: ProposeContext, state):
        B = ctx.lengths.shape[0]
        grammar, states = ctx.sampling.grammar, ctx.grammar_states
        if grammar is None or states is None:  # no row of the call has a constraint
            nothing = jnp.zeros((B, self.k), jnp.int32)
            return Proposal(draft_tokens=nothing, valid=nothing.astype(bool)), state
        words = grammar.allowed.shape[1]
        drafts, valid = [], []
        forced_so_far = states >= 0
        for _ in range(self.k):  # k small and static
            allowed = grammar.mask(states, words * 32)  # [B, W*32]
            token = jnp.argmax(allowed, axis=-1).astype(jnp.int32)
            forced_so_far &= jnp.sum(allowed, axis=-1) == 1
            drafts.append(token)
            valid.append(forced_so_far)
            # A forced token without an edge is EOS (where the automaton accepts): the row ends
            # there, so nothing is drafted after it (drafts past it would be "accepted" uselessly).
            hit, after = grammar.edge(states, token, self.vocab_size)
            forced_so_far &= hit
            states = jnp.where(hit, after, states)
        return Proposal(draft_tokens=jnp.stack(drafts, axis=1), valid=jnp.stack(valid, axis=1)), state
