"""Verification against exact laws computed in float64 numpy.

The statistical tests replicate one fixed (p, q) over many rows, so every row is an independent
draw of the same experiment, and check each law with tests/laws.py: an outcome of probability
exactly 0 never occurs, each count lies within 6 binomial standard deviations plus 3, and a G-test
over all cells passes at false-alarm rate 1e-6 per law. At ROWS = 100,000 draws over the 16 tokens
a G-test detects (with probability 0.9) any change that moves 1.25% of the mass between tokens,
0.88% at the CHAIN_ROWS = 200,000 of the main law test; laws conditioned on a stop position see
fewer rows and detect less.
A numpy rejection sampler with a planted flaw (acceptance min(1, 1.1 p / q), or the replacement
drawn from p instead of the residual) fails the same checks on the same inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from laws import assert_law, power_against

from specjax.speculate.sampling import greedy_argmax
from specjax.speculate.verify import expected_acceptance, greedy_verify, rejection_sample

ROWS = 100_000
CHAIN_ROWS = 200_000  # test_rejection_sample_follows_exact_laws and its planted flaws
VOCAB = 16

_rejection_sample = jax.jit(rejection_sample)
_greedy_verify = jax.jit(greedy_verify)


# ---------------------------------------------------------------------------------------------
# Reference laws and helpers


def peaky(rng: np.random.Generator, shape: tuple[int, ...], zero_frac: float = 0.3) -> np.ndarray:
    """Random float32 distributions over the last axis: uniform**3 with some exact zeros."""
    x = rng.uniform(size=shape) ** 3
    x[rng.uniform(size=shape) < zero_frac] = 0
    keep = rng.integers(shape[-1], size=shape[:-1])[..., None]  # at least one nonzero entry
    np.put_along_axis(x, keep, 0.5 + rng.uniform(size=keep.shape), axis=-1)
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def law_inputs(seed: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """p [K+1, V], q [K, V] with, at every draft position, a token of q that p forbids (token 0)
    and a token of p that q never drafts (token 1)."""
    rng = np.random.default_rng(seed)
    p = peaky(rng, (k + 1, VOCAB)).astype(np.float64)
    q = peaky(rng, (k, VOCAB)).astype(np.float64)
    p[:k, 0], q[:, 0] = 0.0, 0.3
    p[:k, 1], q[:, 1] = 0.3, 0.0
    p /= p.sum(-1, keepdims=True)
    q /= q.sum(-1, keepdims=True)
    return p.astype(np.float32), q.astype(np.float32)


def law_of_n(acceptance: np.ndarray) -> np.ndarray:
    """P(num_accepted = j), j = 0..K, from the per-position acceptance probabilities a_i."""
    reached = np.concatenate([[1.0], np.cumprod(acceptance)])  # P(n >= j)
    return reached * np.append(1.0 - acceptance, 1.0)


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / x.sum()


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return normalize(np.maximum(np.float64(p) - np.float64(q), 0.0))


def replicate(x: np.ndarray, rows: int = ROWS) -> jax.Array:
    return jnp.asarray(np.broadcast_to(x, (rows, *x.shape)))


def sample_drafts(rng: np.random.Generator, q: np.ndarray, rows: int = ROWS) -> np.ndarray:
    """[rows, K] draft tokens, position i drawn from q[i]."""
    return np.stack([rng.choice(q.shape[-1], size=rows, p=normalize(qi)) for qi in q], axis=1).astype(
        np.int32
    )


def run(seed: int, p: np.ndarray, q: np.ndarray, drafts: np.ndarray, valid=None):
    rows = len(drafts)
    tokens, n = _rejection_sample(
        jax.random.key(seed), replicate(p, rows), replicate(q, rows), jnp.asarray(drafts), valid
    )
    return np.asarray(tokens), np.asarray(n)


def assert_layout(tokens: np.ndarray, n: np.ndarray, drafts: np.ndarray, p: np.ndarray) -> None:
    """Accepted prefix equals the drafts, -1 after n, and every emitted token has p > 0."""
    k = drafts.shape[1]
    assert tokens.dtype == np.int32 and n.dtype == np.int32
    assert tokens.shape == (len(n), k + 1)
    assert ((n >= 0) & (n <= k)).all()
    positions = np.arange(k + 1)
    before, after = positions < n[:, None], positions > n[:, None]
    assert (tokens[:, :k][before[:, :k]] == drafts[before[:, :k]]).all(), (
        "accepted prefix differs from drafts"
    )
    assert (tokens[after] == -1).all(), "positions after n must be -1"
    _, emitted_at = np.nonzero(positions <= n[:, None])
    emitted = tokens[positions <= n[:, None]]
    assert ((emitted >= 0) & (emitted < p.shape[-1])).all()
    p_emitted = p[emitted_at, emitted]  # p is one [K+1, V] for all rows
    assert (p_emitted > 0).all(), "a token with zero target probability was emitted"


# ---------------------------------------------------------------------------------------------
# Rejection sampling: exact laws


def chain_laws(p: np.ndarray, q: np.ndarray) -> dict[str, np.ndarray]:
    """The laws of rejection sampling with drafts drawn from q, by name: "num_accepted", from
    a_i = sum_v min(p_i, q_i); "stop j", the token at the stop position given n = j: the residual
    for j < K, p_K for the bonus; "emitted j", the token at position j given n >= j: p_j, because
    the method is lossless (j = 0 is the first token of every row; here p_j does not depend on
    the prefix, so this is the law)."""
    k = q.shape[0]
    acceptance = np.minimum(np.float64(p[:k]), np.float64(q)).sum(-1)
    laws = {"num_accepted": law_of_n(acceptance)}
    laws |= {f"stop {j}": residual(p[j], q[j]) if j < k else normalize(p[k]) for j in range(k + 1)}
    return laws | {f"emitted {j}": normalize(p[j]) for j in range(k + 1)}


def assert_chain_laws(tokens: np.ndarray, n: np.ndarray, p: np.ndarray, q: np.ndarray) -> dict:
    """Draws of rejection sampling follow chain_laws; returns each law's LawCheck by name."""
    laws = chain_laws(p, q)
    checks = {"num_accepted": assert_law(n, laws["num_accepted"], "num_accepted")}
    for j in range(q.shape[0] + 1):
        checks[f"stop {j}"] = assert_law(tokens[n == j, j], laws[f"stop {j}"], f"stop token at position {j}")
        emitted = tokens[n >= j, j]
        checks[f"emitted {j}"] = assert_law(emitted, laws[f"emitted {j}"], f"emitted token at position {j}")
    return checks


