"""FastDeploy's MTP "with_ngram": a model drafts its k tokens (`num_model_steps`), then prompt lookup
over the prompt, the output and those drafts extends the chain by up to ngram.k more (to
`num_speculative_tokens`), inside the one compiled loop.

The lookup is NGram's (`ngram_propose`), run on the committed sequence with the model's drafts
written after it, so the n-gram that ends at the last draft is matched and its earlier
continuation proposed. A row with no match verifies the model's drafts alone; a step where no
running row matched verifies only the model's width (`verify_widths`). The model part catches up
on however many of the whole chain were accepted (`accepting`, as a Hybrid part does). Lossless
as each part is: the model's drafts carry their q (one-hot for greedy drafts, the warped
distribution for sampled ones), the looked-up ones a one-hot q.

The state counts, per row and per part, the steps with drafts from it, its drafts and those
accepted: position i < k_model is the model's, the rest the lookup's. `SpecMetrics.proposer`
reports them apart ("model_*" and "ngram_*").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.speculate.proposers.base import MAX_SPECULATIVE_TOKENS, Proposal, draft_distribution
from specjax.speculate.proposers.ngram import NGram, ngram_propose
from specjax.speculate.proposers.protocol import (
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
    Wrapper,
)

_PARTS = ("model", "ngram")
_COUNTERS = ("steps", "drafted", "accepted")


@flax.struct.dataclass
class WithNGramState:
    inner: Any  # the model part's state
    counts: jax.Array  # [B, 2, 3] int32: per part, steps drafted from, drafts, accepted
    num_valid: jax.Array  # [B, 2] int32: each part's drafts this step


@dataclasses.dataclass(frozen=True)
class WithNGramSpec(Wrapper):
    inner: ProposerSpec  # the model part's spec, catching up on up to k accepted drafts
    ngram: NGram

    @property
    def k(self) -> int:
        return self.inner.k + self.ngram.k

    @property
    def capabilities(self) -> Capabilities:
        # A step verifies the model's drafts alone (no row matched) or the whole chain.
        return Capabilities.combine(
            {"proposer": self.inner.capabilities},
            "WithNGram",
            verify_widths=(self.inner.k, self.k),
            catches_up=False,
            accepts=None,
            narrows=False,
        )

    def init(self, ctx: InitContext) -> WithNGramState:
        inner = self.inner.init(ctx)
        B = ctx.prompt_tokens.shape[0]
        zeros = jnp.zeros((B, len(_PARTS)), jnp.int32)
        return WithNGramState(inner, jnp.zeros((B, len(_PARTS), len(_COUNTERS)), jnp.int32), zeros)

    def propose(self, ctx: ProposeContext, state: WithNGramState):
        model, inner = self.inner.propose(ctx, state.inner)
        tokens, lengths = ctx.tokens, ctx.lengths
        B, m = model.draft_tokens.shape
        at = lengths[:, None] + jnp.arange(m)[None, :]  # the drafts after the committed tokens
        extended = tokens.at[jnp.arange(B)[:, None], at].set(model.draft_tokens, mode="drop")
        looked_up = ngram_propose(extended, lengths + m, self.ngram.k, self.ngram.n_max, self.ngram.n_min)
        valid = jnp.concatenate([model.valid, looked_up.valid & model.valid[:, -1:]], axis=1)
        probs = None
        if model.draft_probs is not None:
            V = model.draft_probs.shape[-1]
            probs = jnp.concatenate([model.draft_probs, draft_distribution(looked_up, V)], axis=1)
        draft_tokens = jnp.concatenate([model.draft_tokens, looked_up.draft_tokens], axis=1)
        num_valid = jnp.stack([jnp.sum(valid[:, :m], axis=1), jnp.sum(valid[:, m:], axis=1)], axis=1)
        proposal = Proposal(draft_tokens=draft_tokens, valid=valid, draft_probs=probs)
        return proposal, state.replace(inner=inner, num_valid=num_valid.astype(jnp.int32))

    def update(self, ctx: UpdateContext, state: WithNGramState) -> WithNGramState:
        m, num_accepted = self.inner.k, ctx.num_accepted
        accepted = jnp.stack([jnp.minimum(num_accepted, m), jnp.maximum(num_accepted - m, 0)], axis=1)
        live = ctx.running[:, None].astype(jnp.int32)  # (its counts match the loop's metrics)
        new = jnp.stack([state.num_valid > 0, state.num_valid, accepted], axis=2).astype(jnp.int32)
        return state.replace(
            inner=self.inner.update(ctx, state.inner), counts=state.counts + live[:, :, None] * new
        )

    def observe(self, ctx: ProposeContext, state: WithNGramState) -> WithNGramState:
        return state.replace(inner=self.inner.observe(ctx, state.inner))

    # The methods of the continuous batch read the state, which wraps the model part's.
    def needed_width(self, state: WithNGramState, running):
        return jnp.asarray(self.k, jnp.int32)

    def may_draft(self, state: WithNGramState, running):
        return self.inner.may_draft(state.inner, running)

    def ends_chunk(self, state: WithNGramState, running):
        return self.inner.ends_chunk(state.inner, running)

    def join(self, batch_state: WithNGramState, row_state: WithNGramState, running):
        return row_state.replace(inner=self.inner.join(batch_state.inner, row_state.inner, running))

    def counters(self, state: WithNGramState) -> dict[str, jax.Array]:
        """Per-row counts reported apart in SpecMetrics.proposer: model_drafted, ngram_accepted, ..."""
        # (The model part's own counts are not reported: WithNGram's proposers keep none.)
        return {
            f"{part}_{name}": state.counts[:, i, j]
            for i, part in enumerate(_PARTS)
            for j, name in enumerate(_COUNTERS)
        }


@dataclasses.dataclass(frozen=True, eq=False)
class WithNGram(Proposer):
    """FastDeploy's "with_ngram": `proposer` (e.g. `MTP(k=1)`, FastDeploy's num_model_steps) drafts a
    chain, then prompt lookup (`ngram`, an NGram: its k, n_max, n_min) over the prompt, the output
    and those drafts extends it by up to ngram.k tokens; k is their sum (num_speculative_tokens)."""

    proposer: Any
    ngram: NGram = NGram(k=2)

    def __post_init__(self):
        if not isinstance(self.ngram, NGram):
            raise ValueError(f"WithNGram ngram must be a specjax.NGram, got {type(self.ngram).__name__}")
        if not isinstance(self.proposer, Proposer):
            raise ValueError(f"WithNGram proposer must be a specjax proposer, got {self.proposer!r}")
        k = self.proposer.draft_positions
        if k + self.ngram.k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"WithNGram: proposer k={k} plus ngram k={self.ngram.k} must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {k + self.ngram.k}"
            )

    @property
    def draft_positions(self) -> int:
        return self.proposer.draft_positions + self.ngram.k

    def with_k(self, k: int) -> WithNGram:
        """The model part keeps its k, the lookup takes the rest."""
        model_k = self.proposer.draft_positions
        if k <= model_k:
            raise ValueError(
                f"k={k}: WithNGram's proposer drafts k={model_k}; k must exceed it (the lookup's share)"
            )
        return WithNGram(self.proposer, dataclasses.replace(self.ngram, k=k - model_k))

    def parts(self) -> tuple[Proposer, ...]:
        return (self.proposer, self.ngram)

    def spec(self, target, warp=None, mesh=None) -> WithNGramSpec:
        inner = self.proposer.spec(target, warp, mesh)
        caps, name = inner.capabilities, type(self.proposer).__name__
        if not caps.catches_up or caps.target_features is None:
            raise ValueError(
                f"WithNGram proposer must draft from the target's features and catch up on the lookup's "
                f"accepted drafts too (MTP, Eagle, Eagle3, Medusa, DFlash), got {name}"
            )
        if caps.tree is not None or not caps.always_drafts:
            raise ValueError(
                f"WithNGram proposer ({name}) must draft a whole chain every step (no tree, no "
                "confidence threshold): the lookup continues after its last draft"
            )
        return WithNGramSpec(inner=inner.accepting(inner.k + self.ngram.k), ngram=self.ngram)

    def params(self, target):
        return self.proposer.params(target)
