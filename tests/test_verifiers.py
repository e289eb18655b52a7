"""The verifier the loop picks, and ForcedAcceptance's override kept out of the lossless verifier."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.speculate.loop import verifier
from specjax.speculate.proposers import DynamicSpec, ForcedSpec, Proposal
from specjax.speculate.proposers.forced import ForcedVerifier, FreeDrafts
from specjax.speculate.sampling import SamplingParams, WarpSpec
from specjax.speculate.verifiers import LOSSLESS

B, K, V = 3, 4, 11


def test_the_loop_picks_the_forced_verifier_for_forced_acceptance_alone():
    forced = ForcedSpec(FreeDrafts(K), (0.5,) * K)
    assert verifier(SimpleNamespace(proposer=specjax.NGram(k=K))) is LOSSLESS
    assert verifier(SimpleNamespace(proposer=forced)) == ForcedVerifier((0.5,) * K, LOSSLESS)
    dynamic = DynamicSpec(forced, specjax.HeuristicSchedule())
    assert verifier(SimpleNamespace(proposer=dynamic)) == ForcedVerifier((0.5,) * K, LOSSLESS)


def _chain(sampling: specjax.Sampling, seed: int = 0):
    logits = jax.random.normal(jax.random.key(seed), (B, K + 1, V))
    draft = jnp.argmax(logits[:, :K], axis=-1).astype(jnp.int32)  # every draft is the argmax
    valid = jnp.asarray(np.arange(K)[None, :] < np.array([K, 2, 0])[:, None])  # 4, 2 and 0 drafts
    keys = jax.random.split(jax.random.key(seed + 1), B)
    return WarpSpec.of(sampling), logits, Proposal(draft, valid), SamplingParams.of(sampling, B, V), keys


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_forced_rates_decide_the_count_and_the_lossless_verifier_the_rest(temperature):
    warp, logits, proposal, sampling, keys = _chain(specjax.Sampling(temperature=temperature))
    _, _, expected = LOSSLESS.chain(warp, logits, proposal, sampling, keys)
    for rate, accepted in ((1.0, [K, 2, 0]), (0.0, [0, 0, 0])):
        forced = ForcedVerifier((rate,) * K, LOSSLESS)
        candidates, num_accepted, forced_expected = forced.chain(warp, logits, proposal, sampling, keys)
        assert num_accepted.tolist() == accepted
        np.testing.assert_array_equal(forced_expected, expected)  # the analytic rate is the real one
        for b, n in enumerate(accepted):
            row = np.asarray(candidates[b])
            assert row[:n].tolist() == np.asarray(proposal.draft_tokens[b, :n]).tolist()
            assert row[n] >= 0 and (row[n + 1 :] == -1).all()
            if temperature == 0:  # the token after the accepted drafts is the target's own choice
                assert row[n] == int(jnp.argmax(logits[b, n]))
