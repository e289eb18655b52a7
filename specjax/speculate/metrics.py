"""Metrics: counters accumulated inside the compiled loop, and their host-side summary.

Names follow vLLM's speculative-decoding metrics where one exists (num_drafts, num_draft_tokens,
num_accepted_tokens, mean acceptance length = 1 + accepted / drafts), so numbers compare across
systems.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int


@flax.struct.dataclass
class MetricCounters:
    """Per-row counters carried through the loop. K is the number of speculative tokens (0 when
    decoding plainly, which leaves the per-position arrays empty)."""

    steps: jax.Array  # [B] loop steps in which the row was still running
    drafting_steps: jax.Array  # [B] of those, steps with at least one valid draft (vLLM's num_drafts)
    target_forwards: jax.Array  # [B] target forward passes that scored the row (prefill included)
    drafted: jax.Array  # [B] draft tokens proposed (valid ones only)
    accepted: jax.Array  # [B] draft tokens accepted
    emitted: jax.Array  # [B] tokens appended to the output
    drafted_at: jax.Array  # [B, K] valid drafts at each position
    accepted_at: jax.Array  # [B, K] drafts accepted at each position (unconditional rate numerator)
    reached_at: jax.Array  # [B, K] positions verified, i.e. all earlier drafts accepted
    accept_hist: jax.Array  # [B, K+1] drafting steps that accepted 0..K drafts (sums to drafting_steps)
    expected_accept_at: jax.Array  # [B, K] sum over steps of sum_v min(p, q) at each position

    @classmethod
    def zeros(cls, batch_size: int, k: int) -> MetricCounters:
        def z(*shape, dtype=jnp.int32):
            return jnp.zeros((batch_size, *shape), dtype)

        return cls(
            steps=z(),
            drafting_steps=z(),
            target_forwards=z(),
            drafted=z(),
            accepted=z(),
            emitted=z(),
            drafted_at=z(k),
            accepted_at=z(k),
            reached_at=z(k),
            accept_hist=z(k + 1),
            expected_accept_at=z(k, dtype=jnp.float32),
        )


@dataclasses.dataclass
class SpecMetrics:
    """What one `generate` call did, per row (numpy arrays) and as totals via `summary()`."""

    num_speculative_tokens: int
    steps: np.ndarray
    drafting_steps: np.ndarray
    target_forwards: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    emitted: np.ndarray
    drafted_at: np.ndarray
    accepted_at: np.ndarray
    reached_at: np.ndarray
    accept_hist: np.ndarray
    expected_accept_at: np.ndarray
    compile_time_s: float = 0.0
    run_time_s: float = 0.0
    # The proposer's own per-row counts, for proposers that keep some (Hybrid: each part's steps,
    # drafts and accepted drafts apart, "first_steps", "then_accepted", ...).
    proposer: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_counters(
        cls, counters: MetricCounters, k: int, compile_time_s: float, run_time_s: float, proposer=None
    ):
        host = {f.name: np.asarray(getattr(counters, f.name)) for f in dataclasses.fields(counters)}
        own = {name: np.asarray(value) for name, value in (proposer or {}).items()}
        return cls(
            num_speculative_tokens=k,
            compile_time_s=compile_time_s,
            run_time_s=run_time_s,
            proposer=own,
            **host,
        )

    @property
    def tokens_per_second(self) -> float:
        return float(self.emitted.sum() / self.run_time_s) if self.run_time_s > 0 else float("nan")

    @property
    def acceptance_rate(self) -> float:
        drafted = self.drafted.sum()
        return float(self.accepted.sum() / drafted) if drafted else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verified draft, counting the bonus token (vLLM's
        definition). Steps where a row drafted nothing (an n-gram miss) are not drafts."""
        drafts = self.drafting_steps.sum()
        return float(1 + self.accepted.sum() / drafts) if drafts else float("nan")

    @property
    def tokens_per_target_forward(self) -> float:
        """Emitted tokens per target forward pass (prefill included): the speedup's upper bound."""
        forwards = self.target_forwards.sum()
        return float(self.emitted.sum() / forwards) if forwards else float("nan")

    def counterfactual_mean_acceptance_length(self, k: int, continuation: bool = False) -> float:
        """The mean acceptance length this run would have had at `k` <= K speculative tokens, from
        its acceptance-length histogram (n = drafts accepted in a drafting step at K).

        The why: one run at K answers "what would a smaller k have given?" without a run per k.
        The first k drafts of a step and their verdicts do not depend on the later ones, so a step
        that accepted n drafts at K accepts min(n, k) at k:

            default:       1 + E[min(n, k)]         (per drafting step, as mean_acceptance_length)

        That is exact in expectation when acceptance is i.i.d. per position (ForcedAcceptance). A
        copying proposer (prompt lookup) is not: at k, a step that accepted all k drafts drafts the
        rest of the same match next step, so the n + 1 tokens of a step at K take
        s = ceil((n + 1) / (k + 1)) steps of up to k accepted drafts each. `continuation=True`
        assumes that:

            continuation:  1 + E[n + 1 - s] / (1 + E[s - 1])

        The default runs low for such proposers (it counts a long match as one step of k); the
        continuation estimate runs a little low for i.i.d. acceptance (it ends a step at each
        bonus token of the run at K, where a real step at k would go on). Both equal
        mean_acceptance_length at k = K; each approximates a real run at k, whose steps start at
        other tokens.
        """
        K = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= K:
            raise ValueError(f"k must be an integer in [1, {K}] (this run's k), got {k!r}")
        drafts = self.drafting_steps.sum()
        if not drafts:
            return float("nan")
        hist = self.accept_hist.sum(0)  # [K+1]: steps that accepted 0..K drafts
        n = np.arange(K + 1)
        # Steps that drafted nothing (where hist[0] counts them) add nothing to either sum.
        if not continuation:
            return float(1 + (np.minimum(n, k) * hist).sum() / drafts)
        steps = -(-(n + 1) // (k + 1))  # [K+1] steps at k per step at K
        return float(1 + ((n + 1 - steps) * hist).sum() / (drafts + ((steps - 1) * hist).sum()))

    def summary(self) -> dict:
        """Totals over the batch as plain Python numbers (JSON-ready)."""
        reached = self.reached_at.sum(0)
        accepted_at = self.accepted_at.sum(0)
        drafted_at = self.drafted_at.sum(0)
        drafts = max(int(self.drafting_steps.sum()), 1)

        def ratio(num, den):
            return np.where(den > 0, num / np.maximum(den, 1), np.nan).tolist()

        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "steps": int(self.steps.sum()),
            "num_drafts": int(self.drafting_steps.sum()),
            "target_forwards": int(self.target_forwards.sum()),
            "num_draft_tokens": int(self.drafted.sum()),
            "num_accepted_tokens": int(self.accepted.sum()),
            "num_emitted_tokens": int(self.emitted.sum()),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            # Unconditional: accepted at position i per draft; conditional: per draft that reached i
            # (all earlier drafts accepted, EAGLE's definition); expected: mean of sum_v min(p, q).
            "acceptance_per_position": (accepted_at / drafts).tolist(),
            "conditional_acceptance_per_position": ratio(accepted_at, reached),
            "expected_acceptance_per_position": ratio(self.expected_accept_at.sum(0), drafted_at),
            "acceptance_length_histogram": self.accept_hist.sum(0).tolist(),
            "tokens_per_second": self.tokens_per_second,
            "compile_time_s": self.compile_time_s,
            "run_time_s": self.run_time_s,
            **{f"proposer_{name}": int(value.sum()) for name, value in self.proposer.items()},
        }

    def __str__(self) -> str:
        s = self.summary()
        line = (
            f"{s['num_emitted_tokens']} tokens in {s['run_time_s']:.2f} s "
            f"({s['tokens_per_second']:.1f} tok/s, compile {s['compile_time_s']:.1f} s), "
            f"{s['steps']} steps"
        )
        if self.num_speculative_tokens:
            line += (
                f", k={self.num_speculative_tokens}, acceptance rate {s['acceptance_rate']:.3f}, "
                f"mean acceptance length {s['mean_acceptance_length']:.2f}"
            )
        return line