@pytest.mark.parametrize("k", [2, 3, 4])
def test_rejection_sample_follows_exact_laws(k):
    """At CHAIN_ROWS = 200,000 the G-tests on num_accepted (K + 1 cells) and on the first token (16)
    detect a shift of 0.88% of the mass. The acceptance rates of these inputs are low (0.05 to
    0.48): later positions are reached by 19% of the rows down to 0.05% and detect shifts of 2%
    to 40%. The rows were 100,000 (a shift of 1.25%), at which the best single G-test missed
    acceptance at min(1, 1.1 p / q) instead of min(1, p / q) with probability 0.02 at K = 3; now
    below 1e-6 (test_the_law_checks_reject_a_flawed_sampler)."""
    p, q = law_inputs(seed=10 + k, k=k)
    drafts = sample_drafts(np.random.default_rng(k), q, CHAIN_ROWS)
    tokens, n = run(k, p, q, drafts)
    assert_layout(tokens, n, drafts, p)
    checks = assert_chain_laws(tokens, n, p, q)
    assert checks["num_accepted"].detectable_shift < 0.0088
    assert checks["emitted 0"].detectable_shift < 0.0088
    # The forbidden drafts (token 0, p = 0) are drafted often but never emitted.
    assert (drafts == 0).mean() > 0.05
    assert not (tokens[:, :k] == 0).any()


def flawed_rejection_sample(rng, p, q, drafts, accept_scale=1.0, replace_from_p=False):
    """Rejection sampling over rows written out in float64 numpy, with two planted flaws: draft x_i
    is accepted with probability min(1, accept_scale p_i(x) / q_i(x)), and on rejection the token
    comes from p_i instead of the residual normalize(max(p_i - q_i, 0)) if replace_from_p. Drafts
    are drawn from q, so q_i(x_i) > 0. Returns tokens [rows, K+1] (-1 after n) and n [rows]."""
    rows, k = drafts.shape
    p64, q64 = np.float64(p), np.float64(q)
    at_draft = p64[np.arange(k), drafts], q64[np.arange(k), drafts]  # [rows, K] each
    accepted = rng.uniform(size=(rows, k)) < np.minimum(1.0, accept_scale * at_draft[0] / at_draft[1])
    n = np.where(accepted.all(1), k, np.argmin(accepted, 1))
    laws = [normalize(p64[j]) if replace_from_p else residual(p[j], q[j]) for j in range(k)]
    cdf = np.cumsum(np.stack([*laws, normalize(p64[k])]), -1)[n]  # [rows, V], the law at the stop
    stop = np.minimum((rng.uniform(size=rows)[:, None] >= cdf).sum(1), p.shape[-1] - 1)
    tokens = np.where(np.arange(k + 1) < n[:, None], np.pad(drafts, [(0, 0), (0, 1)]), -1)
    tokens[np.arange(rows), n] = stop
    return tokens.astype(np.int32), n.astype(np.int32)


