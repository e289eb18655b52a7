"""Dynamic speculation length per row, with no recompilation.

`Dynamic(proposer, schedule)` keeps one k per row in the proposer state, between 0 and the
proposer's k (K_max, static). Each step the wrapped proposer drafts and each row's drafts past its
own k are masked out, so verification stays lossless whatever the schedule picks (masking only
drops drafts). A row at k = 0 has speculation off: it gains the target's one token per step.

Cost follows the batch's largest k, not K_max: for a chain proposer whose state does not depend on
k (NGram, DraftModel, SelfDraft) the loop chooses, by a batch-wide `lax.switch`, among programs
that draft and verify 0, 1, 2, 4, ... K_max tokens (`widths`), the smallest that covers every
running row's k. All of them are compiled into the one program. Other proposers (EAGLE, trees)
draft K_max and are masked.

Schedules (a schedule is a frozen config with `init(B, K)` and `update(state, num_accepted,
num_drafted, K)` over a `ScheduleState`):

- `HeuristicSchedule`: HF transformers' "heuristic" schedule for assisted generation: +2 after a
  step whose drafts were all accepted, -1 otherwise, within 1..K_max.
- `GoodputSchedule`: picks the k that maximises expected tokens per unit of time,
  E(k) / cost(k), from each row's running conditional acceptance alpha (exponentially decayed
  counts of accepted and reached drafts, started from a prior) and the measured costs of a draft
  token and of a verified token relative to one plain decoding step. With i.i.d. acceptance alpha,
  E(k) = 1 + alpha + ... + alpha^k and cost(k) = 1 + (draft_cost + verify_cost) * k. Since a
  step's cost follows the batch's largest k, the k is chosen for the batch by default: the one
  width w with the most tokens per unit of time over the rows running, sum_r E_r(w) / cost(w),
  where E_r(w) = 1 + rho_r (alpha_r + ... + alpha_r^w) and rho_r is how often the row drafted when
  it was let (an n-gram miss drafts nothing but the batch still verifies the width); one row
  accepting well then no longer makes eight rows verify k + 1 tokens each. `per_row=True` keeps
  each row's own best k instead. When speculation is off, the batch drafts one token every
  `probe_every` steps (more rarely as the batch's verify cost grows, so that probes cost the batch
  the share of time they cost one row), so it notices when drafts start to pay again.
  `GoodputSchedule.measure(model, proposer, prompts)` measures the two costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int, is_number
from specjax.speculate.proposers.base import Proposal
from specjax.speculate.proposers.protocol import (
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
    Wrapper,
)


@flax.struct.dataclass
class ScheduleState:
    k: jax.Array  # [B] int32: drafts each row may use next step
    accepted: jax.Array  # [B] float32: decayed count of accepted drafts
    reached: jax.Array  # [B] float32: decayed count of drafts verified (reached)
    idle: jax.Array  # [B] int32: steps since the row last drafted
    # [B] float32: decayed counts of the steps the row was let draft (k > 0) and of those it did
    # (GoodputSchedule's rho; an n-gram lookup may find nothing to draft)
    offered: jax.Array
    hits: jax.Array


def _check_initial_k(owner: str, initial_k, minimum: int) -> None:
    if initial_k is not None and (not is_int(initial_k) or initial_k < minimum):
        raise ValueError(
            f"{owner} initial_k must be None (the proposer's k) or an integer >= {minimum}, got {initial_k!r}"
        )


def _start(initial_k, B: int, K: int) -> ScheduleState:
    k = K if initial_k is None else min(initial_k, K)
    zeros = jnp.zeros((B,), jnp.float32)
    idle = jnp.zeros((B,), jnp.int32)
    return ScheduleState(
        k=jnp.full((B,), k, jnp.int32), accepted=zeros, reached=zeros, idle=idle, offered=zeros, hits=zeros
    )


@dataclasses.dataclass(frozen=True)
class HeuristicSchedule:
    """HF's heuristic: k + 2 after a step whose drafts were all accepted, k - 1 otherwise, within
    1..K_max. A step in which the row drafted nothing (an n-gram miss) leaves k as it is."""

    initial_k: int | None = None  # None: start at K_max

    def __post_init__(self):
        _check_initial_k("HeuristicSchedule", self.initial_k, 1)

    def init(self, B: int, K: int) -> ScheduleState:
        return _start(self.initial_k, B, K)

    def update(self, state: ScheduleState, num_accepted, num_drafted, K: int, running=None) -> ScheduleState:
        """The state after a step (each row on its own: `running` is not read)."""
        all_accepted = num_accepted >= num_drafted
        k = jnp.clip(jnp.where(all_accepted, state.k + 2, state.k - 1), 1, K)
        return state.replace(k=jnp.where(num_drafted > 0, k, state.k))

    def join(self, batch: ScheduleState, row: ScheduleState, running: jax.Array) -> ScheduleState:
        """A row joining a running batch keeps its own state: each row's k is its own."""
        return row


