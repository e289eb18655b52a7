"""GoodputSchedule.measure: the costs are timed on the host side (specjax/costs.py) and handed to
the schedule, which lives below it (speculate/proposers/dynamic.py)."""

import pytest

import specjax
from specjax.speculate.proposers import dynamic


def test_measure_builds_the_schedule_from_the_host_sides_costs(monkeypatch):
    calls = []

    def meter(model, proposer, prompts, max_new_tokens):
        calls.append((model, proposer, prompts, max_new_tokens))
        return {"draft_cost": 0.25, "verify_cost": 0.125, "plain_step_s": 0.01, "k": 3}

    monkeypatch.setattr(dynamic, "_cost_meter", meter)
    schedule = specjax.GoodputSchedule.measure("model", specjax.NGram(k=3), ["a"], 16, decay=0.8)
    assert schedule == specjax.GoodputSchedule(draft_cost=0.25, verify_cost=0.125, decay=0.8)
    assert calls == [("model", specjax.NGram(k=3), ["a"], 16)]


def test_measure_without_the_host_side_says_so(monkeypatch):
    monkeypatch.setattr(dynamic, "_cost_meter", None)
    with pytest.raises(RuntimeError, match="import specjax"):
        specjax.GoodputSchedule.measure(None, specjax.NGram(k=3), ["a"])


def test_importing_specjax_installs_measure_step_costs():
    assert dynamic._cost_meter is specjax.measure_step_costs


def test_measure_step_costs_runs_in_rounds(monkeypatch):
    """Three runs (plain, free drafts, the proposer's drafts) at two lengths per round, in turn;
    the costs come back in plain steps. A clock that advances by a known time per step (plain 1 s,
    each verified draft 0.25 s more, each drafted one 0.5 s more) makes the answer exact."""
    from tiny import tiny_model

    from specjax import costs

    model = tiny_model(seed=1)
    calls, now = [], [0.0]
    real = costs.generate

    def counted(model, prompts, proposer, sampling, max_new_tokens):
        calls.append((type(proposer).__name__, max_new_tokens))
        result = real(model, prompts, proposer, sampling, max_new_tokens=max_new_tokens)
        k = 0 if proposer is None else 2
        per_step = 1.0 + 0.25 * k + (0.5 * k if getattr(proposer, "proposer", None) is not None else 0.0)
        now[0] += 7.0 + per_step * int(result.metrics.steps.max())  # a fixed prefill, then the steps
        return result

    monkeypatch.setattr(costs, "generate", counted)
    monkeypatch.setattr(costs, "_clock", lambda: now[0])
    result = specjax.measure_step_costs(model, specjax.NGram(k=2), [[1, 2, 3]], max_new_tokens=4, rounds=2)
    assert result == {"plain_step_s": 1.0, "verify_cost": 0.25, "draft_cost": 0.5, "k": 2}
    one_round = [("NoneType", 1), ("NoneType", 4)] + [("ForcedAcceptance", 1), ("ForcedAcceptance", 4)] * 2
    assert calls == one_round * 3  # the warm-up, then two rounds
    with pytest.raises(ValueError, match="rounds must be an integer >= 1, got 0"):
        specjax.measure_step_costs(model, specjax.NGram(k=2), [[1, 2, 3]], rounds=0)


def test_measure_step_costs_refuses_runs_too_short_to_time(monkeypatch):
    """A plain step that took no time (a clock that stands still) is an error, not a cost of 0."""
    from tiny import tiny_model

    from specjax import costs

    monkeypatch.setattr(costs, "_clock", lambda: 5.0)
    with pytest.raises(RuntimeError, match="no measurable time .* max_new_tokens=4"):
        specjax.measure_step_costs(
            tiny_model(seed=1), specjax.NGram(k=2), [[1, 2, 3]], max_new_tokens=4, rounds=1
        )


def test_measure_passes_generate_options_to_the_timed_calls(monkeypatch):
    calls = []

    def meter(model, proposer, prompts, max_new_tokens, **options):
        calls.append((len(prompts), max_new_tokens, options))
        return {"draft_cost": 0.0, "verify_cost": 0.2, "plain_step_s": 0.01, "k": 3}

    monkeypatch.setattr(dynamic, "_cost_meter", meter)
    schedule = specjax.GoodputSchedule.measure(
        "model", specjax.NGram(k=3), ["a"], 8, batch_sizes=(2,), generate_options={"kernels": "xla"}
    )
    assert calls == [(2, 8, {"kernels": "xla"})]
    assert schedule.verify_cost_by_rows == ((2, 0.2),)
