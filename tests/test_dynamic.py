"""Dynamic speculation length per row (Dynamic with HF's heuristic and the goodput controller) and
synthetic acceptance (ForcedAcceptance), on tiny random models.

The exact checks drive the schedules with forced acceptance, where every step's outcome is known
in advance, so the loop's k sequence can be predicted by hand; greedy equality with plain decoding
checks that masking per row stays lossless, with model drafts accepted part of the time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, check_drafted_acceptance, layered_target, noisy_copy, trained_medusa
from laws import check_counts

import specjax
from specjax.models import MedusaHead
from specjax.speculate import GoodputSchedule, HeuristicSchedule

# A target whose second layer adds small updates (tests/drafters.py): SelfDraft, a noisy copy of
# it and Medusa heads trained on its continuations draft it part of the time (seed 15 hardly
# repeats a token, so drafts that are right only on runs accept nearly nothing).
TARGET = layered_target(seed=15, late_scale=0.3)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 9], [10, 11, 12, 13, 14, 15, 10, 11, 12], [40, 41, 42, 40, 41]]


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=32).tokens


GOODPUT = GoodputSchedule(draft_cost=0.2, verify_cost=0.1)
PROPOSERS = {  # made when a test runs: the noisy copy and the trained heads take a moment
    "ngram-heuristic": lambda: specjax.Dynamic(specjax.NGram(k=4, n_max=2)),
    "selfdraft-heuristic": lambda: specjax.Dynamic(specjax.SelfDraft(layers=1, k=4)),
    "selfdraft-goodput": lambda: specjax.Dynamic(specjax.SelfDraft(layers=1, k=4), GOODPUT),
    "draft-heuristic": lambda: specjax.Dynamic(specjax.DraftModel(noisy_copy(TARGET, noise=0.05), k=4)),
    "medusa-heuristic": lambda: specjax.Dynamic(specjax.Medusa(trained_medusa(TARGET, num_heads=3))),
}


@pytest.mark.parametrize(
    "name",
    [
        "ngram-heuristic",
        pytest.param("selfdraft-heuristic", marks=pytest.mark.slow),
        "selfdraft-goodput",
        pytest.param("draft-heuristic", marks=pytest.mark.slow),  # 8 s; a draft model's cache as SelfDraft's
        "medusa-heuristic",
    ],
)
def test_dynamic_greedy_equals_plain_without_recompiling(plain_greedy, name):
    proposer = PROPOSERS[name]()
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=32)
    assert result.tokens == plain_greedy
    m = result.metrics
    assert m.drafted.sum() > 0 and m.accept_hist.sum() == m.drafting_steps.sum()
    if name == "selfdraft-goodput":  # its k seldom reaches 4: a band on the drafts verified (0.69)
        check_drafted_acceptance(m, 0.4, 0.9)
    elif name != "ngram-heuristic":  # model drafts accept part of the time: 0.10 to 0.66 here
        check_acceptance(m, 0.05, 0.9)
    compiled = specjax.programs.compiled_program_count()
    other = [p[:-1] for p in PROMPTS]  # new prompt lengths, same bucket: the same program
    specjax.generate(TARGET, other, proposer=proposer, max_new_tokens=32)
    assert specjax.programs.compiled_program_count() == compiled


def _forced_loop(schedule, k=8, max_new_tokens=40):
    proposer = specjax.Dynamic(specjax.ForcedAcceptance(1.0, k=k), schedule)
    return specjax.generate(TARGET, [[1, 2, 3]], proposer=proposer, max_new_tokens=max_new_tokens).metrics


def test_heuristic_schedule_in_the_loop_follows_hf_rule():
    # Every draft accepted: k runs 1, 3, 5, 7, 8, 8, ... (+2 per full acceptance, at most K = 8), and
    # a step emits k + 1 tokens: 1 (prefill) + 2 + 4 + 6 + 8 = 21, then 9 per step up to 40 tokens.
    m = _forced_loop(HeuristicSchedule(initial_k=1))
    expected = np.zeros(9, int)
    expected[[1, 3, 5, 7]] = 1
    expected[8] = 3
    np.testing.assert_array_equal(m.accept_hist.sum(0), expected)
    assert m.steps.sum() == 7 and m.emitted.sum() == 40
    # The drafts past each step's k were never verified: 1 + 3 + 5 + 7 + 3 * 8 = 40 drafted.
    assert m.drafted.sum() == 40


def test_heuristic_schedule_update_rule():
    schedule = HeuristicSchedule()
    state = HeuristicSchedule().init(5, 8).replace(k=jnp.array([1, 4, 8, 3, 2]))
    num_accepted = jnp.array([1, 2, 8, 0, 0])
    num_drafted = jnp.array([1, 4, 8, 3, 0])  # the last row drafted nothing (an n-gram miss)
    new = schedule.update(state, num_accepted, num_drafted, 8)
    np.testing.assert_array_equal(new.k, [3, 3, 8, 2, 2])
    assert int(schedule.init(2, 8).k[0]) == 8 and int(HeuristicSchedule(initial_k=2).init(2, 8).k[0]) == 2


@pytest.mark.parametrize("draft_cost, verify_cost", [(0.0, 0.1), (0.3, 0.1), (0.05, 0.02), (2.0, 1.0)])
def test_goodput_best_k_matches_float64_formula(draft_cost, verify_cost):
    schedule = GoodputSchedule(draft_cost=draft_cost, verify_cost=verify_cost)
    alphas = np.array([0.0, 0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 0.999])
    K = 8

    def goodput(alpha, k):
        return sum(alpha**i for i in range(k + 1)) / (1 + (draft_cost + verify_cost) * k)

    expected = [max(range(K + 1), key=lambda k: goodput(a, k)) for a in alphas]
    got = schedule.best_k(jnp.asarray(alphas, jnp.float32), K)
    np.testing.assert_array_equal(got, expected)


def test_goodput_turns_speculation_off_and_probes_again():
    # Drafts never accepted and drafting expensive: the row goes to k = 0 (one-token passes) and
    # then drafts one token every probe_every = 10 steps. From the prior (alpha 0.5, weight 2) the
    # estimate after n failures is about 1 / (2 + n) (decay 0.999), and k = 1 pays while
    # (1 + alpha) / 1.22 > 1, i.e. alpha > 0.22: n = 0, 1, 2 draft (alpha 0.5, 0.33, 0.25), n = 3
    # (0.2) stops. So 3 drafting steps, then 9 idle steps and a probe, 7 times in the other 76.
    schedule = GoodputSchedule(draft_cost=0.17, verify_cost=0.05, decay=0.999, probe_every=10)
    proposer = specjax.Dynamic(specjax.ForcedAcceptance(0.0, k=4), schedule)
    m = specjax.generate(TARGET, [[1, 2, 3]], proposer=proposer, max_new_tokens=80).metrics
    assert m.accepted.sum() == 0 and m.steps.sum() == 79
    assert m.drafting_steps.sum() == 3 + 7
    assert m.drafted.sum() == m.drafting_steps.sum()  # every step drafts one token (k = 1)


def test_goodput_schedule_update_tracks_acceptance():
    schedule = GoodputSchedule(draft_cost=0.0, verify_cost=0.1, decay=0.5, prior=0.5, prior_weight=2.0)
    state = schedule.init(1, 8)
    for _ in range(20):  # always 3 of 4 accepted: alpha -> 3 / 4
        state = state.replace(k=jnp.array([4]))
        state = schedule.update(state, jnp.array([3]), jnp.array([4]), 8)
    before = state
    state = schedule.update(state, jnp.array([0]), jnp.array([0]), 8)  # no drafts: no evidence
    assert float(state.reached[0]) == float(before.reached[0]) and int(state.idle[0]) == 1
    accepted, reached = float(state.accepted[0]), float(state.reached[0])
    np.testing.assert_allclose(accepted, 3 * 2 * (1 - 0.5**20), rtol=1e-5)  # 3 / (1 - decay), geometric
    np.testing.assert_allclose(reached, 4 * 2 * (1 - 0.5**20), rtol=1e-5)
    np.testing.assert_allclose(float(schedule.alpha(state)[0]), (6 + 1) / (8 + 2), rtol=1e-4)


def test_forced_acceptance_follows_its_rates():
    """The acceptances at each position are Bernoulli draws at its rate: the 6 sigma + 2 bound,
    and tests/laws.py's check (6 sigma + 3 and a G-test at false-alarm rate 1e-6, tighter here:
    4.9 sigma). 64 rows of 200 tokens (was 8: 3 s more) reach position 3 about 790 times, where a
    rate off by 0.11 is detected with probability 0.9 (0.33 with 8 rows); 0.045 at position 0."""
    rates = [0.9, 0.6, 0.3, 0.5]
    proposer = specjax.ForcedAcceptance(rates)
    m = specjax.generate(TARGET, [[1, 2, 3]] * 64, proposer=proposer, max_new_tokens=200).metrics
    accepted, reached = m.accepted_at.sum(0), m.reached_at.sum(0)
    for i, rate in enumerate(rates):
        n = reached[i]
        assert n > 50  # position 4 is reached on 0.9 * 0.6 * 0.3 = 16% of steps
        bound = 6 * np.sqrt(n * rate * (1 - rate)) + 2
        assert abs(accepted[i] - n * rate) <= bound, (i, accepted[i], n, rate)
        check = check_counts([accepted[i], n - accepted[i]], [rate, 1 - rate], f"acceptance at position {i}")
        assert check.detectable_shift < 0.12, check
    assert m.drafted.sum() == 4 * m.steps.sum()


def test_forced_acceptance_with_a_real_proposer_and_a_tree():
    # Free drafts at 1.0: every step emits k + 1 tokens.
    m = specjax.generate(
        TARGET, [[1, 2]], proposer=specjax.ForcedAcceptance(1.0, k=3), max_new_tokens=33
    ).metrics
    assert m.steps.sum() == 8 and (m.accept_hist.sum(0) == [0, 0, 0, 8]).all()
    # A Medusa tree is forced along its first-ranked path (depth 2 here, of a depth-3 tree).
    head = MedusaHead.init(TARGET, num_heads=3, key=jax.random.key(0), scale=0.5)
    tree = [(0,), (1,), (0, 0), (1, 0), (1, 0, 0)]
    proposer = specjax.ForcedAcceptance(1.0, specjax.Medusa(head, tree=tree))
    m = specjax.generate(TARGET, [[1, 2]], proposer=proposer, max_new_tokens=31).metrics
    assert m.steps.sum() == 10 and (m.accept_hist.sum(0) == [0, 0, 10, 0]).all()
    # The forced drafts are committed as drafted: the output holds the proposer's tokens.
    result = specjax.generate(
        TARGET,
        [[1, 2]],
        proposer=specjax.ForcedAcceptance(1.0, specjax.NGram(k=2, n_max=1)),
        max_new_tokens=9,
    )
    assert len(result.tokens[0]) == 9


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: specjax.ForcedAcceptance(1.5, k=2), "acceptance must be a number in"),
        (lambda: specjax.ForcedAcceptance([0.5, 0.5], k=3), "2 rates for k=3"),
        (lambda: specjax.ForcedAcceptance(0.5), None),
        (lambda: specjax.ForcedAcceptance(0.5, k=0), "k must be an integer in 1.."),
        (lambda: specjax.Dynamic(None), "Dynamic proposer must be a proposer"),
        (lambda: specjax.Dynamic(specjax.NGram(), "heuristic"), "Dynamic schedule must be one of"),
        (lambda: GoodputSchedule(decay=1.0), r"decay must be in \[0.0, 1.0\)"),
        (lambda: GoodputSchedule(draft_cost=-1), "draft_cost must be in"),
        (lambda: HeuristicSchedule(initial_k=0), "initial_k must be None"),
        (lambda: GoodputSchedule(probe_every=0), "probe_every must be an integer >= 1"),
        (lambda: GoodputSchedule(per_row=1), "per_row must be True or False"),
    ],
)
def test_bad_arguments(make, match):
    if match is None:
        assert make().k == 1  # one rate, no proposer: one draft position
        return
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("seed", range(4))
def test_goodput_batch_k_matches_float64_formula(seed):
    """The batch's one width against a float64 enumeration: argmax over the choices w of the sum
    over running rows of 1 + rho (alpha + ... + alpha^w), over 1 + (draft_cost + verify_cost) w."""
    rng = np.random.default_rng(seed)
    K, B = 6, 8
    draft_cost, verify_cost = rng.uniform(0, 0.3), rng.uniform(0.02, 1.0)
    schedule = GoodputSchedule(draft_cost=draft_cost, verify_cost=verify_cost)
    for choices in (None, (0, 1, 2, 4, 6)):
        for _ in range(25):
            alpha, rate = rng.uniform(0, 1, B) ** 0.5, rng.uniform(0, 1, B)
            running = rng.uniform(size=B) < 0.7

            def goodput(w, alpha=alpha, rate=rate, running=running):
                rows = zip(alpha[running], rate[running], strict=True)
                gain = sum(1 + r * sum(a**i for i in range(1, w + 1)) for a, r in rows)
                return gain / (1 + (draft_cost + verify_cost) * w)

            options = range(K + 1) if choices is None else choices
            expected = max(options, key=goodput)
            alpha32, rate32 = jnp.asarray(alpha, jnp.float32), jnp.asarray(rate, jnp.float32)
            got = schedule.batch_k(alpha32, rate32, jnp.asarray(running), K, choices)
            assert int(got) == expected or goodput(int(got)) == pytest.approx(goodput(expected), rel=1e-5)


def _evidence(schedule, steps, running, K=4):
    """The schedule's state after `steps` steps in which every row is let draft, row 0 drafts 4
    tokens and accepts 3 of them, and rows 1..3 find nothing to draft."""
    state = schedule.init(4, K)
    for _ in range(steps):
        accepted, drafted = jnp.array([3, 0, 0, 0]), jnp.array([4, 0, 0, 0])
        state = schedule.update(state.replace(k=jnp.full(4, K)), accepted, drafted, K, running=running)
    return state


def test_goodput_one_row_that_pays_does_not_make_the_batch_verify_its_width():
    """Row 0 accepts 3 of 4 drafts, rows 1-3 never find a draft (an n-gram miss): alone, row 0
    pays for k = 2; in the batch, per_row keeps k = 2 for it (and so a 3-token verify pass for all
    four rows, since the step's width is the batch's largest k), the batch's own choice is 0."""
    costs = dict(draft_cost=0.0, verify_cost=0.4, decay=0.8)
    everyone, alone = jnp.ones(4, bool), jnp.arange(4) < 1
    # Row 0's alpha: (3 + 1) / (4 + 2) per step's worth of evidence, about 0.727 after 30 steps
    # (prior 0.5, weight 2): E(k) / (1 + 0.4 k) = 1.23, 1.25, 1.20 for k = 1, 2, 3.
    assert int(_evidence(GoodputSchedule(**costs), 30, alone).k[0]) == 2
    assert int(_evidence(GoodputSchedule(per_row=True, **costs), 30, everyone).k[0]) == 2
    batch = GoodputSchedule(**costs)
    state = _evidence(batch, 30, everyone)
    # Rows 1-3: rho = 2 / (2 + 5) = 0.29 (drafted in none of about 5 decayed offers), alpha the
    # prior 0.5: w = 1 gives (3 x 1.14 + 1.73) / 1.4 = 3.69 tokens per unit, below plain's 4.
    assert np.asarray(state.k).tolist() == [0, 0, 0, 0]
    offers = (1 - 0.8**30) / (1 - 0.8)  # decayed count of 30 offers
    np.testing.assert_allclose(batch.draft_rate(state)[1:], 2.0 / (2.0 + offers), rtol=1e-4)
    assert float(batch.draft_rate(state)[0]) == pytest.approx(1.0)