@dataclasses.dataclass(frozen=True)
class GoodputSchedule:
    """The k in 0..K_max with the most expected tokens per unit of time: one for the batch, or
    with `per_row` one per row (module doc).

    draft_cost: time of drafting one token, in plain decoding steps (NGram ~0, a small draft
      model or early exit more); verify_cost: extra time of scoring one more token in the
      target's pass, in plain decoding steps. `GoodputSchedule.measure` gives both.
    decay: weight of the past per drafting step in the acceptance estimate (0.9: about the last
      10 drafting steps).
    prior, prior_weight: the estimate before any evidence: `prior_weight` drafts at rate `prior`.
    probe_every: a row at k = 0 drafts one token after this many steps without drafts.
    """

    draft_cost: float = 0.0
    verify_cost: float = 0.1
    decay: float = 0.9
    prior: float = 0.5
    prior_weight: float = 2.0
    probe_every: int = 16
    initial_k: int | None = None
    # False: one k for the rows running (they share the step's cost); True: each row's best k as
    # if it ran alone (what Hybrid's gate uses: its cost is per row).
    per_row: bool = False
    # verify_cost by the number of rows running in the step, ((rows, cost), ...) by increasing
    # rows (other counts interpolate; past the ends, the nearest): a verified token costs more of
    # a step as the batch grows and the step stops being bound by reading the weights, so a
    # continuous batch under load should draft less. None: verify_cost whatever the batch.
    verify_cost_by_rows: tuple[tuple[int, float], ...] | None = None

    def __post_init__(self):
        def check(name, low, high, closed_high=True):
            value = getattr(self, name)
            ok = is_number(value) and math.isfinite(value)
            ok = ok and low <= value and (value <= high if closed_high else value < high)
            if not ok:
                bracket = "]" if closed_high else ")"
                raise ValueError(f"GoodputSchedule {name} must be in [{low}, {high}{bracket}, got {value!r}")

        check("draft_cost", 0.0, math.inf)
        check("verify_cost", 0.0, math.inf)
        check("decay", 0.0, 1.0, closed_high=False)
        check("prior", 0.0, 1.0)
        if not (isinstance(self.prior_weight, int | float) and self.prior_weight > 0):
            raise ValueError(f"GoodputSchedule prior_weight must be a number > 0, got {self.prior_weight!r}")
        _check_initial_k("GoodputSchedule", self.initial_k, 0)
        if not isinstance(self.per_row, bool):
            raise ValueError(f"GoodputSchedule per_row must be True or False, got {self.per_row!r}")
        if not is_int(self.probe_every) or self.probe_every < 1:
            raise ValueError(f"GoodputSchedule probe_every must be an integer >= 1, got {self.probe_every!r}")
        table = self.verify_cost_by_rows
        if table is not None:
            pairs = tuple(table) if isinstance(table, tuple | list) else ()
            ok = len(pairs) > 0 and all(
                isinstance(p, tuple | list)
                and len(p) == 2
                and is_int(p[0])
                and p[0] >= 1
                and is_number(p[1])
                and math.isfinite(p[1])
                and p[1] >= 0
                for p in pairs
            )
            if not ok or any(a[0] >= b[0] for a, b in zip(pairs, pairs[1:], strict=False)):
                raise ValueError(
                    "GoodputSchedule verify_cost_by_rows must be None or ((rows, cost), ...) with rows "
                    f"increasing integers >= 1 and costs finite numbers >= 0, got {table!r}"
                )
            object.__setattr__(self, "verify_cost_by_rows", tuple((int(r), float(c)) for r, c in pairs))

    def init(self, B: int, K: int, choices: tuple[int, ...] | None = None) -> ScheduleState:
        """The state before any step: k is initial_k (with `choices`, the smallest choice at or
        above it), or the best of `choices` (default 0..K) for the prior."""
        state = _start(self.initial_k, B, K)
        if self.initial_k is None:  # the best k for the prior
            state = state.replace(k=self.best_k(self.alpha(state), K, choices))
        elif choices is not None:
            k = min(c for c in choices if c >= min(self.initial_k, K))
            state = state.replace(k=jnp.full((B,), k, jnp.int32))
        return state

    def alpha(self, state: ScheduleState) -> jax.Array:
        """[B] the running conditional acceptance estimate."""
        w = self.prior_weight
        return (state.accepted + self.prior * w) / (state.reached + w)

    def draft_rate(self, state: ScheduleState) -> jax.Array:
        """[B] rho: how often the row drafted when let (from a prior of always, weight prior_weight)."""
        w = self.prior_weight
        return (state.hits + w) / (state.offered + w)

    def verify_cost_at(self, running: jax.Array | None):
        """The verify cost of a step with these rows running ([B] bool; None: verify_cost)."""
        if self.verify_cost_by_rows is None or running is None:
            return self.verify_cost
        rows, costs = zip(*self.verify_cost_by_rows, strict=True)
        count = jnp.sum(running).astype(jnp.float32)
        return jnp.interp(count, jnp.asarray(rows, jnp.float32), jnp.asarray(costs, jnp.float32))

    def best_k(
        self, alpha: jax.Array, K: int, choices: tuple[int, ...] | None = None, verify_cost=None
    ) -> jax.Array:
        """[B] argmax over k in `choices` (default 0..K) of E(k) / cost(k) (at `verify_cost`,
        default the schedule's own)."""
        verify_cost = self.verify_cost if verify_cost is None else verify_cost
        all_k = jnp.arange(K + 1, dtype=jnp.float32)
        expected = jnp.cumsum(alpha[:, None] ** all_k[None, :], axis=1)  # [B, K+1]: 1 + a + ... + a^k
        cost = 1.0 + (self.draft_cost + verify_cost) * all_k
        goodput = expected / cost[None, :]
        if choices is None:
            return jnp.argmax(goodput, axis=1).astype(jnp.int32)
        options = jnp.asarray(sorted(choices), jnp.int32)
        return options[jnp.argmax(goodput[:, options], axis=1)]

    def batch_k(
        self,
        alpha: jax.Array,
        rate: jax.Array,
        running: jax.Array,
        K: int,
        choices: tuple[int, ...] | None = None,
        verify_cost=None,
    ) -> jax.Array:
        """[] the width w in `choices` (default 0..K) maximising sum_r E_r(w) / cost(w) over the
        running rows ([B] bool), E_r(w) = 1 + rate_r (alpha_r + ... + alpha_r^w) (alpha, rate
        [B]), cost(w) = 1 + (draft_cost + verify_cost) * w (verify_cost default the schedule's)."""
        verify_cost = self.verify_cost if verify_cost is None else verify_cost
        options = np.arange(K + 1) if choices is None else np.asarray(sorted(choices))
        all_k = jnp.arange(K + 1, dtype=jnp.float32)
        drafts = jnp.cumsum(alpha[:, None] ** all_k[None, :], axis=1) - 1.0  # [B, K+1]: a + ... + a^k
        expected = jnp.where(running[:, None], 1.0 + rate[:, None] * drafts, 0.0)
        cost = 1.0 + (self.draft_cost + verify_cost) * all_k
        goodput = jnp.sum(expected, axis=0) / cost  # [K+1]
        return jnp.asarray(options, jnp.int32)[jnp.argmax(goodput[options])]

    def update(
        self,
        state: ScheduleState,
        num_accepted,
        num_drafted,
        K: int,
        choices: tuple[int, ...] | None = None,
        running: jax.Array | None = None,
    ) -> ScheduleState:
        """The state after a step: the acceptance estimate moved by the step's evidence, and k the
        best of `choices` (default 0..K; a probe takes the smallest k above 0), at the verify cost
        of a step with `running` rows ([B] bool; for verify_cost_by_rows, and for the batch's one
        k: without it, or with `per_row`, each row gets its own)."""
        drafted = num_drafted > 0
        reached = jnp.minimum(num_accepted + 1, num_drafted)
        offered = state.k > 0 if running is None else (state.k > 0) & running
        # The estimates move only with evidence: a step without drafts leaves alpha as it was, and
        # rho moves only where the row was let draft.
        state = state.replace(
            accepted=jnp.where(drafted, self.decay * state.accepted + num_accepted, state.accepted),
            reached=jnp.where(drafted, self.decay * state.reached + reached, state.reached),
            idle=jnp.where(drafted, 0, state.idle + 1),
            offered=jnp.where(offered, self.decay * state.offered + 1.0, state.offered),
            hits=jnp.where(offered, self.decay * state.hits + drafted, state.hits),
        )
        verify_cost = self.verify_cost_at(running)
        smallest = 1 if choices is None else min(c for c in choices if c > 0)
        if self.per_row or running is None:
            k = self.best_k(self.alpha(state), K, choices, verify_cost)
            probe = (k == 0) & (state.idle + 1 >= self.probe_every)
            return state.replace(k=jnp.where(probe, smallest, k))
        k = self.batch_k(self.alpha(state), self.draft_rate(state), running, K, choices, verify_cost)
        # A probe drafts for the whole batch, so it comes rarer as a verified token costs the batch
        # more than it costs one row: probes then take the same share of the batch's time.
        alone = self.draft_cost + self.verify_cost_at(jnp.arange(2) < 1)
        share = (self.draft_cost + verify_cost) / jnp.maximum(alone, 1e-6)
        every = self.probe_every * jnp.maximum(1.0, jnp.where(alone > 0, share, 1.0))
        idle = jnp.min(jnp.where(running, state.idle, jnp.iinfo(jnp.int32).max))  # since the batch drafted
        probe = (k == 0) & (idle >= every - 1)
        return state.replace(k=jnp.full_like(state.k, jnp.where(probe, smallest, k)))

    def join(self, batch: ScheduleState, row: ScheduleState, running: jax.Array) -> ScheduleState:
        """The state of a row (a batch of one) joining a running batch (`running` [B] bool): with
        one k for the batch, it takes the batch's k and steps since the batch drafted, so that
        an arrival does not make every row draft at the prior's k (what a row alone starts at)
        nor put off the batch's next probe; its own acceptance estimate (the prior) enters the
        batch's choice at the next step. With `per_row`, or into an empty batch, it keeps its own."""
        if self.per_row:
            return row
        joins = jnp.any(running)
        k = jnp.max(jnp.where(running, batch.k, 0))
        idle = jnp.min(jnp.where(running, batch.idle, jnp.iinfo(jnp.int32).max))
        return row.replace(k=jnp.where(joins, k, row.k), idle=jnp.where(joins, idle, row.idle))

    @classmethod
    def measure(
        cls,
        model,
        proposer,
        prompts,
        max_new_tokens: int = 64,
        batch_sizes=None,
        generate_options: dict | None = None,
        **options,
    ) -> GoodputSchedule:
        """A GoodputSchedule with draft_cost and verify_cost timed on this machine by
        `specjax.measure_step_costs` (specjax/costs.py) over `prompts` as one batch; with
        `batch_sizes` (e.g. (1, 4, 8, 16), for a continuous batch), verify_cost_by_rows timed at
        each size too (the prompts repeated to fill it), verify_cost and draft_cost at the
        first. `generate_options` (e.g. {"kernels": "xla"}) go to the timed generate calls;
        `options` are the schedule's other fields."""
        if _cost_meter is None:
            raise RuntimeError(
                "GoodputSchedule.measure times generate calls, a host-side tool that this layer does "
                "not import: import specjax (specjax/costs.py installs it), or build the schedule "
                "from numbers, GoodputSchedule(draft_cost=..., verify_cost=...)"
            )
        timing = dict(max_new_tokens=max_new_tokens, **(generate_options or {}))
        if batch_sizes is None:
            costs = _cost_meter(model, proposer, prompts, **timing)
            return cls(draft_cost=costs["draft_cost"], verify_cost=costs["verify_cost"], **options)
        sizes = sorted(set(batch_sizes)) if isinstance(batch_sizes, tuple | list) else []
        if not sizes or not all(is_int(b) and b >= 1 for b in sizes):
            raise ValueError(f"batch_sizes must be None or a list of integers >= 1, got {batch_sizes!r}")
        by_size = {}
        for b in sizes:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            by_size[b] = _cost_meter(model, proposer, batch, **timing)
        first = by_size[sizes[0]]
        return cls(
            draft_cost=first["draft_cost"],
            verify_cost=first["verify_cost"],
            verify_cost_by_rows=tuple((b, by_size[b]["verify_cost"]) for b in sizes),
            **options,
        )


