"""The statistical check shared by the law tests: observed counts against exact probabilities.

Every assertion runs three checks on the counts of n independent draws:

- an outcome of probability 0 is never drawn;
- per cell, the count lies within 6 binomial standard deviations plus 3 of n p. Exact binomial tails
  put each cell's false-alarm rate below 1.3e-7 (the worst case, an expected count near 0.4;
  tests/test_laws.py computes it), and `LawCheck.false_alarm` sums them over the cells. This sees a
  gross error in one cell, but little else: at n = 1,500 a cell of probability 0.2 may be off by
  32% and one of 0.05 by 71% and pass;
- over all cells, a G-test (likelihood ratio, G = 2 sum O ln(O / E)) with the cells of expected
  count below MIN_EXPECTED pooled into one, against the chi-square law with cells - 1 degrees of
  freedom, at false-alarm rate ALPHA = 1e-6 per assertion (nominal: the chi-square approximation,
  whose calibration tests/test_laws.py checks by simulation at 1e-3). It adds up small errors
  spread over many cells, which the per-cell bounds miss.

Power. If the draws follow p' instead of p, G is approximately noncentral chi-square with
noncentrality lam = n sum (p' - p)^2 / p (about 2 n KL(p' || p)). A change that moves a mass delta
between the (pooled) cells, i.e. at total-variation distance delta, has sum (p' - p)^2 / p >= 4
delta^2 (Cauchy-Schwarz on sum |p' - p| = 2 delta), hence lam >= 4 n delta^2. `detectable_shift`
is the smallest delta that the G-test then rejects with probability POWER = 0.9, whatever the
direction of the change; that is the figure each law test states ("detects a shift of 1.2% of the
mass at n = 100,000"). For one cell alone changed by a relative eps (the difference spread over
the others in proportion), sum (p' - p)^2 / p = eps^2 p / (1 - p).

The chi-square tails come from scipy, which jax requires (scipy >= 1.14), so it is always here.
The tests are deterministic (fixed seeds): the false-alarm rate says how likely a correct sampler
is to fail when a seed or the code's order of draws changes, not a flake rate.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
from scipy import optimize, stats

ALPHA = 1e-6  # false-alarm rate of each G-test
POWER = 0.9  # the probability with which a stated shift is detected
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled into one


@dataclasses.dataclass(frozen=True)
class LawCheck:
    """What one passed assertion tested: its draws, its cells after pooling, G and its p-value,
    a bound on its false-alarm rate (ALPHA plus the per-cell bounds' exact tails) and the shift of
    mass its G-test detects with probability POWER."""

    n: int
    cells: int
    g: float
    p_value: float
    false_alarm: float
    detectable_shift: float


def pool(expected: np.ndarray, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Cell index [C] -> pooled cell index: the cells expected fewer than min_expected times share
    one cell; while that cell is still short of min_expected, the smallest other cell joins it."""
    expected = np.asarray(expected, np.float64)
    small = expected < min_expected
    while small.any() and not small.all() and expected[small].sum() < min_expected:
        small[np.flatnonzero(~small)[np.argmin(expected[~small])]] = True
    large = np.flatnonzero(~small)
    group = np.full(len(expected), len(large))  # the pooled cell comes last
    group[large] = np.arange(len(large))
    return group


def g_statistic(observed: np.ndarray, expected: np.ndarray) -> float:
    """G = 2 sum O ln(O / E), with 0 ln 0 = 0; expected > 0 wherever observed > 0."""
    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    seen = observed > 0
    return float(2 * np.sum(observed[seen] * np.log(observed[seen] / expected[seen])))


def chi2_sf(x, df: int):
    """P(chi-square with df degrees of freedom > x), in float64 (elementwise over an array x)."""
    return stats.chi2.sf(x, df)


@functools.cache
def noncentrality_for_power(df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The noncentrality lam at which a chi-square test with df degrees of freedom, rejecting above
    its 1 - alpha quantile, rejects with probability `power`."""
    critical = stats.chi2.isf(alpha, df)
    return float(optimize.brentq(lambda lam: stats.ncx2.sf(critical, df, lam) - power, 1e-9, 1e6))


def detectable_shift(n: int, cells: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest total-variation change of a law over `cells` cells that a G-test on n draws
    rejects with probability `power`: lam = 4 n delta^2 at least (see the module docstring)."""
    if cells < 2 or n == 0:
        return 1.0
    return float(np.sqrt(noncentrality_for_power(cells - 1, alpha, power) / n) / 2)


def power_against(n: int, probs: np.ndarray, alternative: np.ndarray, alpha: float = ALPHA) -> float:
    """The probability that the G-test of check_counts, on n draws that follow `alternative`
    instead of probs, rejects (noncentral chi-square, lam = n sum (p' - p)^2 / p over the pooled
    cells). Mass that the alternative puts where probs is 0 is left out: the zero-probability check
    catches it, whatever this says."""
    probs, alternative = np.asarray(probs, np.float64), np.asarray(alternative, np.float64)
    possible = probs > 0
    group = pool(n * probs[possible])
    cells = group.max(initial=-1) + 1
    if cells < 2:
        return 0.0
    law = np.bincount(group, weights=probs[possible], minlength=cells)
    other = np.bincount(group, weights=alternative[possible], minlength=cells)
    lam = n * np.sum((other - law) ** 2 / law)
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, cells - 1), cells - 1, lam))