def flawed_laws(p, q, accept_scale=1.0, replace_from_p=False) -> dict[str, np.ndarray]:
    """The exact laws that flawed_rejection_sample follows, under chain_laws's names."""
    k = q.shape[0]
    p64, q64 = np.float64(p[:k]), np.float64(q)
    kept = np.minimum(q64, accept_scale * p64)  # q_i(x) min(1, c p_i(x) / q_i(x))
    acceptance = kept.sum(-1)
    replacement = [normalize(p64[j]) if replace_from_p else residual(p[j], q[j]) for j in range(k)]
    laws = {"num_accepted": law_of_n(acceptance)}
    laws |= {f"stop {j}": replacement[j] for j in range(k)}
    return laws | {f"emitted {j}": kept[j] + (1 - acceptance[j]) * replacement[j] for j in range(k)}


@pytest.mark.parametrize("k", [2, 3, 4])
def test_the_law_checks_reject_a_flawed_sampler(k):
    """On the inputs of test_rejection_sample_follows_exact_laws, the checks pass specjax's
    rejection_sample and a numpy one, and fail the numpy one with either flaw. Not by luck: from
    the flawed sampler's exact laws, some G-test alone rejects it with probability above 1 - 1e-6
    at these sample sizes (the per-cell bounds catch acceptance at 1.1x here too, and the
    zero-probability check a replacement drawn from p)."""
    p, q = law_inputs(seed=10 + k, k=k)
    drafts = sample_drafts(np.random.default_rng(k), q, CHAIN_ROWS)
    assert_chain_laws(*run(k, p, q, drafts), p, q)
    assert_chain_laws(*flawed_rejection_sample(np.random.default_rng(100 + k), p, q, drafts), p, q)

    laws = chain_laws(p, q)
    for flaw in [dict(accept_scale=1.1), dict(replace_from_p=True)]:
        tokens, n = flawed_rejection_sample(np.random.default_rng(100 + k), p, q, drafts, **flaw)
        sizes = {"num_accepted": len(n)} | {f"stop {j}": (n == j).sum() for j in range(k)}
        sizes |= {f"emitted {j}": (n >= j).sum() for j in range(k)}
        flawed = flawed_laws(p, q, **flaw)
        power = {name: power_against(sizes[name], laws[name], law) for name, law in flawed.items()}
        assert max(power.values()) > 1 - 1e-6, (flaw, power)
        with pytest.raises(AssertionError, match=r"G-test rejects|probability 0 drawn|\(bound"):
            assert_chain_laws(tokens, n, p, q)


def test_rejection_sample_one_hot_draft():
    """A deterministic proposer: draft x_i is accepted with probability min(1, p_i(x_i))."""
    k = 3
    rng = np.random.default_rng(5)
    p = peaky(rng, (k + 1, VOCAB))
    for case, drafts_row in enumerate([np.argsort(-p[:k])[:, 1], [int(np.argmax(p[0])), 0, 0]]):
        drafts_row = np.asarray(drafts_row, np.int32)
        if case == 1:  # position 1 drafts a token the target forbids: n <= 1 always
            p[1, 0] = 0
            p[1] /= p[1].sum()
        q = np.eye(VOCAB, dtype=np.float32)[drafts_row]  # [K, V]
        drafts = np.broadcast_to(drafts_row, (ROWS, k)).copy()
        tokens, n = run(20 + case, p, q, drafts)
        assert_layout(tokens, n, drafts, p)
        acceptance = np.float64(p[np.arange(k), drafts_row])
        assert_law(n, law_of_n(acceptance), f"num_accepted (case {case})")
        for j in range(k):
            corrected = np.float64(p[j]).copy()
            corrected[drafts_row[j]] = 0
            stop = tokens[n == j, j]
            if len(stop):
                assert_law(stop, normalize(corrected), f"correction at {j} (case {case})")
        assert_law(tokens[:, 0], normalize(p[0]), f"first token (case {case})")


