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

from specjax.speculate.proposers.base import Proposal, draft_distribution, kept_inputs
from specjax.speculate.proposers.dynamic import GoodputSchedule, ScheduleState
from specjax.speculate.proposers.protocol import (
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
)
from specjax.speculate.verifiers import LOSSLESS

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
class HybridSpec(ProposerSpec):
    first: ProposerSpec
    then: ProposerSpec
    gate: GoodputSchedule | None = None

    @property
    def k(self) -> int:
        return max(self.first.k, self.then.k)

    @property
    def capabilities(self) -> Capabilities:
        first, then = self.first.capabilities, self.then.capabilities
        # With a gate a row may take neither part's drafts; without, it drafts when either does.
        always = first.always_drafts if self.gate is not None else first.always_drafts or then.always_drafts
        return Capabilities.combine(
            {"first": first, "then": then},
            "Hybrid",
            tree=None,  # both are chains, verified as one
            always_drafts=always,
            verify_widths=self._verify_widths,
            widths=None,
            narrows=False,
            catches_up=False,
            accepts=None,
            stateless=False,
        )

    @property
    def _gate_choices(self) -> tuple[int, int]:
        # The second drafts its whole k whenever it drafts (a head's cost hardly depends on how
        # many of its drafts are verified), so the gate weighs all of them or none.
        return (0, self.then.k)

    @property
    def _verify_widths(self) -> tuple[int, ...] | None:
        """Where the parts draft different numbers of tokens, the verify pass widths the loop
        chooses between (the smallest covering every running row's drafts): a step whose rows
        all draft with the shorter part scores only its drafts. A part's own widths (a head with a
        confidence threshold) join its k. None when every step drafts k."""
        widths = {self.first.k, self.then.k}
        for part in (self.first, self.then):
            widths.update(part.capabilities.verify_widths or ())
        return tuple(sorted(widths)) if len(widths) > 1 else None

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        return self.first.state_bytes(batch_size, capacity) + self.then.state_bytes(batch_size, capacity)

    def with_panel_weights(self, params):
        """Each part's params for drafting on the CPU (a trained head's panels), where it has any."""
        return HybridParams(*(_each(spec.with_panel_weights, part) for spec, part in self._parts(params)))

    def place_params(self, params, mesh):
        """Each part's params placed on `mesh` as it asks (a draft model's), else replicated."""
        placed = (
            _each(lambda p, spec=spec: spec.place_params(p, mesh), part) for spec, part in self._parts(params)
        )
        return HybridParams(*placed)

    def stack_layers(self, params):
        """Each part's params with a draft model's layers stacked (see DraftSpec), where it has any."""
        return HybridParams(*(_each(spec.stack_layers, part) for spec, part in self._parts(params)))

    def _parts(self, params: HybridParams):
        return ((self.first, params.first), (self.then, params.then))

    def init(self, ctx: InitContext) -> HybridState:
        B = ctx.prompt_tokens.shape[0]
        gate = None if self.gate is None else self.gate.init(B, self.then.k, self._gate_choices)
        return HybridState(
            first=self.first.init(dataclasses.replace(ctx, params=ctx.params.first)),
            then=self.then.init(dataclasses.replace(ctx, params=ctx.params.then)),
            chosen=jnp.zeros((B,), jnp.int32),
            counts=jnp.zeros((B, 2, len(_COUNTERS)), jnp.int32),
            num_valid=jnp.zeros((B,), jnp.int32),
            held=jnp.zeros((B,), jnp.int32),
            gate=gate,
            running=jnp.ones((B,), bool),
        )

    def propose(self, ctx: ProposeContext, state: HybridState):
        keys = ctx.keys
        then_keys = None if keys is None else jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 1)
        first_ctx = ctx.replace(params=ctx.params.first)
        then_ctx = ctx.replace(params=ctx.params.then, keys=then_keys)
        first, first_state = self.first.propose(first_ctx, state.first)
        first = _padded(first, self.k)
        use_first = first.valid[:, 0]  # the first proposer has a draft for this row

        def draft(then_state):
            then, then_state = self.then.propose(then_ctx, then_state)
            return _padded(then, self.k), then_state

        if self.gate is None:
            then, then_state = draft(state.then)
            held = jnp.zeros_like(use_first)
        else:
            wants = ~use_first & (state.gate.k > 0)  # the gate lets `then` draft for the row

            def observe(then_state):  # no row takes its drafts: keep its state current, cheaply
                shapes = jax.eval_shape(draft, then_state)[0]
                nothing = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
                return nothing, self.then.observe(then_ctx, then_state)

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

    def update(self, ctx: UpdateContext, state: HybridState) -> HybridState:
        running, num_accepted = ctx.running, ctx.num_accepted  # (its counts match the loop's metrics)
        one = jax.nn.one_hot(state.chosen, 2, dtype=jnp.int32) * running[:, None]  # [B, 2]
        drafted = state.num_valid[:, None]
        counts = state.counts.at[:, :, 0].add(one * (drafted > 0))
        counts = counts.at[:, :, 1].add(one * drafted)
        counts = counts.at[:, :, 2].add(one * num_accepted[:, None])

        def own(spec, part_state):  # the target's features at the last token and the accepted drafts
            return spec.update(
                ctx.replace(path_features=ctx.path_features[:, : spec.accepts + 1]), part_state
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


def _each(function, part):
    """function(part), or None for a part without params (NGram's)."""
    return None if part is None else function(part)


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
class Hybrid(Proposer):
    """Per row, `first`'s drafts where it has any this step (e.g. an n-gram match of at least
    n_min tokens), `then`'s otherwise. Both draft chains (no token trees); NGram, Medusa, Eagle,
    Eagle3, DFlash and the MLP speculator combine (a DraftModel's own cache would go stale), and
    ForcedAcceptance and Dynamic go around a Hybrid, not inside it. The parts may draft
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
        for name, part in (("first", self.first), ("then", self.then)):
            if not isinstance(part, Proposer):
                raise ValueError(f"Hybrid {name} must be a specjax proposer, got {part!r}")
        if self.gate is not None and not isinstance(self.gate, GoodputSchedule):
            raise ValueError(
                "Hybrid gate must be None or a specjax.GoodputSchedule with the second proposer's "
                f"costs (GoodputSchedule.measure(model, then, prompts)), got {self.gate!r}"
            )

    @property
    def draft_positions(self) -> int:
        return max(self.first.draft_positions, self.then.draft_positions)

    def with_k(self, k: int) -> Hybrid:
        return Hybrid(self.first.with_k(k), self.then.with_k(k), self.gate)

    def parts(self) -> tuple[Proposer, ...]:
        return (self.first, self.then)

    def spec(self, target, warp=None, mesh=None) -> HybridSpec:
        specs = {"first": self.first.spec(target, warp, mesh), "then": self.then.spec(target, warp, mesh)}
        kinds = {"first": type(self.first).__name__, "then": type(self.then).__name__}
        for name, spec in specs.items():
            caps, kind = spec.capabilities, kinds[name]
            if caps.tree is not None:
                raise ValueError(f"Hybrid {name} drafts a token tree; Hybrid verifies chains only")
            if caps.caches_own_drafts:
                raise ValueError(
                    f"Hybrid {name}: a DraftModel or SelfDraft keeps a cache of its own drafts ({kind}), "
                    "which goes stale when the other part's drafts are accepted; use NGram, Medusa, "
                    "Eagle, Eagle3 or DFlash"
                )
            if caps.widths is not None:
                raise ValueError(
                    f"Hybrid {name} is a Dynamic proposer ({kind}): Dynamic chooses the draft width "
                    "of each step for the whole batch, which a Hybrid's per-row choice of part does "
                    "not follow; put Dynamic around the Hybrid instead: Dynamic(Hybrid(first, then))"
                )
            if caps.verifier is not LOSSLESS:
                raise ValueError(
                    f"Hybrid {name} has a verifier of its own ({kind}: ForcedAcceptance forces every "
                    "row of a step); put it around the Hybrid instead: ForcedAcceptance(rate, Hybrid(...))"
                )
        reads = [spec.capabilities.target_features for spec in specs.values()]
        if None not in reads and reads[0] != reads[1]:
            raise ValueError(
                f"Hybrid: first and then draft from different target features ({reads[0]} and "
                f"{reads[1]}); they get one set per step"
            )
        K = max(spec.k for spec in specs.values())
        for name, spec in specs.items():
            # A part drafting fewer than K takes in the target's features of every accepted token
            # (a head's state): it must catch up on as many a step as the longer part may get
            # accepted.
            if spec.k < K:
                caps = spec.capabilities
                if not (caps.catches_up or caps.stateless):
                    raise ValueError(
                        f"Hybrid {name} drafts k={spec.k} but the other part k={K}, and "
                        f"{type(spec).__name__} cannot catch up on more drafts than its own k: give "
                        "both parts the same k"
                    )
                specs[name] = spec.accepting(K)
        spec = HybridSpec(specs["first"], specs["then"], gate=self.gate)
        spec.capabilities  # noqa: B018 - refuses, naming the field, parts whose records do not combine
        return spec

    def params(self, target):
        def build(target):
            return HybridParams(self.first.params(target), self.then.params(target))

        return kept_inputs(self, target, build)  # one object per model: its CPU panel copy is kept