def test_goodput_batch_probes_take_the_share_of_time_they_take_one_row():
    """With speculation off, a lone row probes every probe_every steps; four rows whose verified
    token costs four times as much probe four times more rarely."""
    table = ((1, 0.1), (4, 0.4))

    def probe_steps(rows):
        schedule = GoodputSchedule(draft_cost=0.0, verify_cost_by_rows=table, probe_every=8, decay=0.999)
        running = jnp.arange(4) < rows
        state, probes = schedule.init(4, 4), []
        for step in range(200):  # every draft rejected: k drops to 0, then probes
            k = int(state.k[0])
            drafted = jnp.where(running, k, 0)
            state = schedule.update(state, jnp.zeros(4, jnp.int32), drafted, 4, running=running)
            if k > 0 and step > 20:
                probes.append(step)
        return np.diff(probes)

    assert set(probe_steps(1).tolist()) == {8}
    assert set(probe_steps(4).tolist()) == {32}


def test_goodput_verify_cost_by_rows_interpolates_the_running_count():
    table = ((1, 0.05), (4, 0.2), (16, 1.0))
    schedule = GoodputSchedule(verify_cost=0.05, verify_cost_by_rows=table)
    rows, costs = np.array([r for r, _ in table], float), np.array([c for _, c in table], float)
    for running in (1, 2, 3, 4, 9, 16):
        mask = jnp.arange(16) < running
        expected = np.interp(running, rows, costs)
        assert float(schedule.verify_cost_at(mask)) == pytest.approx(expected, rel=1e-6)
    assert float(schedule.verify_cost_at(jnp.zeros(16, bool))) == pytest.approx(0.05)  # below: the first
    assert schedule.verify_cost_at(None) == 0.05
    with pytest.raises(ValueError, match="verify_cost_by_rows must be None or"):
        GoodputSchedule(verify_cost_by_rows=((4, 0.1), (2, 0.2)))
    with pytest.raises(ValueError, match="verify_cost_by_rows must be None or"):
        GoodputSchedule(verify_cost_by_rows=((1, -0.1),))