def test_rejection_sample_identical_distributions_accept_everything():
    """p == q: every draft is accepted (the residual would be 0) and the bonus follows p_K."""
    k = 3
    p = peaky(np.random.default_rng(6), (k + 1, VOCAB))
    drafts = sample_drafts(np.random.default_rng(7), p[:k])
    tokens, n = run(8, p, p[:k], drafts)
    assert (n == k).all()
    assert_layout(tokens, n, drafts, p)
    assert_law(tokens[:, k], normalize(p[k]), "bonus token")


def test_rejection_sample_zero_residual_falls_back_to_p():
    """A draft q = 2p (more mass than p; not a distribution) rejects half the time although the
    residual max(p - q, 0) is 0 everywhere: the stop token must then come from p, never NaN."""
    k = 2
    p = peaky(np.random.default_rng(9), (k + 1, VOCAB))
    q = 2 * p[:k]
    drafts = sample_drafts(np.random.default_rng(10), p[:k])
    tokens, n = run(11, p, q, drafts)
    assert_layout(tokens, n, drafts, p)
    assert_law(n, law_of_n(np.full(k, 0.5)), "num_accepted")
    for j in range(k + 1):
        assert_law(tokens[n == j, j], normalize(p[j]), f"stop token at position {j}")


# ---------------------------------------------------------------------------------------------
# Rejection sampling: the valid mask


def test_rejection_sample_all_invalid_row_emits_one_token_from_p():
    k = 3
    p, q = law_inputs(seed=30, k=k)
    drafts = sample_drafts(np.random.default_rng(31), q)
    valid = jnp.zeros((ROWS, k), bool)
    tokens, n = run(32, p, q, drafts, valid)
    assert (n == 0).all()
    assert (tokens[:, 1:] == -1).all()
    # p_0 itself, not the residual: nothing was drafted, so q counts as 0.
    assert_law(tokens[:, 0], normalize(p[0]), "the only token")


def test_rejection_sample_stops_at_the_valid_prefix():
    """With p == q every valid draft is accepted, so n is exactly the valid length; the token at
    that position comes from p (q counts as 0 where nothing was drafted)."""
    k = 4
    p = peaky(np.random.default_rng(40), (k + 1, VOCAB))
    drafts = sample_drafts(np.random.default_rng(41), p[:k])
    lengths = np.random.default_rng(42).integers(0, k + 1, size=ROWS)
    valid = np.arange(k) < lengths[:, None]
    tokens, n = run(43, p, p[:k], drafts, jnp.asarray(valid))
    np.testing.assert_array_equal(n, lengths)
    assert_layout(tokens, n, drafts, p)
    for j in range(k + 1):
        assert_law(tokens[n == j, j], normalize(p[j]), f"token at valid length {j}")


def test_rejection_sample_never_accepts_past_an_invalid_position():
    k = 3
    p = peaky(np.random.default_rng(50), (k + 1, VOCAB))
    drafts = sample_drafts(np.random.default_rng(51), p[:k], rows=1000)
    valid = np.broadcast_to([True, False, True], (1000, k))  # not a prefix: read as its prefix
    tokens, n = _rejection_sample(
        jax.random.key(52),
        replicate(p, 1000),
        replicate(p[:k], 1000),
        jnp.asarray(drafts),
        jnp.asarray(valid),
    )
    assert (np.asarray(n) == 1).all()
    assert (np.asarray(tokens)[:, 2:] == -1).all()


# ---------------------------------------------------------------------------------------------
# Greedy verification


def greedy_case(argmax_rows: list[list[int]], vocab: int = 5) -> jax.Array:
    """Logits [B, K+1, V] whose argmax at each position is given, with noise elsewhere."""
    rng = np.random.default_rng(60)
    argmax = np.asarray(argmax_rows)
    logits = rng.normal(size=(*argmax.shape, vocab)).astype(np.float32)
    np.put_along_axis(logits, argmax[..., None], 10.0, axis=-1)
    return jnp.asarray(logits)


