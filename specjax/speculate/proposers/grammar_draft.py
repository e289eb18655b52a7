"""Drafting what a row's constraint forces (Sampling(regex=...), json_schema, choice), for free: no
model runs. From the row's automaton state GrammarDraft drafts the tokens of the text the
constraint forces from there (a JSON schema's keys and punctuation, the rest of a choice once it
is unambiguous), as the tokenizer spells that text: the host reads them once per automaton
(specjax/speculate/grammar.py, `forced_tokens`) into the device table `Grammar.forced`, and a
step drafts one row of it. A row without a constraint, or at a state where the next text is not
forced, drafts nothing (valid False).

Deterministic (q one-hot), so verification stays lossless: the target's own mask makes every
draft's p the target's renormalised probability of it. A forced text can be spelt by several
token sequences; where the target writes another spelling than the tokenizer's, the drafts from
there are rejected and the target's own token is kept.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.speculate.proposers.base import Proposal, Stateless, check_k
from specjax.speculate.proposers.protocol import Capabilities, ProposeContext, Proposer


@dataclasses.dataclass(frozen=True)
class GrammarDraft(Stateless, Proposer):
    """Up to `k` tokens of the text the row's constraint forces from its current automaton state."""

    k: int = 8

    def __post_init__(self):
        check_k("GrammarDraft", self.k)

    @property
    def capabilities(self) -> Capabilities:
        # A forced text is often a token or two: a step verifies only as wide as its rows drafted,
        # among powers of two up to k (each width one branch of the program).
        widths = sorted({min(1 << i, self.k) for i in range(self.k.bit_length() + 1)})
        return Capabilities(always_drafts=False, narrows=True, stateless=True, verify_widths=tuple(widths))

    def spec(self, target=None, warp=None, mesh=None) -> GrammarDraft:
        return self

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
        width = min(self.k, grammar.forced.shape[1])
        forced = grammar.forced[jnp.maximum(states, 0), :width]  # [B, width]
        valid = (forced >= 0) & (states >= 0)[:, None]  # (a row's forced tokens are a prefix)
        drafts = jnp.maximum(forced, 0)
        if width < self.k:  # (k beyond the table's FORCED_TOKENS: nothing more is drafted)
            drafts = jnp.pad(drafts, ((0, 0), (0, self.k - width)))
            valid = jnp.pad(valid, ((0, 0), (0, self.k - width)))
        return Proposal(draft_tokens=drafts, valid=valid), state