def test_goodput_drafts_less_as_more_rows_run(plain_greedy):
    """A verify cost that grows with the rows running: one row alone drafts at k = 4 (cheap to
    verify), four rows together stop drafting (probes aside), and both stay lossless."""
    schedule = GoodputSchedule(draft_cost=0.0, verify_cost=0.0, verify_cost_by_rows=((1, 0.0), (4, 5.0)))
    proposer = specjax.Dynamic(specjax.NGram(k=4, n_max=2), schedule)
    together = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=32)
    assert together.tokens == plain_greedy
    alone = specjax.generate(TARGET, PROMPTS[:1], proposer=proposer, max_new_tokens=32)
    assert alone.tokens == plain_greedy[:1]
    per_step = lambda m, b: m.drafted[b] / m.steps[b]  # noqa: E731
    assert per_step(alone.metrics, 0) > 4 * per_step(together.metrics, 0) + 0.5


def test_measure_times_each_batch_size(monkeypatch):
    from specjax.speculate.proposers import dynamic

    def meter(model, proposer, prompts, max_new_tokens):
        return {"draft_cost": 0.01, "verify_cost": 0.1 * len(prompts), "plain_step_s": 0.01, "k": 3}

    monkeypatch.setattr(dynamic, "_cost_meter", meter)
    schedule = GoodputSchedule.measure("model", specjax.NGram(k=3), ["a", "b"], batch_sizes=[4, 1])
    assert schedule.verify_cost == pytest.approx(0.1) and schedule.draft_cost == 0.01
    assert schedule.verify_cost_by_rows == ((1, pytest.approx(0.1)), (4, pytest.approx(0.4)))


