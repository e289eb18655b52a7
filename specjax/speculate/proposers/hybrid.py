"""Hybrid drafting (FastDeploy's n-gram + MTP): per row, the first proposer's drafts where it has
any this step, the second's otherwise, inside the one compiled loop.

Typical use: `Hybrid(NGram(k=4, n_min=3), Eagle3(head, k=1))`: prompt lookup where the text copies
(code edits, summaries, retrieval), a trained head elsewhere. The parts may draft different
numbers of tokens; a step verifies only as many as its rows drafted (`verify_widths`). Both
proposers draft every step and both see every verdict, so each keeps its own state current (a
head's pending features, a draft model's cache); a row then verifies one of the two proposals as
a chain. Lossless as every proposer is: a row's drafts are exactly one proposer's, with that
proposer's q (one-hot for a deterministic one).

A gate (`Hybrid(first, then, gate=GoodputSchedule(...))`) makes the fallback pay for itself:
where the first has no draft, a row takes the second's drafts only while its measured acceptance
there (the schedule's decayed estimate, from that row's steps drafted by the second) gives more
tokens per unit of time than a plain step, with the second's whole k; otherwise the row makes a
plain step. The second drafts only on steps where some running row takes its drafts (a
batch-wide `lax.cond`); on the others it only `observe`s (a head writes its pending pairs' keys
and values, so its cache stays whole), which costs a fraction of drafting. A row held back drafts
with the second again every `probe_every` steps, to notice when it starts to pay. This is what
keeps a hybrid at least as fast as its better part where the second one's drafting does not pay
(a head on text unlike what it trained on, or on a CPU where its step costs twice a plain one).

The state counts, per row and per proposer, the steps whose drafts came from it, the drafts it
contributed and those accepted, and the steps a gate held the second back:
`SpecMetrics.proposer` reports them apart ("first_*", "then_*" and "then_held_back").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.sharding import replicate
from specjax.speculate.proposers.base import Proposal, draft_distribution, init_state, kept_inputs
from specjax.speculate.proposers.dynamic import GoodputSchedule, ScheduleState

_COUNTERS = ("steps", "drafted", "accepted")


@flax.struct.dataclass
class HybridState:
    first: Any
    then: Any
    chosen: jax.Array  # [B] int32: whose drafts the row verifies this step (0 first, 1 then, 2 neither)
    counts: jax.Array  # [B, 2, 3] int32: per proposer, steps drafted from, drafts, accepted
    num_valid: jax.Array  # [B] int32: drafts the row verifies this step
    held: jax.Array  # [B] int32: steps the gate held `then` back (no draft from either)
    gate: ScheduleState | None  # the gate's estimate of `then` per row (k: 0 held back, or K)
    running: jax.Array  # [B] bool: the rows running at the last step (the gate drafts for these)


@flax.struct.dataclass
class HybridParams:
    first: Any  # each part's params (None for NGram)
    then: Any


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    first: Any
    then: Any
    gate: GoodputSchedule | None = None
    tree = None  # both are chains, verified as one

    @property
    def k(self) -> int:
        return max(self.first.k, self.then.k)

    @property
    def always_drafts(self) -> bool:
        if self.gate is not None:  # a row may take neither part's drafts
            return self.first.always_drafts
        return self.first.always_drafts or self.then.always_drafts

    @property
    def _gate_choices(self) -> tuple[int, int]:
        # The second drafts its whole k whenever it drafts (a head's cost hardly depends on how
        # many of its drafts are verified), so the gate weighs all of them or none.
        return (0, self.then.k)

    @property
    def verify_widths(self) -> tuple[int, ...] | None:
        """Where the parts draft different numbers of tokens, the verify pass widths the loop
        chooses between (the smallest covering every running row's drafts): a step whose rows
        all draft with the shorter part scores only its drafts. A part's own widths (a head with a
        confidence threshold) join its k. None when every step drafts k."""
        widths = {self.first.k, self.then.k}
        for part in (self.first, self.then):
            widths.update(getattr(part, "verify_widths", None) or ())
        return tuple(sorted(widths)) if len(widths) > 1 else None

    @property
    def feature_layers(self):
        return getattr(self.first, "feature_layers", None) or getattr(self.then, "feature_layers", None)

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return self.first.state_bytes(batch_size, capacity) + self.then.state_bytes(batch_size, capacity)

    def with_panel_weights(self, params):
        """Each part's params for drafting on the CPU (a trained head's panels), where it has any."""

        def packed(spec, part):
            packing = getattr(spec, "with_panel_weights", None)
            return part if packing is None or part is None else packing(part)

        return HybridParams(packed(self.first, params.first), packed(self.then, params.then))

    def place_params(self, params, mesh):
        """Each part's params placed on `mesh` as it asks (a draft model's), else replicated."""

        def placed(spec, part):
            placing = getattr(spec, "place_params", None)
            if part is None:
                return None
            return replicate(part, mesh) if placing is None else placing(part, mesh)

        return HybridParams(placed(self.first, params.first), placed(self.then, params.then))

    def stack_layers(self, params):
        """Each part's params with a draft model's layers stacked (see DraftSpec), where it has any."""

        def stacked(spec, part):
            stacking = getattr(spec, "stack_layers", None)
            return part if stacking is None or part is None else stacking(part)

        return HybridParams(stacked(self.first, params.first), stacked(self.then, params.then))

    @property
    def reads_target_cache(self) -> bool:
        return any(getattr(part, "reads_target_cache", False) for part in (self.first, self.then))

    def init(
        self, target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden, target_cache=None
    ):
        B = prompt_tokens.shape[0]
        args = (prompt_tokens, prompt_lengths, capacity, target_hidden, target_cache)
        gate = None if self.gate is None else self.gate.init(B, self.then.k, self._gate_choices)
        return HybridState(
            first=init_state(self.first, target_params, params.first, *args),
            then=init_state(self.then, target_params, params.then, *args),
            chosen=jnp.zeros((B,), jnp.int32),
            counts=jnp.zeros((B, 2, len(_COUNTERS)), jnp.int32),
            num_valid=jnp.zeros((B,), jnp.int32),
            held=jnp.zeros((B,), jnp.int32),
            gate=gate,
            running=jnp.ones((B,), bool),
        )

    def propose(self, target_params, params, state: HybridState, tokens, lengths, keys, sampling, history):
        then_keys = None if keys is None else jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 1)
        common = (tokens, lengths)
        first, first_state = self.first.propose(
            target_params, params.first, state.first, *common, keys, sampling, history
        )
        first = _padded(first, self.k)
        use_first = first.valid[:, 0]  # the first proposer has a draft for this row

        def draft(then_state):
            then, then_state = self.then.propose(
                target_params, params.then, then_state, *common, then_keys, sampling, history
            )
            return _padded(then, self.k), then_state

        if self.gate is None:
            then, then_state = draft(state.then)
            held = jnp.zeros_like(use_first)
        else:
            wants = ~use_first & (state.gate.k > 0)  # the gate lets `then` draft for the row

            def observe(then_state):  # no row takes its drafts: keep its state current, cheaply
                shapes = jax.eval_shape(draft, then_state)[0]
                nothing = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
                return nothing, self.then.observe(target_params, params.then, then_state, *common)

            then, then_state = jax.lax.cond(jnp.any(wants & state.running), draft, observe, state.then)
            then = then.replace(valid=then.valid & wants[:, None])
            held = ~use_first & ~wants
        pick = use_first[:, None]
        draft_tokens = jnp.where(pick, first.draft_tokens, then.draft_tokens)
        valid = jnp.where(pick, first.valid, then.valid)
        probs = None
        if first.draft_probs is not None or then.draft_probs is not None:
            V = (first.draft_probs if first.draft_probs is not None else then.draft_probs).shape[-1]
            p1, p2 = (draft_distribution(p, V) for p in (first, then))
            probs = jnp.where(pick[..., None], p1, p2)
        chosen = jnp.where(use_first, 0, jnp.where(held, 2, 1)).astype(jnp.int32)
        new_state = state.replace(
            first=first_state,
            then=then_state,
            chosen=chosen,
            num_valid=jnp.sum(valid, axis=1),
        )
        return Proposal(draft_tokens=draft_tokens, valid=valid, draft_probs=probs), new_state

    # The loop hands `update` the rows still running, so that the counts match its own metrics.
    counts_running_rows = True

    def update(self, state: HybridState, path_hidden, num_accepted, running) -> HybridState:
        one = jax.nn.one_hot(state.chosen, 2, dtype=jnp.int32) * running[:, None]  # [B, 2]
        drafted = state.num_valid[:, None]
        counts = state.counts.at[:, :, 0].add(one * (drafted > 0))
        counts = counts.at[:, :, 1].add(one * drafted)
        counts = counts.at[:, :, 2].add(one * num_accepted[:, None])

        def own(spec, part_state):  # the target's features at the last token and the accepted drafts
            return spec.update(
                part_state, path_hidden[:, : getattr(spec, "accepts", self.k) + 1], num_accepted
            )

        gate = state.gate
        if gate is not None:  # the evidence of the row's steps drafted by `then`
            by_then = (state.chosen == 1) & running
            moved = self.gate.update(
                gate,
                jnp.where(by_then, num_accepted, 0),
                jnp.where(by_then, state.num_valid, 0),
                self.then.k,
                self._gate_choices,
            )
            gate = jax.tree.map(lambda new, old: jnp.where(running, new, old), moved, gate)
        return state.replace(
            first=own(self.first, state.first),
            then=own(self.then, state.then),
            counts=counts,
            held=state.held + ((state.chosen == 2) & running).astype(jnp.int32),
            gate=gate,
            running=running,
        )

    def counters(self, state: HybridState) -> dict[str, jax.Array]:
        """Per-row counts reported apart in SpecMetrics.proposer: first_steps, then_accepted, ..."""
        counts = {
            f"{who}_{name}": state.counts[:, i, j]
            for i, who in enumerate(("first", "then"))
            for j, name in enumerate(_COUNTERS)
        }
        return counts | {"then_held_back": state.held}


def _padded(proposal: Proposal, K: int) -> Proposal:
    """A proposal of k <= K drafts as K (the extra positions invalid)."""
    extra = K - proposal.draft_tokens.shape[1]
    if not extra:
        return proposal

    def pad(x, value):
        return jnp.concatenate([x, jnp.full((x.shape[0], extra) + x.shape[2:], value, x.dtype)], axis=1)

    probs = None if proposal.draft_probs is None else pad(proposal.draft_probs, 0.0)
    return Proposal(pad(proposal.draft_tokens, 0), pad(proposal.valid, False), probs)


@dataclasses.dataclass(frozen=True, eq=False)
class Hybrid:
    """Per row, `first`'s drafts where it has any this step (e.g. an n-gram match of at least
    n_min tokens), `then`'s otherwise. Both draft chains (no token trees); NGram, Medusa, Eagle,
    Eagle3 and DFlash combine (a DraftModel's own cache would go stale). The parts may draft
    different numbers of tokens, e.g. `Hybrid(NGram(k=8, n_min=3), Eagle3(head, k=1))`: long drafts
    where the text copies, one cheap guess elsewhere; a step then verifies only as many tokens as
    its rows drafted (the loop chooses among the parts' widths), and a head catches up on however
    many of the other part's drafts were accepted.

    gate: None (`then` drafts wherever `first` has nothing), or a GoodputSchedule with `then`'s
    costs (`GoodputSchedule.measure(model, then, prompts)`): a row takes `then`'s drafts only
    while their measured acceptance pays for drafting and verifying them, else makes a plain step
    (module doc).
    """

    first: Any
    then: Any
    gate: GoodputSchedule | None = None

    def __post_init__(self):
        if self.gate is not None and not isinstance(self.gate, GoodputSchedule):
            raise ValueError(
                "Hybrid gate must be None or a specjax.GoodputSchedule with the second proposer's "
                f"costs (GoodputSchedule.measure(model, then, prompts)), got {self.gate!r}"
            )

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
        for i, (name, spec) in enumerate(zip(("first", "then"), specs, strict=True)):
            if spec.k < K and not isinstance(spec, NGram):
                # A head keeps the target's features of every accepted token: it must take in as
                # many a step as the longer part may get accepted.
                accepting = getattr(spec, "accepting", None)
                if not callable(accepting):
                    raise ValueError(
                        f"Hybrid {name} drafts k={spec.k} but the other part k={K}, and "
                        f"{type(spec).__name__} cannot catch up on more drafts than its own k: give "
                        "both parts the same k"
                    )
                specs[i] = accepting(K)
        reads = [_reads(spec) for spec in specs]
        if all(reads) and reads[0] != reads[1]:
            raise ValueError(
                f"Hybrid: first and then draft from different target features ({reads[0]} and {reads[1]}); "
                "they get one set per step"
            )
        if self.gate is not None and not callable(getattr(specs[1], "observe", None)):
            raise ValueError(
                f"Hybrid with a gate: then ({type(self.then).__name__}) must have an observe() method "
                "that keeps its state current on the steps it does not draft (NGram, Medusa, Eagle, "
                "Eagle3 and DFlash have one)"
            )
        return HybridSpec(*specs, gate=self.gate)

    def params(self, target):
        from specjax.speculate.proposers.ngram import NGram

        def build(target):
            first, then = (
                None if isinstance(p, NGram) else p.params(target) for p in (self.first, self.then)
            )
            return HybridParams(first, then)

        return kept_inputs(self, target, build)  # one object per model: its CPU panel copy is kept


def _reads(spec):
    """What a proposer reads of the target's pass: its feature layers, "final hidden states", or
    None (n-gram lookup, a draft model)."""
    from specjax.speculate.proposers.draft import DraftSpec
    from specjax.speculate.proposers.ngram import NGram

    if isinstance(spec, NGram | DraftSpec):
        return None
    return getattr(spec, "feature_layers", None) or "final hidden states"
