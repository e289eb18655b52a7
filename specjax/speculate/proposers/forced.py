"""Synthetic acceptance: a measurement tool that forces how many drafts each step accepts.

NOT lossless, and not meant to produce text: a forced step commits drafts the target may not
agree with. What it is for: separating system overhead from draft quality. With the drafts free
(`proposer=None`), tokens/s against the forced rate is the ceiling the loop itself allows (the
cost of scoring k+1 tokens, of verification and bookkeeping); with a real proposer it adds that
proposer's drafting cost at a known acceptance. A row accepts position i, once reached, with the
conditional probability `acceptance[i]`, independently per step; the token after the accepted
drafts is the target's own choice there, as in real verification. The step's work is exactly a
real step's: the same proposer, the same target pass, the same commit.

Set a stop-token bias (e.g. `Sampling(logit_bias={eos: -1e9})`) when measuring speed, or rows may
end early on a target token emitted after nonsense drafts.

The override is `ForcedVerifier`, which this proposer declares as its verifier (its
`capabilities.verifier`: the loop uses whatever verifier a proposer declares); the verifiers
themselves know nothing of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_number
from specjax.speculate.proposers.base import Proposal, Stateless, check_k
from specjax.speculate.proposers.protocol import (
    Capabilities,
    ProposeContext,
    Proposer,
    ProposerSpec,
    Wrapper,
)
from specjax.speculate.sampling import choose_tokens
from specjax.speculate.verify import assemble


def _check_rates(acceptance) -> tuple[float, ...]:
    rates = (acceptance,) if not isinstance(acceptance, Sequence) else tuple(acceptance)
    if not rates or not all(is_number(r) and math.isfinite(r) and 0 <= r <= 1 for r in rates):
        raise ValueError(
            "ForcedAcceptance acceptance must be a number in [0, 1] or a non-empty list of them (one "
            f"conditional rate per draft position), got {acceptance!r}"
        )
    return tuple(float(r) for r in rates)


@dataclasses.dataclass(frozen=True)
class FreeDrafts(Stateless):
    """Drafts that cost nothing: the row's last token, k times. Only ForcedAcceptance uses them."""

    k: int
    capabilities = Capabilities(narrows=True, stateless=True)

    def narrowed(self, k: int) -> FreeDrafts:
        return FreeDrafts(k)

    def propose(self, ctx: ProposeContext, state):
        tokens, lengths = ctx.tokens, ctx.lengths
        last = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
        draft = jnp.broadcast_to(last[:, None], (tokens.shape[0], self.k))
        return Proposal(draft_tokens=draft, valid=jnp.ones(draft.shape, bool)), state


@dataclasses.dataclass(frozen=True)
class ForcedSpec(Wrapper):
    """The static part: the proposer that drafts (its spec) and the forced rates, one per position.
    Everything but the verifier is the drafting spec's (protocol.Wrapper)."""

    inner: ProposerSpec
    forced_acceptance: tuple[float, ...]  # [k] conditional acceptance per draft position

    @property
    def capabilities(self) -> Capabilities:
        inner = self.inner.capabilities
        verifier = ForcedVerifier(self.forced_acceptance, inner.verifier)
        return Capabilities.combine({"proposer": inner}, "ForcedAcceptance", verifier=verifier)


@dataclasses.dataclass(frozen=True, eq=False)
class ForcedAcceptance(Proposer):
    """Force the acceptance of drafts (a measurement tool, never lossless; see the module doc).

    acceptance: the conditional rate of every draft position (one number), or one per position.
    proposer: the proposer whose drafts (and drafting cost) to use; None drafts for free. Any
    proposer, wrappers included (Dynamic, Hybrid); a ForcedAcceptance inside another is refused.
    k: draft positions; defaults to the proposer's (`draft_positions`), or to len(acceptance)
    without a proposer. A token tree is forced along its first-ranked path.
    """

    acceptance: float | Sequence[float]
    proposer: Any = None
    k: int | None = None

    def __post_init__(self):
        rates = _check_rates(self.acceptance)
        if self.proposer is not None and not isinstance(self.proposer, Proposer):
            kind = type(self.proposer).__name__
            raise ValueError(f"ForcedAcceptance proposer must be None or a specjax proposer, got {kind}")
        if any(isinstance(p, ForcedAcceptance) for p in _all_parts(self.proposer)):
            raise ValueError(
                "ForcedAcceptance proposer must not hold a ForcedAcceptance: one forced verifier "
                "decides each step; wrap the whole proposer once"
            )
        k = self.k
        if k is None and self.proposer is not None:
            k = self.proposer.draft_positions
        if k is None:
            k = len(rates)
        check_k("ForcedAcceptance", k)
        if len(rates) not in (1, k):
            raise ValueError(
                f"ForcedAcceptance acceptance has {len(rates)} rates for k={k} draft positions; give one "
                "rate for all or one per position"
            )
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "acceptance", rates * k if len(rates) == 1 else rates)

    def with_k(self, k: int) -> ForcedAcceptance:
        rates = self.acceptance if len(set(self.acceptance)) == 1 else None
        if rates is None:
            raise ValueError(f"k={k}: cannot change k of a ForcedAcceptance with one rate per position")
        inner = None if self.proposer is None else self.proposer.with_k(k)
        return ForcedAcceptance(rates[0], inner, k)

    def parts(self) -> tuple[Proposer, ...]:
        return () if self.proposer is None else (self.proposer,)

    def spec(self, target, warp=None, mesh=None) -> ForcedSpec:
        inner = FreeDrafts(self.k) if self.proposer is None else self.proposer.spec(target, warp, mesh)
        if inner.k != self.k:
            raise ValueError(
                f"ForcedAcceptance k={self.k} differs from its proposer's k={inner.k}: give k equal to "
                "the proposer's draft positions, or leave it out"
            )
        return ForcedSpec(inner, self.acceptance)

    def params(self, target):
        return None if self.proposer is None else self.proposer.params(target)