def per_cell_bound(n: int, probs: np.ndarray) -> np.ndarray:
    """The allowed |count - n p| per cell: 6 binomial standard deviations plus 3."""
    return 6 * np.sqrt(n * probs * (1 - probs)) + 3


def per_cell_false_alarm(n: int, probs: np.ndarray) -> np.ndarray:
    """The exact probability that a Binomial(n, p) count breaks `per_cell_bound`, per cell."""
    probs = np.asarray(probs, np.float64)
    mean, bound = n * probs, per_cell_bound(n, probs)
    above = stats.binom.sf(np.floor(mean + bound), n, probs)
    below = stats.binom.cdf(np.ceil(mean - bound) - 1, n, probs)
    return above + below


def check_counts(
    counts: np.ndarray, probs: np.ndarray, what: str, alpha: float = ALPHA, labels: Sequence | None = None
) -> LawCheck:
    """Counts [C] of n independent draws agree with the law probs [C]; labels name the cells in
    messages (their indices if None). Returns what was tested."""
    counts, probs = np.asarray(counts, np.int64), np.asarray(probs, np.float64)
    labels = list(range(len(probs))) if labels is None else list(labels)
    assert (probs >= 0).all() and abs(probs.sum() - 1) < 1e-5, f"{what}: the reference is not a law"
    n = int(counts.sum())
    impossible = probs == 0
    drawn = np.flatnonzero(counts * impossible)
    assert not drawn.size, (
        f"{what}: outcomes of probability 0 drawn: {[labels[i] for i in drawn]} ({counts[drawn]} times)"
    )
    expected, bound = n * probs, per_cell_bound(n, probs)
    bad = np.abs(counts - expected) > bound
    assert not bad.any(), (
        f"{what} (n={n}): counts {counts[bad]} vs expected {expected[bad].round(1)} "
        f"(bound {bound[bad].round(1)}) at outcomes {[labels[i] for i in np.flatnonzero(bad)]}"
    )

    possible = np.flatnonzero(~impossible)
    group = pool(expected[possible])
    cells = group.max(initial=-1) + 1
    observed = np.bincount(group, weights=counts[possible], minlength=cells)
    pooled = np.bincount(group, weights=expected[possible], minlength=cells)
    g = g_statistic(observed, pooled) if n else 0.0
    p_value = float(chi2_sf(g, cells - 1)) if cells > 1 else 1.0
    if p_value < alpha:
        raise AssertionError(
            f"{what}: G-test rejects the law: "
            + g_report(observed, pooled, group, possible, labels, g, p_value, alpha)
        )
    false_alarm = alpha * (cells > 1) + float(per_cell_false_alarm(n, probs[possible]).sum()) if n else 0.0
    return LawCheck(n, int(cells), g, p_value, false_alarm, detectable_shift(n, int(cells), alpha))


def g_report(observed, pooled, group, possible, labels, g, p_value, alpha) -> str:
    """G, its p-value and the five cells that contribute most to it."""
    n, cells = int(observed.sum()), len(observed)
    seen = np.maximum(observed, 1e-300)
    contribution = 2 * (observed * np.log(seen / pooled) - observed + pooled)  # each >= 0, sum = G
    worst = np.argsort(-contribution)[:5]
    members = [possible[group == c] for c in range(cells)]
    names = [labels[m[0]] if len(m) == 1 else f"pooled {len(m)} cells" for m in members]
    rows = ", ".join(f"{names[c]}: {observed[c]:.0f} vs {pooled[c]:.1f}" for c in worst)
    test = f"G = {g:.1f} on {cells - 1} df (n={n}), p = {p_value:.2g} < {alpha:g}"
    return f"{test}; worst cells (seen vs expected): {rows}"


def assert_law(samples: np.ndarray, probs: np.ndarray, what: str, alpha: float = ALPHA) -> LawCheck:
    """Draws of outcomes 0..len(probs)-1 follow probs."""
    probs = np.asarray(probs, np.float64)
    assert samples.min(initial=0) >= 0 and samples.max(initial=0) < len(probs), f"{what}: out of range"
    return check_counts(np.bincount(samples, minlength=len(probs)), probs, what, alpha)


def assert_sequence_law(
    draws: Iterable[Sequence[int]], joint: dict[Hashable, float], what: str, alpha: float = ALPHA
) -> LawCheck:
    """Draws of token sequences follow the law `joint` (sequence tuple -> probability); a sequence
    outside it has probability 0."""
    counts: dict[tuple, int] = {}
    for seq in draws:
        counts[tuple(seq)] = counts.get(tuple(seq), 0) + 1
    outside = set(counts) - set(joint)
    assert not outside, f"{what}: sequences of probability 0 drawn: {sorted(outside)[:5]}"
    labels = list(joint)
    return check_counts([counts.get(s, 0) for s in labels], [joint[s] for s in labels], what, alpha, labels)
