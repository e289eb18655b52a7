"""Top-k and top-p over the largest logits only (`WarpSpec.candidates`, `lax.top_k`) keep exactly
the tokens the full sort keeps (`candidates=0`, the reference): the same support and the same
probabilities, on logits with ties and peaky ones, whether each row's nucleus fits in the
candidates (no sort) or not (the batch-wide fallback to the sort); and a whole seeded generation
samples the same tokens either way."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import tiny_model

import specjax
from specjax.speculate import sampling
from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec, _capped_threshold, warp_logits

V = 500
CANDIDATES = 32
S = Sampling


def make_logits(kind: str, rows: int, seed: int = 0) -> np.ndarray:
    """[rows, 3, V] float32 logits: "spread" (unit normal), "ties" (a coarse grid of values, so the
    last kept token has ties), "peaky" (a few tokens hold almost all the mass)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3, V))
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "peaky":
        x = x * 6
    return x.astype(np.float32)


_warp = jax.jit(lambda logits, params, spec: jnp.exp(warp_logits(logits, params, spec)), static_argnums=2)


def capped_and_sorted(rows, logits, candidates=CANDIDATES):
    """The warped probabilities with `candidates` and with the full sort, and whether every row
    fitted in the candidates (no sort ran)."""
    spec = dataclasses.replace(WarpSpec.of(rows), candidates=candidates)
    params = SamplingParams.of(rows, len(rows), V)
    capped = np.asarray(_warp(jnp.asarray(logits), params, spec))
    reference = np.asarray(_warp(jnp.asarray(logits), params, dataclasses.replace(spec, candidates=0)))
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None, None]
    _, fits = _capped_threshold(jnp.asarray(logits) / temperature, params, spec, candidates)
    return capped, reference, bool(jnp.all(fits))


CASES = {
    # name: (rows, kind of logits, every row fits in the candidates)
    "top_k": ([S(1.0, top_k=1), S(1.0, top_k=5), S(0.7, top_k=20), S(1.5, top_k=CANDIDATES)], "ties", True),
    "top_p inside": (
        [S(1.0, top_p=0.9), S(0.5, top_p=0.5), S(1.0, top_p=0.99), S(2.0, top_p=0.3)],
        "peaky",
        True,
    ),
    "top_p outside": (
        [S(1.0, top_p=0.9), S(1.0, top_p=0.2), S(0.8, top_p=0.6), S(1.0, top_p=0.95)],
        "spread",
        False,
    ),
    "top_p outside, ties": ([S(1.0, top_p=0.9), S(1.0, top_p=0.5)], "ties", False),
    "top_k top_p min_p": (
        [S(0.8, top_k=10, top_p=0.8, min_p=0.05), S(1.0, top_k=25, top_p=0.95), S(1.3, top_p=0.7, min_p=0.1)],
        "peaky",
        True,
    ),
    "mixed, some outside": (
        [S(0.8, top_k=10, top_p=0.8, min_p=0.05), S(1.0, top_p=0.9), S(1.0, min_p=0.02), S()],
        "spread",
        False,
    ),
    # Rows with no rank filter (temperature only, min-p only) and a greedy row beside filtered ones
    # keep every token without sorting.
    "temperature": ([S(0.6), S(1.7, top_k=3), S(1.0, min_p=0.1), S(0.0, top_k=7, top_p=0.1)], "spread", True),
}


@pytest.mark.parametrize("kind_override", [None, "ties", "peaky", "spread"])
@pytest.mark.parametrize("name", list(CASES))
def test_capped_warp_equals_the_sorted_reference(name, kind_override):
    rows, kind, fits = CASES[name]
    capped, reference, all_fit = capped_and_sorted(rows, make_logits(kind_override or kind, len(rows)))
    if kind_override is None:  # the case's own logits: the branch it is there for
        assert all_fit == fits
    sampled = np.array([not s.greedy for s in rows])  # a greedy row's warp is never used
    capped, reference = capped[sampled], reference[sampled]
    np.testing.assert_array_equal(capped > 0, reference > 0)  # the same support
    np.testing.assert_allclose(capped, reference, rtol=1e-6, atol=1e-7)
    assert np.all((reference > 0).sum(-1) >= 1)