def _all_parts(proposer) -> list:
    """The proposer and every proposer inside it."""
    if proposer is None:
        return []
    return [proposer, *(p for part in proposer.parts() for p in _all_parts(part))]


def forced_num_accepted(keys: jax.Array, rates: tuple[float, ...], valid: jax.Array) -> jax.Array:
    """[B] drafts accepted under the forced rates: position i (once reached) passes with probability
    rates[i]; a row stops at its first failure or invalid draft. keys [B], valid [B, K]."""
    u = jax.vmap(lambda key: jax.random.uniform(key, (len(rates),)))(keys)  # [B, K]
    passes = (u < jnp.asarray(rates)[None, :]) & valid
    return jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class ForcedVerifier:
    """The verifier of a ForcedAcceptance proposer (speculate/verifiers.py has the interface):
    `inner` verifies as usual and its analytic acceptance (and a tree's drafted depths) is kept for
    the metrics; then each row accepts as many drafts as `forced_num_accepted` draws, and the token
    after them is the target's own choice at that position. A tree is forced along its
    first-ranked path."""

    rates: tuple[float, ...]  # [K] conditional acceptance per draft position
    inner: Any  # the verifier whose analytic acceptance is reported

    def chain(self, warp, logits, proposal, sampling, keys):
        draft, valid = proposal.draft_tokens, proposal.valid
        K = draft.shape[1]  # fewer than the rates when a Dynamic proposer drafts a narrower step
        _, _, expected = self.inner.chain(warp, logits, proposal, sampling, keys)
        num_accepted = forced_num_accepted(_fold(keys, 1), self.rates[:K], valid)
        rows = jnp.arange(draft.shape[0])
        own = choose_tokens(_fold(keys, 2), logits[rows, num_accepted], sampling, warp)[0]
        candidates = assemble(jnp.concatenate([draft, own[:, None]], axis=1), num_accepted, own)
        return candidates, num_accepted, expected

    def tree(self, warp, tree, logits, proposal, sampling, keys):
        _, _, _, expected, drafted_at = self.inner.tree(warp, tree, logits, proposal, sampling, keys)
        nodes, valid = proposal.draft_tokens, proposal.valid  # [B, N]
        D = tree.depth
        first = tree.first_ranked_path  # [D0] node indices
        along_first = _pad_nodes(first, D)
        num_accepted = forced_num_accepted(_fold(keys, 1), self.rates[: len(first)], valid[:, first - 1])
        path = jnp.where(jnp.arange(D)[None, :] < num_accepted[:, None], along_first, -1)
        at = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.asarray(first)])[num_accepted]  # [B]
        own = choose_tokens(_fold(keys, 2), logits[jnp.arange(nodes.shape[0]), at], sampling, warp)[0]
        along = jnp.concatenate([nodes[:, along_first - 1], own[:, None]], axis=1)
        candidates = assemble(along, num_accepted, own)
        return candidates, num_accepted, path, expected, drafted_at


def _fold(keys: jax.Array, data: int) -> jax.Array:
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, data)


def _pad_nodes(first: np.ndarray, D: int) -> np.ndarray:
    """[D] the first-ranked path's nodes, its last repeated past its end (those are never used)."""
    fill = first[-1] if len(first) else 1
    return np.concatenate([first, np.full(D - len(first), fill, np.int32)]).astype(np.int32)