def test_goodput_join_gives_an_arriving_row_the_batch_k():
    """A row prefilled alone starts at the prior's k; joining a running batch whose one k is 0 it
    takes 0 (it would otherwise make every row draft at its k on the next step) and the batch's
    steps since it drafted (its next probe stays due when it was); per_row keeps the row's own,
    and so does a batch with no row running."""
    schedule = GoodputSchedule(verify_cost=0.05)
    row = schedule.init(1, 4)
    assert int(row.k[0]) > 0
    batch = schedule.init(3, 4).replace(k=jnp.array([0, 0, 3]), idle=jnp.array([7, 5, 0]))
    running = jnp.array([True, True, False])  # slot 2 is free (the one being filled)
    joined = schedule.join(batch, row, running)
    assert int(joined.k[0]) == 0 and int(joined.idle[0]) == 5
    assert float(joined.accepted[0]) == float(row.accepted[0])  # its own estimate stays the prior's
    same = GoodputSchedule(verify_cost=0.05, per_row=True).join(batch, row, running)
    assert int(same.k[0]) == int(row.k[0]) and int(same.idle[0]) == 0
    empty = schedule.join(batch, row, jnp.zeros(3, bool))
    assert int(empty.k[0]) == int(row.k[0]) and int(empty.idle[0]) == 0