# What GoodputSchedule.measure times costs with. Timing runs `generate`, above this layer, so the
# host side installs its function here (specjax/costs.py, loaded by `import specjax`) and this
# layer only ever sees the numbers.
_cost_meter: Callable[..., dict] | None = None


def set_cost_meter(measure_step_costs: Callable[..., dict]) -> None:
    """Install the function `GoodputSchedule.measure` times costs with:
    `measure_step_costs(model, proposer, prompts, max_new_tokens=...) -> {"draft_cost",
    "verify_cost", ...}`, costs in plain decoding steps (specjax/costs.py calls this)."""
    global _cost_meter
    _cost_meter = measure_step_costs


SCHEDULES = (HeuristicSchedule, GoodputSchedule)


@flax.struct.dataclass
class DynamicState:
    inner: Any  # the wrapped proposer's state
    schedule: ScheduleState
    num_drafted: jax.Array  # [B] int32: valid draft positions of the step in flight


@dataclasses.dataclass(frozen=True)
class DynamicSpec(Wrapper):
    """The static part of a Dynamic proposer: the inner spec, its schedule, and which of the
    continuous batch's programs this is. Its state wraps the inner spec's (DynamicState)."""

    inner: ProposerSpec
    schedule: Any
    # The continuous batch's chunks (`chunk_programs`): "whole" runs every step (generate's loop);
    # "quiet" only steps in which no row may draft, as one-token passes; "drafting" ends its chunk
    # as soon as no row may draft, for a quiet one to run the steps that follow.
    program: str = "whole"

    @property
    def capabilities(self) -> Capabilities:
        # A row at k = 0 drafts nothing; the loop drafts and verifies only the batch's widest k
        # where the inner spec can draft fewer over its state (`widths`), else masks.
        return Capabilities.combine(
            {"proposer": self.inner.capabilities},
            "Dynamic",
            always_drafts=False,
            widths=self._widths,
            narrows=False,
            stateless=False,
        )

    @property
    def _widths(self) -> tuple[int, ...] | None:
        """Draft widths the loop switches between (0, 1, 2, 4, ..., K), or None: always K."""
        if not self.inner.capabilities.narrows:
            return None
        if self.program == "quiet":
            return (0,)
        return tuple(sorted({0, self.k} | {1 << i for i in range(self.k.bit_length()) if 1 << i < self.k}))

    def chunk_programs(self) -> tuple[DynamicSpec, DynamicSpec] | None:
        """(drafting, quiet): the specs of a continuous batch's two programs, one for the chunks
        in which a row may draft and one for those in which none may (a batch under load whose
        schedule turned drafting off): the quiet program's steps are plain decoding's one-token
        passes, without the switch over draft widths that costs a step at k = 0 1-4% more
        (docs/serving.md). None where the loop cannot skip drafting (a proposer without `widths`
        drafts K every step and masks)."""
        if self._widths is None:
            return None
        return dataclasses.replace(self, program="drafting"), dataclasses.replace(self, program="quiet")

    def may_draft(self, state: DynamicState, running: jax.Array) -> jax.Array:
        """[] whether a running row may draft at the next step (its k is above 0: a probe, or
        drafting that pays): which of `chunk_programs` runs, and where its chunk ends."""
        return self.needed_width(state, running) > 0

    def ends_chunk(self, state: DynamicState, running: jax.Array) -> jax.Array | None:
        """[] whether the loop's chunk ends before the next step (`chunk_programs`)."""
        if self.program == "whole":
            return None
        drafts = self.may_draft(state, running)
        return drafts if self.program == "quiet" else ~drafts

    def init(self, ctx: InitContext) -> DynamicState:
        B = ctx.prompt_tokens.shape[0]
        return DynamicState(self.inner.init(ctx), self.schedule.init(B, self.k), jnp.zeros((B,), jnp.int32))

    def needed_width(self, state: DynamicState, running: jax.Array) -> jax.Array:
        """[] the largest k of a running row."""
        return jnp.max(jnp.where(running, state.schedule.k, 0))

    def propose(self, ctx: ProposeContext, state: DynamicState):
        """The inner proposal with each row's drafts past its k masked out; at `ctx.width` (from
        `widths`) the inner proposer drafts only that many, padded back to K."""
        inner, width = self.inner, ctx.width
        if width is not None:  # width 0 runs the proposer at k=1 so that a draft model catches up
            inner = inner.narrowed(max(width, 1))
        inner_ctx = ctx.replace(width=None)

        def propose():
            return inner.propose(inner_ctx, state.inner)

        if width == 0 and inner.capabilities.stateless:
            # No running row may draft, and a proposer without state has nothing to catch up on:
            # skip its lookup (NGram's searches every row's whole history), so that the step costs
            # what plain decoding's does. An empty proposal of the shapes it would have made.
            shapes, _ = jax.eval_shape(propose)
            proposal = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            inner_state = state.inner
        else:
            proposal, inner_state = propose()
        tree = self.capabilities.tree
        # A chain's drafts are positions 1..k, a tree's its nodes (`widths` are chains' alone)
        full = self.k if tree is None else tree.num_nodes
        proposal = _pad(proposal, full, keep=full if width is None else width)
        depth = np.arange(1, self.k + 1) if tree is None else tree.depths[1:]
        valid = proposal.valid & (jnp.asarray(depth)[None, :] <= state.schedule.k[:, None])
        num_drafted = jnp.max(jnp.where(valid, jnp.asarray(depth)[None, :], 0), axis=1).astype(jnp.int32)
        return proposal.replace(valid=valid), DynamicState(inner_state, state.schedule, num_drafted)

    def observe(self, ctx: ProposeContext, state: DynamicState) -> DynamicState:
        return state.replace(inner=self.inner.observe(ctx, state.inner))

    def join(self, batch_state: DynamicState, row_state: DynamicState, running: jax.Array) -> DynamicState:
        """A row's state (a batch of one, as prefilled alone) as it joins a running batch
        (`running` [B] bool; the continuous batch's admission): its schedule's as the schedule
        says (`GoodputSchedule.join`: the batch's k where it chooses one for the batch), and the
        inner spec's as it says."""
        inner = self.inner.join(batch_state.inner, row_state.inner, running)
        schedule = self.schedule.join(batch_state.schedule, row_state.schedule, running)
        return row_state.replace(inner=inner, schedule=schedule)

    def update(self, ctx: UpdateContext, state: DynamicState) -> DynamicState:
        inner = self.inner.update(ctx, state.inner)
        # The rows running: GoodputSchedule's verify cost by batch occupancy, and its one k per batch.
        schedule = self.schedule.update(
            state.schedule, ctx.num_accepted, state.num_drafted, self.k, running=ctx.running
        )
        return DynamicState(inner, schedule, state.num_drafted)

    def counters(self, state: DynamicState):
        return self.inner.counters(state.inner)


