"""Hybrid drafting (FastDeploy's n-gram + MTP): per row, the first proposer's drafts where it has
any this step, the second's otherwise, inside the one compiled loop.

Typical use: `Hybrid(NGram(k=5, n_min=3), Eagle3(head))`: prompt lookup where the text copies
(code edits, summaries, retrieval), a trained head elsewhere. Both proposers draft every step and
both see every verdict, so each keeps its own state current (a head's pending features, a draft
model's cache); a row then verifies one of the two proposals as a chain. Lossless as every
proposer is: a row's drafts are exactly one proposer's, with that proposer's q (one-hot for a
deterministic one).

The state counts, per row and per proposer, the steps whose drafts came from it, the drafts it
contributed and those accepted: `SpecMetrics.proposer` reports them apart ("first_*" and
"then_*").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.speculate.proposers.base import Proposal

_COUNTERS = ("steps", "drafted", "accepted")


@flax.struct.dataclass
class HybridState:
    first: Any
    then: Any
    chosen: jax.Array  # [B] int32: whose drafts the row verifies this step (0 first, 1 then)
    counts: jax.Array  # [B, 2, 3] int32: per proposer, steps drafted from, drafts, accepted
    num_valid: jax.Array  # [B] int32: drafts the row verifies this step


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    first: Any
    then: Any
    tree = None  # both are chains, verified as one

    @property
    def k(self) -> int:
        return max(self.first.k, self.then.k)

    @property
    def always_drafts(self) -> bool:
        return self.first.always_drafts or self.then.always_drafts

    @property
    def feature_layers(self):
        return getattr(self.first, "feature_layers", None) or getattr(self.then, "feature_layers", None)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return self.first.state_bytes(batch_size, capacity) + self.then.state_bytes(batch_size, capacity)

    def init(self, target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden):
        B = prompt_tokens.shape[0]
        args = (prompt_tokens, prompt_lengths, capacity, target_hidden)
        return HybridState(
            first=self.first.init(target_params, params[0], *args),
            then=self.then.init(target_params, params[1], *args),
            chosen=jnp.zeros((B,), jnp.int32),
            counts=jnp.zeros((B, 2, len(_COUNTERS)), jnp.int32),
            num_valid=jnp.zeros((B,), jnp.int32),
        )

    def propose(self, target_params, params, state: HybridState, tokens, lengths, keys, sampling, history):
        then_keys = None if keys is None else jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 1)
        common = (tokens, lengths)
        first, first_state = self.first.propose(
            target_params, params[0], state.first, *common, keys, sampling, history
        )
        then, then_state = self.then.propose(
            target_params, params[1], state.then, *common, then_keys, sampling, history
        )
        first, then = _padded(first, self.k), _padded(then, self.k)
        use_first = first.valid[:, 0]  # the first proposer has a draft for this row
        pick = use_first[:, None]
        draft = jnp.where(pick, first.draft_tokens, then.draft_tokens)
        valid = jnp.where(pick, first.valid, then.valid)
        probs = None
        if first.draft_probs is not None or then.draft_probs is not None:
            V = (first.draft_probs if first.draft_probs is not None else then.draft_probs).shape[-1]
            p1, p2 = (_probs(p, V) for p in (first, then))
            probs = jnp.where(pick[..., None], p1, p2)
        chosen = jnp.where(use_first, 0, 1).astype(jnp.int32)
        new_state = HybridState(first_state, then_state, chosen, state.counts, jnp.sum(valid, axis=1))
        return Proposal(draft_tokens=draft, valid=valid, draft_probs=probs), new_state

    # The loop hands `update` the rows still running, so that the counts match its own metrics.
    counts_running_rows = True

    def update(self, state: HybridState, path_hidden, num_accepted, running) -> HybridState:
        one = jax.nn.one_hot(state.chosen, 2, dtype=jnp.int32) * running[:, None]  # [B, 2]
        drafted = state.num_valid[:, None]
        counts = state.counts.at[:, :, 0].add(one * (drafted > 0))
        counts = counts.at[:, :, 1].add(one * drafted)
        counts = counts.at[:, :, 2].add(one * num_accepted[:, None])

        def own(spec, part_state):  # the target's features at the last token and up to its k drafts
            return spec.update(part_state, path_hidden[:, : spec.k + 1], num_accepted)

        return state.replace(
            first=own(self.first, state.first),
            then=own(self.then, state.then),
            counts=counts,
        )

    def counters(self, state: HybridState) -> dict[str, jax.Array]:
        """Per-row counts reported apart in SpecMetrics.proposer: first_steps, then_accepted, ..."""
        return {
            f"{who}_{name}": state.counts[:, i, j]
            for i, who in enumerate(("first", "then"))
            for j, name in enumerate(_COUNTERS)
        }


def _padded(proposal: Proposal, K: int) -> Proposal:
    """A proposal of k <= K drafts as K (the extra positions invalid)."""
    extra = K - proposal.draft_tokens.shape[1]
    if not extra:
        return proposal

    def pad(x, value):
        return jnp.concatenate([x, jnp.full((x.shape[0], extra) + x.shape[2:], value, x.dtype)], axis=1)

    probs = None if proposal.draft_probs is None else pad(proposal.draft_probs, 0.0)
    return Proposal(pad(proposal.draft_tokens, 0), pad(proposal.valid, False), probs)


def _probs(proposal: Proposal, vocab_size: int) -> jax.Array:
    """q of each draft [B, K, V]: its own, or one-hot for a deterministic proposer."""
    if proposal.draft_probs is not None:
        return proposal.draft_probs.astype(jnp.float32)
    return jax.nn.one_hot(proposal.draft_tokens, vocab_size, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class Hybrid:
    """Per row, `first`'s drafts where it has any this step (e.g. an n-gram match of at least
    n_min tokens), `then`'s otherwise. Both draft chains (no token trees); NGram, Medusa, Eagle,
    Eagle3 and DFlash combine (a DraftModel's own cache would go stale), a head drafting as many
    tokens as the longest part."""

    first: Any
    then: Any

    def spec(self, target, warp=None, mesh=None) -> HybridSpec:
        from specjax.speculate.proposers import resolve  # the package resolves every proposer kind
        from specjax.speculate.proposers.draft import DraftSpec
        from specjax.speculate.proposers.ngram import NGram

        specs = []
        for name, proposer in (("first", self.first), ("then", self.then)):
            spec, _ = resolve(proposer, target, warp, mesh)
            if spec is None:
                raise ValueError(f"Hybrid {name} must be a proposer, got None")
            if getattr(spec, "tree", None) is not None:
                raise ValueError(f"Hybrid {name} drafts a token tree; Hybrid verifies chains only")
            specs.append(spec)
        K = max(spec.k for spec in specs)
        for name, spec in zip(("first", "then"), specs, strict=True):
            if isinstance(spec, DraftSpec):
                raise ValueError(
                    f"Hybrid {name}: a DraftModel or SelfDraft keeps a cache of its own drafts, which "
                    "goes stale when the other part's drafts are accepted; use NGram, Medusa, Eagle, "
                    "Eagle3 or DFlash"
                )
            if not isinstance(spec, NGram) and spec.k != K:
                raise ValueError(
                    f"Hybrid {name} drafts k={spec.k} but the other part k={K}: a part that keeps the "
                    "target's features of accepted tokens (a head) must draft as many as the longest "
                    "part (NGram may draft fewer)"
                )
        reads = [_reads(spec) for spec in specs]
        if all(reads) and reads[0] != reads[1]:
            raise ValueError(
                f"Hybrid: first and then draft from different target features ({reads[0]} and {reads[1]}); "
                "they get one set per step"
            )
        return HybridSpec(*specs)

    def params(self, target):
        from specjax.speculate.proposers.ngram import NGram

        return tuple(None if isinstance(p, NGram) else p.params(target) for p in (self.first, self.then))


def _reads(spec):
    """What a proposer reads of the target's pass: its feature layers, "final hidden states", or
    None (n-gram lookup, a draft model)."""
    from specjax.speculate.proposers.draft import DraftSpec
    from specjax.speculate.proposers.ngram import NGram

    if isinstance(spec, NGram | DraftSpec):
        return None
    return getattr(spec, "feature_layers", None) or "final hidden states"
