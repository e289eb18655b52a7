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
