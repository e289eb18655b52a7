"""The statistical check shared by the law tests: observed counts against exact probabilities.

Each count is bounded by 6 binomial standard deviations plus 3 (false-alarm rate far below 1e-6
per cell), and an outcome of probability 0 must never be drawn."""

import numpy as np


def assert_law(samples: np.ndarray, probs: np.ndarray, what: str) -> None:
    """Counts of each outcome 0..len(probs)-1 agree with probs."""
    probs = np.asarray(probs, np.float64)
    total = len(samples)
    assert samples.min(initial=0) >= 0 and samples.max(initial=0) < len(probs), f"{what}: out of range"
    counts = np.bincount(samples, minlength=len(probs))
    expected = total * probs
    bound = 6 * np.sqrt(total * probs * (1 - probs)) + 3
    impossible = probs == 0
    drawn = np.flatnonzero(counts * impossible)
    assert not drawn.size, f"{what}: outcomes of probability 0 drawn: {drawn} ({counts[drawn]} times)"
    bad = np.abs(counts - expected) > bound
    assert not bad.any(), (
        f"{what} (n={total}): counts {counts[bad]} vs expected {expected[bad].round(1)} "
        f"(bound {bound[bad].round(1)}) at outcomes {np.flatnonzero(bad)}"
    )