def _pad(proposal: Proposal, K: int, keep: int) -> Proposal:
    """The first `keep` positions of a proposal, padded (invalid) to K."""
    B, width = proposal.draft_tokens.shape
    if width == K and keep == K:
        return proposal
    keep = min(keep, width)
    extra = K - keep

    def pad(x, value):
        x = x[:, :keep]
        return jnp.concatenate([x, jnp.full((B, extra) + x.shape[2:], value, x.dtype)], axis=1)

    probs = None if proposal.draft_probs is None else pad(proposal.draft_probs, 0.0)
    return Proposal(pad(proposal.draft_tokens, 0), pad(proposal.valid, False), probs)


@dataclasses.dataclass(frozen=True, eq=False)
class Dynamic(Proposer):
    """A proposer whose k changes per row as a schedule decides, never above the proposer's own k.

    Lossless like the proposer itself: the schedule only chooses how many drafts to verify."""

    proposer: Any
    schedule: Any = dataclasses.field(default_factory=HeuristicSchedule)

    def __post_init__(self):
        if not isinstance(self.proposer, Proposer) or isinstance(self.proposer, Dynamic):
            raise ValueError(
                "Dynamic proposer must be a proposer other than Dynamic (NGram, DraftModel, ...), "
                f"not {self.proposer!r}"
            )
        if not isinstance(self.schedule, SCHEDULES):
            names = ", ".join(f"specjax.{s.__name__}" for s in SCHEDULES)
            raise ValueError(f"Dynamic schedule must be one of {names}, got {self.schedule!r}")

    @property
    def k(self) -> int:
        return self.proposer.draft_positions

    def with_k(self, k: int) -> Dynamic:
        return Dynamic(self.proposer.with_k(k), self.schedule)

    def parts(self) -> tuple[Proposer, ...]:
        return (self.proposer,)

    def spec(self, target, warp=None, mesh=None) -> DynamicSpec:
        return DynamicSpec(self.proposer.spec(target, warp, mesh), self.schedule)

    def params(self, target):
        return self.proposer.params(target)