def test_a_row_with_top_k_above_the_candidates_sorts():
    rows = [S(1.0, top_k=CANDIDATES + 1), S(1.0, top_k=3)]
    capped, reference, all_fit = capped_and_sorted(rows, make_logits("spread", 2))
    assert not all_fit
    np.testing.assert_allclose(capped, reference, rtol=1e-6, atol=1e-7)
    assert ((capped > 0).sum(-1) == np.array([[CANDIDATES + 1] * 3, [3] * 3])).all()


def primitives(jaxpr, into_cond: bool) -> set[str]:
    """The primitives of a jaxpr and of the jaxprs nested in it (a cond's branches if `into_cond`)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "cond" and not into_cond:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns"):
                    names |= primitives(sub, into_cond)
    return names


def test_no_sort_outside_the_fallback():
    """The warp sorts only inside the cond's fallback branch; without candidates it sorts always."""
    rows = [S(1.0, top_k=5, top_p=0.9), S(1.0, top_p=0.9)]
    params, logits = SamplingParams.of(rows, 2, V), jnp.asarray(make_logits("spread", 2))
    spec = dataclasses.replace(WarpSpec.of(rows), candidates=CANDIDATES)

    def jaxpr(spec):
        return jax.make_jaxpr(warp_logits, static_argnums=2)(logits, params, spec).jaxpr

    assert {"top_k", "cond"} <= primitives(jaxpr(spec), into_cond=False)
    assert "sort" not in primitives(jaxpr(spec), into_cond=False)
    assert "sort" in primitives(jaxpr(spec), into_cond=True)
    assert "sort" in primitives(jaxpr(dataclasses.replace(spec, candidates=0)), into_cond=False)


def test_candidates_of_a_batch():
    def candidates(*rows):
        return WarpSpec.of(list(rows)).candidates

    assert candidates(S(1.0, top_k=3)) == candidates(S(1.0, top_k=50)) == sampling.MIN_CANDIDATES
    assert candidates(S(1.0, top_k=3), S(1.0, top_k=100)) == 128
    assert candidates(S(1.0, top_p=0.9)) == candidates(S(1.0, top_k=3), S(1.0, top_p=0.9)) == 256
    assert candidates(S(1.0, top_k=300, top_p=0.9)) == 512  # top-k bounds the nucleus
    assert candidates(S(1.0, top_k=sampling.MAX_CANDIDATES + 1)) == 0  # sorts
    assert candidates(S(1.0), S(1.0, min_p=0.1)) == 0  # nothing filters by rank
    assert candidates(S(0.0, top_k=3), S(1.0)) == 0  # greedy rows are not warped


# The draft model's case (its own warp of the same candidates) runs in make test-all.
@pytest.mark.parametrize("proposer", [None, pytest.param("draft", marks=pytest.mark.slow)])
def test_seeded_generation_samples_the_same_tokens_as_the_sort(monkeypatch, proposer):
    """With a vocabulary of 512, top-k rows take 64 candidates and top-p rows 256: both the
    target's warp and the draft's go through them. Forcing the full sort (candidates 0) must give
    the same tokens and acceptance counts."""
    target = tiny_model(seed=31, vocab_size=512)
    draft = tiny_model(seed=32, vocab_size=512, num_layers=1, hidden_size=32, intermediate_size=48)
    rows = [
        S(0.8, top_k=10, seed=1),
        S(1.0, top_p=0.8, seed=2),
        S(0.6, top_k=50, top_p=0.9, min_p=0.02, seed=3),
        S(0.3, top_p=0.5, seed=4),
    ]
    assert WarpSpec.of(rows).candidates == 256

    def run():
        drafter = None if proposer is None else specjax.DraftModel(draft, k=3)
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        return specjax.generate(target, prompts, proposer=drafter, sampling=rows, max_new_tokens=24)

    capped = run()
    monkeypatch.setattr(sampling, "_candidates", lambda sampled: 0)
    assert WarpSpec.of(rows).candidates == 0
    reference = run()
    assert capped.tokens == reference.tokens
    np.testing.assert_array_equal(capped.metrics.accepted, reference.metrics.accepted)
    assert len({tuple(t) for t in capped.tokens}) == 4
