"""Hybrid drafting: per row, the first proposer's drafts where it has any, the second's otherwise.
Greedy output equals plain decoding (n-gram + EAGLE-3, n-gram + a draft model, batch 1 and 4),
sampled output with a sampling draft model reproduces, and the per-proposer counts add up. The
heads are built from the target's first layer, so their drafts are accepted part of the time."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_part_acceptance, first_layer_dflash, first_layer_eagle3, quiet_target
from tiny import tiny_model

import specjax
from specjax.speculate.loop import smallest_width
from specjax.speculate.proposers import Capabilities, Proposal, Proposer, Stateless

# A target whose first layer asks one query whatever the token, with quiet embeddings and small
# later layers, and EAGLE-3 and DFlash heads built from that layer (tests/drafters.py): their drafts
# are accepted part of the time, in the band HEAD_BAND (check_part_acceptance: 0.19 to 0.63 here).
TARGET = quiet_target(seed=11, num_layers=4, embed_scale=0.01, constant_queries=True)
DRAFT = tiny_model(seed=12, num_layers=1)
HEAD = first_layer_eagle3(TARGET, aux_layer_ids=(1, 2, 4))
FLASH = first_layer_dflash(TARGET, block_size=5, aux_layer_ids=(0, 3))
HEAD_BAND = (0.1, 0.9)
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


@pytest.mark.parametrize(
    "first, then",
    [  # NGram beside EAGLE-3 (19 s) in make test-all; EAGLE-3 and Hybrid are each in the default set
        pytest.param(specjax.NGram(k=3, n_min=2), specjax.Eagle3(HEAD, k=4), marks=pytest.mark.slow),
        (specjax.NGram(k=4), specjax.DFlash(FLASH)),
    ],
    ids=["ngram+eagle3", "ngram+dflash"],
)
def test_hybrid_greedy_equals_plain(plain_greedy, first, then):
    proposer = specjax.Hybrid(first, then)
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    assert (
        specjax.generate(TARGET, PROMPTS[:1], proposer=proposer, max_new_tokens=24).tokens == plain_greedy[:1]
    )
    counts = result.metrics.proposer
    m = result.metrics
    # every drafting step drafted from exactly one of the two; their accepted drafts add up
    np.testing.assert_array_equal(counts["first_steps"] + counts["then_steps"], m.drafting_steps)
    np.testing.assert_array_equal(counts["first_accepted"] + counts["then_accepted"], m.accepted)
    np.testing.assert_array_equal(counts["first_drafted"] + counts["then_drafted"], m.drafted)
    assert counts["first_steps"].sum() > 0 and counts["then_steps"].sum() > 0  # both were used
    check_part_acceptance(m, "then", *HEAD_BAND)


FREE = specjax.GoodputSchedule(draft_cost=0.0, verify_cost=0.0)  # drafting never costs: always pays
DEAR = specjax.GoodputSchedule(draft_cost=1.0, verify_cost=1.0, probe_every=8)  # never pays


@pytest.mark.parametrize(
    "first, then",
    [
        pytest.param(specjax.NGram(k=3, n_min=2), specjax.Eagle3(HEAD, k=4), marks=pytest.mark.slow),
        (specjax.NGram(k=4), specjax.DFlash(FLASH)),
    ],
    ids=["ngram+eagle3", "ngram+dflash"],
)
def test_a_gate_that_always_pays_changes_nothing(plain_greedy, first, then):
    """With free drafting the gate lets `then` draft wherever `first` has nothing, as without one:
    the same tokens and the same per-part counts, and nothing held back."""
    ungated = specjax.generate(TARGET, PROMPTS, proposer=specjax.Hybrid(first, then), max_new_tokens=24)
    gated = specjax.generate(
        TARGET, PROMPTS, proposer=specjax.Hybrid(first, then, gate=FREE), max_new_tokens=24
    )
    assert gated.tokens == ungated.tokens == plain_greedy
    held = gated.metrics.proposer.pop("then_held_back")
    assert not held.any()
    expected = dict(ungated.metrics.proposer)
    assert not expected.pop("then_held_back").any()
    assert gated.metrics.proposer.keys() == expected.keys()
    for name, counts in expected.items():
        np.testing.assert_array_equal(gated.metrics.proposer[name], counts, err_msg=name)
    check_part_acceptance(gated.metrics, "then", *HEAD_BAND)


@pytest.mark.parametrize("batch", [1, 4])
def test_a_gate_holds_back_a_second_proposer_that_does_not_pay(plain_greedy, batch):
    """Where drafting costs more than acceptance can repay, a row falls back to plain steps, and
    the second part drafts only on probes (one step in `probe_every` without its drafts), while
    the first keeps drafting where it matches. Greedy output stays plain's."""
    proposer = specjax.Hybrid(specjax.NGram(k=3, n_min=2), specjax.Eagle3(HEAD, k=4), gate=DEAR)
    result = specjax.generate(TARGET, PROMPTS[:batch], proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy[:batch]
    counts, m = result.metrics.proposer, result.metrics
    np.testing.assert_array_equal(counts["first_steps"] + counts["then_steps"], m.drafting_steps)
    np.testing.assert_array_equal(counts["first_accepted"] + counts["then_accepted"], m.accepted)
    # every step: drafted by the first, by the second, or held back
    np.testing.assert_array_equal(
        counts["first_steps"] + counts["then_steps"] + counts["then_held_back"], m.steps
    )
    assert counts["then_held_back"].sum() > 0
    assert (counts["then_steps"] <= m.steps // DEAR.probe_every).all(), counts["then_steps"]
    if batch == 4:
        assert counts["first_steps"].sum() > 0  # the n-gram rows still draft
    check_part_acceptance(m, "then", *HEAD_BAND)  # its probes' drafts


def test_gate_choices_weigh_all_drafts_or_none():
    """The gate's decision is the goodput of the whole k against a plain step: open above the
    break-even acceptance, closed below, from the row's own evidence."""
    gate = specjax.GoodputSchedule(draft_cost=0.08, verify_cost=0.15, decay=0.5, prior_weight=1.0)
    K = 4
    # cost(4) = 1 + 0.23 * 4 = 1.92; E(4) at alpha: 1 + a + a^2 + a^3 + a^4 > 1.92 from a ~ 0.49
    state = gate.init(2, K)
    for _ in range(12):  # row 0 accepts every draft, row 1 none
        state = gate.update(state, jnp.asarray([4, 0]), jnp.asarray([4, 4]), K, (0, K))
    assert state.k.tolist() == [K, 0]
    alpha = jnp.asarray([0.45, 0.55])
    assert gate.best_k(alpha, K, (0, K)).tolist() == [0, K]


# -- Parts of different lengths: a long drafter and a short one ------------------------------------


# The default set runs EAGLE-3 ungated and DFlash gated; `make test-all` the other two.
@pytest.mark.parametrize(
    "then, gate",
    [
        pytest.param(specjax.Eagle3(HEAD, k=1), None, id="ungated-ngram5+eagle3_k1", marks=pytest.mark.slow),
        pytest.param(specjax.DFlash(FLASH, block=3), FREE, id="gated-ngram5+dflash_block3"),
        pytest.param(specjax.Eagle3(HEAD, k=1), FREE, id="gated-ngram5+eagle3_k1", marks=pytest.mark.slow),
        pytest.param(
            specjax.DFlash(FLASH, block=3), None, id="ungated-ngram5+dflash_block3", marks=pytest.mark.slow
        ),
    ],
)
def test_parts_of_different_lengths_equal_plain(plain_greedy, then, gate):
    """NGram drafting 5 beside a head drafting 1 or 2: the head catches up on up to 5 accepted
    n-gram drafts a step, each step verifies as wide as its rows drafted, and greedy output is
    plain's at batch 1 and 4; the counts add up and no row's head step verified more than its k."""
    proposer = specjax.Hybrid(specjax.NGram(k=5, n_min=2), then, gate=gate)
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    alone = specjax.generate(TARGET, PROMPTS[:1], proposer=proposer, max_new_tokens=24)
    assert alone.tokens == plain_greedy[:1]
    counts, m = result.metrics.proposer, result.metrics
    np.testing.assert_array_equal(counts["first_steps"] + counts["then_steps"], m.drafting_steps)
    np.testing.assert_array_equal(counts["first_accepted"] + counts["then_accepted"], m.accepted)
    np.testing.assert_array_equal(counts["first_drafted"] + counts["then_drafted"], m.drafted)
    assert (counts["then_drafted"] <= then.k * counts["then_steps"]).all()
    assert counts["first_accepted"].max() > then.k  # the head caught up on longer acceptances
    assert counts["then_steps"].sum() > 0
    assert result.metrics.num_speculative_tokens == 5
    check_part_acceptance(m, "then", *HEAD_BAND)


def test_verify_widths_of_a_hybrid():
    """A Hybrid of a long and a short part verifies at either width; of equal parts, at k alone."""
    mixed = specjax.Hybrid(specjax.NGram(k=5), specjax.Eagle3(HEAD, k=1)).spec(TARGET)
    assert mixed.capabilities.verify_widths == (1, 5) and mixed.k == 5
    assert mixed.then.accepts == 5 and mixed.then.k == 1
    equal = specjax.Hybrid(specjax.NGram(k=4), specjax.Eagle3(HEAD, k=4)).spec(TARGET)
    assert equal.capabilities.verify_widths is None


def test_smallest_width_covers_every_running_row():
    """The loop's choice of verify pass: the smallest width at least every running row's drafts;
    finished rows do not count; no drafts at all picks the one-token pass (width 0)."""
    widths = (0, 1, 5)

    def valid(counts):
        return jnp.arange(5)[None, :] < jnp.asarray(counts)[:, None]

    running = jnp.asarray([True, True, False])
    assert int(smallest_width(widths, valid([1, 0, 5]), running)) == 1
    assert int(smallest_width(widths, valid([1, 3, 0]), running)) == 2
    assert int(smallest_width(widths, valid([0, 0, 5]), running)) == 0
    assert int(smallest_width(widths, valid([5, 1, 1]), running)) == 2
    assert int(smallest_width((0, 4), valid([2, 2, 2]), running)) == 1


@dataclasses.dataclass(frozen=True)
class _Guess(Stateless):
    """A proposer with state it cannot widen (it does not catch up): its last token once."""

    k: int = 1
    capabilities = Capabilities()  # stands for a state sized by its own k

    def propose(self, ctx, state):
        last = ctx.tokens[jnp.arange(ctx.tokens.shape[0]), ctx.lengths - 1][:, None]
        return Proposal(last, jnp.ones(last.shape, bool)), state


class _OneGuess(Proposer):
    def spec(self, target, warp=None, mesh=None):
        return _Guess()

    def params(self, target):
        return None


def test_hybrid_sampled_reproduces():
    proposer = specjax.Hybrid(specjax.NGram(k=4), specjax.Eagle3(HEAD, k=4))
    sampling = specjax.Sampling(temperature=0.8, seed=4)
    first = specjax.generate(TARGET, PROMPTS, proposer=proposer, sampling=sampling, max_new_tokens=16)
    again = specjax.generate(TARGET, PROMPTS, proposer=proposer, sampling=sampling, max_new_tokens=16)
    assert first.tokens == again.tokens


def test_bad_hybrid_arguments():
    medusa = specjax.models.MedusaHead.init(TARGET, num_heads=2)
    with pytest.raises(ValueError, match="Hybrid then drafts a token tree"):
        specjax.generate(
            TARGET,
            [[1, 2]],
            proposer=specjax.Hybrid(specjax.NGram(), specjax.Medusa(medusa, tree=[(0,), (1,)])),
            max_new_tokens=2,
        )
    with pytest.raises(ValueError, match="a DraftModel or SelfDraft keeps a cache"):
        specjax.generate(
            TARGET, [[1, 2]], proposer=specjax.Hybrid(specjax.NGram(), specjax.DraftModel(DRAFT))
        )
    with pytest.raises(ValueError, match="Hybrid then drafts k=1 but the other part k=5, and _Guess"):
        specjax.generate(TARGET, [[1, 2]], proposer=specjax.Hybrid(specjax.NGram(k=5), _OneGuess()))
    with pytest.raises(ValueError, match="Hybrid gate must be None or a specjax.GoodputSchedule"):
        specjax.Hybrid(specjax.NGram(), specjax.Eagle3(HEAD), gate=specjax.HeuristicSchedule())
    eagle1 = specjax.models.EagleHead.init(TARGET, jax.random.key(1))
    with pytest.raises(ValueError, match="different target features"):
        specjax.generate(
            TARGET,
            [[1, 2]],
            proposer=specjax.Hybrid(specjax.Eagle(eagle1), specjax.Eagle3(HEAD)),
            max_new_tokens=2,
        )