def test_greedy_verify_hand_made_cases():
    logits = greedy_case([[1, 2, 3, 4]] * 6)  # K = 3, the target's greedy tokens
    drafts = jnp.array([[1, 2, 3], [0, 2, 3], [1, 0, 3], [1, 2, 0], [1, 2, 3], [1, 2, 3]])
    valid = jnp.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
    tokens, n = _greedy_verify(logits, drafts, valid)
    expected = [
        [1, 2, 3, 4],  # full acceptance, bonus argmax
        [1, -1, -1, -1],  # first-position mismatch
        [1, 2, -1, -1],  # mismatch in the middle
        [1, 2, 3, -1],  # mismatch at the last draft
        [1, 2, -1, -1],  # correct drafts after the valid prefix are not accepted
        [1, -1, -1, -1],  # nothing valid: the target's own token
    ]
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    np.testing.assert_array_equal(np.asarray(n), [3, 0, 1, 2, 1, 0])
    assert tokens.dtype == jnp.int32 and n.dtype == jnp.int32
    # valid=None means all valid.
    tokens_all, n_all = _greedy_verify(logits[:4], drafts[:4])
    np.testing.assert_array_equal(np.asarray(tokens_all), expected[:4])
    np.testing.assert_array_equal(np.asarray(n_all), [3, 0, 1, 2])


def test_greedy_verify_equals_rejection_sample_with_one_hot_distributions():
    b, k, v = 64, 4, 7
    rng = np.random.default_rng(70)
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    argmax = logits.argmax(-1)
    drafts = np.where(rng.uniform(size=(b, k)) < 0.8, argmax[:, :k], rng.integers(v, size=(b, k)))
    valid = np.arange(k) < rng.integers(0, k + 1, size=b)[:, None]
    greedy = _greedy_verify(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(valid))
    p = np.eye(v, dtype=np.float32)[argmax]
    q = np.eye(v, dtype=np.float32)[drafts]
    for seed in range(3):
        sampled = _rejection_sample(jax.random.key(seed), p, q, jnp.asarray(drafts), jnp.asarray(valid))
        np.testing.assert_array_equal(np.asarray(sampled[0]), np.asarray(greedy[0]))
        np.testing.assert_array_equal(np.asarray(sampled[1]), np.asarray(greedy[1]))


# ---------------------------------------------------------------------------------------------
# Expected acceptance and shape checks


