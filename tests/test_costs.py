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
    the costs come back in plain steps, never below 0; a bad number of rounds is refused."""
    from tiny import tiny_model

    from specjax import costs

    model = tiny_model(seed=1)
    calls = []
    real = costs.generate

    def counted(model, prompts, proposer, sampling, max_new_tokens):
        calls.append((type(proposer).__name__, max_new_tokens))
        return real(model, prompts, proposer, sampling, max_new_tokens=max_new_tokens)

    monkeypatch.setattr(costs, "generate", counted)
    result = specjax.measure_step_costs(model, specjax.NGram(k=2), [[1, 2, 3]], max_new_tokens=4, rounds=2)
    assert result["k"] == 2 and result["plain_step_s"] > 0
    assert result["verify_cost"] >= 0 and result["draft_cost"] >= 0
    one_round = [("NoneType", 1), ("NoneType", 4)] + [("ForcedAcceptance", 1), ("ForcedAcceptance", 4)] * 2
    assert calls == one_round * 3  # the warm-up, then two rounds
    with pytest.raises(ValueError, match="rounds must be an integer >= 1, got 0"):
        specjax.measure_step_costs(model, specjax.NGram(k=2), [[1, 2, 3]], rounds=0)
