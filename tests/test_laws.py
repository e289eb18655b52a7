"""The law check itself (tests/laws.py): its tails against closed forms, its pooling, the false-alarm
rates it states (exact per-cell tails; the G-test's by simulation at 1e-3) and the power it states
(by simulation at the stated shift)."""

import math

import numpy as np
import pytest
from laws import (
    ALPHA,
    POWER,
    assert_law,
    assert_sequence_law,
    check_counts,
    chi2_sf,
    detectable_shift,
    g_statistic,
    per_cell_false_alarm,
    pool,
)


def test_chi2_sf_matches_closed_forms_and_tables():
    for x in [0.0, 0.5, 3.0, 23.9, 60.0]:
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-300)
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-9)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(23.928127, 1) == pytest.approx(1e-6, rel=1e-5)


def test_pool_and_g_statistic():
    np.testing.assert_array_equal(pool([100, 3, 50, 1, 2]), [0, 2, 1, 2, 2])  # 6 expected: enough
    np.testing.assert_array_equal(pool([100, 3, 50, 1]), [0, 1, 1, 1])  # 4 < 5: the 50 joins them
    np.testing.assert_array_equal(pool([1, 2]), [0, 0])
    np.testing.assert_array_equal(pool([10, 20]), [0, 1])
    assert g_statistic([10, 0, 30], [20, 5, 15]) == pytest.approx(2 * (10 * np.log(0.5) + 30 * np.log(2)))


def test_stated_detectable_shifts():
    """The figures the law tests quote, and that more draws or fewer cells detect less."""
    assert detectable_shift(100_000, 16) == pytest.approx(0.0125, abs=5e-4)
    assert detectable_shift(1_500, 2) == pytest.approx(0.0797, abs=5e-4)
    assert detectable_shift(4 * 1_500, 2) < detectable_shift(1_500, 2) / 1.99
    assert detectable_shift(1_500, 40) > detectable_shift(1_500, 10)


def test_per_cell_false_alarm_is_below_the_stated_bound():
    probs = np.geomspace(1e-6, 1 - 1e-6, 4000)
    for n in [100, 1_500, 6_000, 60_000, 100_000]:
        assert per_cell_false_alarm(n, probs).max() < 1.3e-7, n


def peaky_law(rng, cells):
    x = rng.uniform(size=cells) ** 3
    return x / x.sum()


def g_p_values(counts: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """The G-test's p-value for each row of counts [S, C], pooled as check_counts pools."""
    n = counts[0].sum()
    group = pool(n * probs)
    cells = group.max() + 1
    observed = counts @ np.eye(cells)[group]  # [S, cells]
    expected = n * probs @ np.eye(cells)[group]
    with np.errstate(divide="ignore", invalid="ignore"):
        g = 2 * np.where(observed > 0, observed * np.log(observed / expected), 0).sum(1)
    return chi2_sf(g, cells - 1), cells


def test_g_test_false_alarm_is_calibrated():
    """Under the law itself, with many cells expected fewer than 5 times (pooled), G's p-value is
    below 1e-3 about 1e-3 of the time: the chi-square approximation holds that far into the tail."""
    rng = np.random.default_rng(0)
    probs = peaky_law(rng, 60)
    p_values, cells = g_p_values(rng.multinomial(1_500, probs, size=40_000), probs)
    assert cells < 60  # some cells were pooled
    rate = (p_values < 1e-3).mean()
    assert 0.4e-3 < rate < 2e-3, rate


@pytest.mark.parametrize("n, cells", [(1_500, 30), (20_000, 16)])
def test_g_test_detects_the_stated_shift(n, cells):
    """A law at total variation detectable_shift(n, cells) from the expected one, moved in the
    direction hardest to see (mass taken in proportion from cells holding about half the
    probability and given in proportion to the rest), is rejected at ALPHA about POWER of the
    time."""
    rng = np.random.default_rng(cells)
    probs = peaky_law(rng, cells)
    probs = np.maximum(probs, 10 / n)  # no pooling: the statement is about the tested cells
    probs /= probs.sum()
    delta = detectable_shift(n, cells)
    order = np.argsort(rng.uniform(size=cells))
    half = order[: np.searchsorted(np.cumsum(probs[order]), 0.5) + 1]
    taken = np.isin(np.arange(cells), half)
    shifted = np.where(
        taken, probs * (1 - delta / probs[taken].sum()), probs * (1 + delta / probs[~taken].sum())
    )
    assert abs(np.abs(shifted - probs).sum() / 2 - delta) < 1e-12
    p_values, _ = g_p_values(rng.multinomial(n, shifted, size=2_000), probs)
    assert (p_values < ALPHA).mean() > POWER - 0.03


def test_check_counts_reports_the_worst_cells():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    check = check_counts([5_000, 3_000, 2_000, 0], probs, "exact")
    assert check.n == 10_000 and check.cells == 3 and check.p_value == 1.0
    assert ALPHA < check.false_alarm < ALPHA + 4e-7
    with pytest.raises(AssertionError, match=r"G-test rejects the law: .* worst cells .* 2: 1780 vs 2000.0"):
        check_counts([5_110, 3_110, 1_780, 0], probs, "shifted")  # within 6 sigma + 3 of each cell
    with pytest.raises(AssertionError, match=r"probability 0 drawn: \[3\]"):
        check_counts([5_000, 3_000, 1_999, 1], probs, "impossible")
    with pytest.raises(AssertionError, match="out of range"):
        assert_law(np.array([0, 4]), probs, "range")
    with pytest.raises(AssertionError, match=r"sequences of probability 0 drawn: \[\(2, 2\)\]"):
        assert_sequence_law([(1, 2), (2, 2)], {(1, 2): 1.0}, "sequences")