@pytest.mark.parametrize("bonus", [True, False])
def test_expected_acceptance_matches_numpy(bonus):
    b, k, v = 3, 4, 9
    rng = np.random.default_rng(80)
    p = peaky(rng, (b, k + bonus, v))
    q = peaky(rng, (b, k, v))
    got = np.asarray(expected_acceptance(jnp.asarray(p), jnp.asarray(q)))
    want = np.minimum(np.float64(p[:, :k]), np.float64(q)).sum(-1)
    assert got.shape == (b, k)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_shape_mismatches_are_reported():
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(key, jnp.ones((2, 3, 5)), jnp.ones((2, 3, 5)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(key, jnp.ones((2, 4, 5)), jnp.ones((2, 3, 6)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="valid"):
        greedy_verify(jnp.ones((2, 4, 5)), jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 2), bool))


# ---------------------------------------------------------------------------------------------
# Invariants on random shapes


def test_smallest_shape_under_vmap_over_keys():
    """B = 1, K = 1, V = 2, one key per trial: accept x = 0 with probability min(1, 0.3/0.9);
    on rejection the residual max(p - q, 0) = [0, 0.6] forces token 1; the bonus follows p_1."""
    p = jnp.array([[[0.3, 0.7], [0.6, 0.4]]], jnp.float32)
    q = jnp.array([[[0.9, 0.1]]], jnp.float32)
    drafts = jnp.zeros((1, 1), jnp.int32)
    keys = jax.random.split(jax.random.key(90), ROWS)
    tokens, n = jax.jit(jax.vmap(lambda key: rejection_sample(key, p, q, drafts)))(keys)
    tokens, n = np.asarray(tokens)[:, 0], np.asarray(n)[:, 0]  # [trials, 2], [trials]
    assert_law(n, [2 / 3, 1 / 3], "num_accepted")
    assert (tokens[n == 0] == [1, -1]).all()
    assert (tokens[n == 1, 0] == 0).all()
    assert_law(tokens[n == 1, 1], [0.6, 0.4], "bonus token")


# Compiling costs far more than running these shapes, so the batch is fixed at 4 independent rows
# and the vocabulary is padded to 12 with tokens that neither p nor q gives any mass (which must
# then never be emitted): at most one compilation per K.
MAX_VOCAB = 12


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 5),
    v=st.integers(2, MAX_VOCAB),
    seed=st.integers(0, 2**31 - 1),
    draft_kind=st.sampled_from(["peaky", "one_hot", "equal"]),
    drafts_from_q=st.booleans(),
)
def test_rejection_sample_invariants(k, v, seed, draft_kind, drafts_from_q):
    b = 4
    rng = np.random.default_rng(seed)
    p = peaky(rng, (b, k + 1, v), zero_frac=0.4)
    q = p[:, :k] if draft_kind == "equal" else peaky(rng, (b, k, v), zero_frac=0.4)
    if drafts_from_q:
        drafts = np.stack([[rng.choice(v, p=normalize(qi)) for qi in row] for row in q]).astype(np.int32)
    else:  # arbitrary drafts, including ones that q or p gives probability 0
        drafts = rng.integers(v, size=(b, k)).astype(np.int32)
    if draft_kind == "one_hot":
        q = np.eye(v, dtype=np.float32)[drafts]
    lengths = rng.integers(0, k + 1, size=b)
    valid = np.arange(k) < lengths[:, None]
    pad = [(0, 0), (0, 0), (0, MAX_VOCAB - v)]
    p, q = np.pad(p, pad), np.pad(q, pad)

    tokens, n = _rejection_sample(jax.random.key(seed), p, q, jnp.asarray(drafts), jnp.asarray(valid))
    tokens, n = np.asarray(tokens), np.asarray(n)
    assert (n <= lengths).all()
    assert (tokens < v).all()
    for row in range(b):
        assert_layout(tokens[row : row + 1], n[row : row + 1], drafts[row : row + 1], p[row])
    acceptance = np.asarray(expected_acceptance(jnp.asarray(p), jnp.asarray(q)))
    assert np.isfinite(acceptance).all() and (acceptance >= 0).all() and (acceptance <= 1 + 1e-6).all()


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 5), v=st.integers(2, MAX_VOCAB), seed=st.integers(0, 2**31 - 1))
def test_greedy_verify_invariants(k, v, seed):
    """The accepted prefix equals the drafts and the target's argmax; the next token is the argmax
    at the stop position; nothing is accepted past an invalid draft; every token is in the
    vocabulary (padding tokens of the vocabulary are -inf and never chosen)."""
    b = 4
    rng = np.random.default_rng(seed)
    logits = np.full((b, k + 1, MAX_VOCAB), -np.inf, np.float32)
    logits[..., :v] = rng.normal(size=(b, k + 1, v))
    argmax = logits.argmax(-1)
    # drafts agree with the argmax for a random stretch, then are random
    agree = rng.integers(0, k + 1, size=b)
    drafts = np.where(np.arange(k) < agree[:, None], argmax[:, :k], rng.integers(v, size=(b, k)))
    lengths = rng.integers(0, k + 1, size=b)
    valid = np.arange(k) < lengths[:, None]
    tokens, n = _greedy_verify(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32), jnp.asarray(valid))
    tokens, n = np.asarray(tokens), np.asarray(n)
    for row in range(b):
        expected_n = 0
        while expected_n < lengths[row] and drafts[row, expected_n] == argmax[row, expected_n]:
            expected_n += 1
        assert n[row] == expected_n
        assert (tokens[row, : n[row]] == drafts[row, : n[row]]).all()
        assert tokens[row, n[row]] == argmax[row, n[row]]
        assert (tokens[row, n[row] + 1 :] == -1).all()
        assert (tokens[row, : n[row] + 1] < v).all()


def test_greedy_argmax_equals_jnp_argmax():
    """The two-reduction argmax every greedy choice uses (specjax/speculate/sampling.py) picks what
    jnp.argmax does: the first of tied maxima, the first NaN, an infinity, and in an all -inf
    row the first entry; over a [B, T, V] array as over a [V] one."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 3, 200)).astype(np.float32)
    logits[0, 0, [17, 50, 199]] = 9.0  # ties: the first wins
    logits[1, 1, [3, 40]] = np.nan  # the first NaN wins over any number
    logits[2, 2, [60, 61]] = np.inf
    logits[3, 0] = -np.inf
    logits[4, 1, -1] = 50.0  # the last entry
    logits[5] = np.round(logits[5])  # many ties
    for x in (logits, logits[0, 0]):
        expected = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
        got = np.asarray(jax.jit(greedy_argmax)(jnp.asarray(x)))
        assert got.dtype == np.int32 and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    assert int(greedy_argmax(jnp.asarray(logits[1, 1]))) == 3  # the first NaN
    assert int(greedy_argmax(jnp.asarray(logits[0, 0]))) == 17  # the first of three ties
