"""benchmarks/accelerator_step.py, the one prepared run a lent GPU or TPU gets: its goals are
decided from its tables as issue 67 states them, bad cases are refused before anything runs, and
(slow) the whole run works on this CPU with the GPU's kernels interpreted, so that the few minutes
of a device are not spent finding a typo."""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def accelerator_step():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its neighbours (common, memory_table)
    try:
        yield importlib.import_module("accelerator_step")
    finally:
        sys.path.remove(str(BENCHMARKS))


def product(rows, kind, form, us):
    return [rows, kind, form, "(128, 64)", us, 0.0]


def step(weights, batch, proposer, ms, kernels="auto"):
    return [weights, batch, proposer, kernels, "unrolled", ms, 0.0, 0.0]


def test_goals_are_the_issues_ratios(accelerator_step):
    products = [
        product(1, "bfloat16", "dot", 50.0),
        product(1, "int8", "pallas", 30.0),  # 0.6: met (at most)
        product(1, "int8", "in_product", 10.0),  # XLA's form: no goal
        product(1, "int4-g32", "pallas", 20.0),  # 0.4 > 0.35
        product(8, "bfloat16", "dot", 100.0),
        product(8, "int4-g32", "pallas", 30.0),
        product(40, "bfloat16", "dot", 100.0),
        product(40, "int8", "pallas", 100.0),  # no goal at a verify pass's rows
        product(8, "int8", "pallas", "failed: ValueError: no tile"),  # a case that raised: undecided
    ]
    steps = [
        step("bfloat16", 1, "plain", 5.0),
        step("bfloat16", 1, "plain", 1.0, kernels="xla"),  # not the first kernels timed: ignored
        step("int8", 1, "plain", 3.0),
        step("int4", 1, "plain", 2.6),
        step("int8", 8, "plain", 4.0),
        step("int8", 8, "verify-k4", 5.0),
        step("int4", 8, "verify-k4", 9.0),  # its plain step at 8 did not run: undecided
        step("bfloat16", 8, "plain", "failed: RuntimeError"),
        step("bfloat16", 8, "verify-k4", 6.0),  # against a plain step that raised: undecided
    ]
    decided = {
        what: (round(ratio, 6), goal, met)
        for what, ratio, goal, met in accelerator_step.goals(products, steps)
    }
    assert decided == {
        "int8 product / bfloat16's, 1 rows": (0.6, 0.6, True),
        "int4-g32 product / bfloat16's, 1 rows": (0.4, 0.35, False),
        "int4-g32 product / bfloat16's, 8 rows": (0.3, 0.35, True),
        "int8 step / bfloat16's, batch 1": (0.6, 0.7, True),
        "int4 step / bfloat16's, batch 1": (0.52, 0.5, False),
        "int8 verify of 5 tokens / plain step, batch 8": (1.25, 1.3, True),
    }


@pytest.mark.parametrize(
    "case", ["int3/1/plain", "int8/one/plain", "int8/1/eagle", "int8/1", "int8/1/verify-kx"]
)
def test_a_bad_case_is_refused_before_anything_runs(accelerator_step, case):
    with pytest.raises(SystemExit, match=rf"--cases: '{case}' is not weights/batch/proposer"):
        accelerator_step.main(["--parts", "time", "--cases", case])


@pytest.mark.slow
def test_the_prepared_run_works_on_a_cpu(accelerator_step, tmp_path):
    """Every default part at a tiny size with the GPU's kernels interpreted: the tables are
    written, the quantized kernels multiply every weight they tile and give the XLA path's tokens,
    and the goals are decided from what ran."""
    accelerator_step.main(
        [
            *("--parts", "products", "quantized-check", "time"),
            *("--out", str(tmp_path), "--size", "tiny", "--product-shape", "256", "512"),
            *("--product-rows", "1", "8", "--tile-rows", "1", "--copies", "2", "--repeats", "1"),
            *(
                "--kernels",
                "pallas:cuda",
                "--check-kernels",
                "pallas:cuda",
                "--check-weights",
                "int8",
                "int4",
            ),
            *("--short-steps", "2", "--long-steps", "5"),
            *("--cases", "bfloat16/1/plain", "int8/1/plain", "int4/8/plain", "int4/8/verify-k4"),
        ]
    )
    tables = json.loads((tmp_path / "accelerator_step.json").read_text())
    assert {(r[0], r[1], r[2]) for r in tables["products"]} >= {
        (rows, kind, form)
        for rows in (1, 8)
        for kind in ("int8", "int4-g32")
        for form in ("pallas", "in_product")
    }
    assert tables["tiles"] and all(us > 0 for *_, us in tables["tiles"])
    assert [(r[0], r[1], r[2]) for r in tables["time"]] == [
        ("bfloat16", 1, "plain"),
        ("int8", 1, "plain"),
        ("int4", 8, "plain"),
        ("int4", 8, "verify-k4"),
    ]
    for kind, kernel_weights, proposer, same, *_ in tables["quantized-check"]:
        assert same == "4/4", (kind, proposer)
        # every weight but the LM head (97 outputs: no Triton tile) goes through the kernel
        assert kernel_weights == ("-" if kind == "fp8" else "15/16"), kind
    assert [g[0] for g in tables["goals"]] == [
        "int8 product / bfloat16's, 1 rows",
        "int4-g32 product / bfloat16's, 1 rows",
        "int8 product / bfloat16's, 8 rows",
        "int4-g32 product / bfloat16's, 8 rows",
        "int8 step / bfloat16's, batch 1",
        "int4 verify of 5 tokens / plain step, batch 8",
    ]
    assert "Issue 67's timing goals" in (tmp_path / "accelerator_step.md").read_text()


def test_a_case_that_raises_is_recorded_and_the_next_runs(accelerator_step, monkeypatch):
    """One failing case (a kernel that does not compile on the device, say) becomes a cell naming
    the error; the other cases still run."""
    calls = []

    def step_ms(model, batch, proposer_name, *rest):
        calls.append((batch, proposer_name))
        if proposer_name == "plain":
            raise RuntimeError("Triton: out of registers\nmore detail")
        return 2.0

    monkeypatch.setattr(accelerator_step, "step_ms", step_ms)
    monkeypatch.setattr(
        accelerator_step, "timing_model", lambda size, weights: accelerator_step.check_model(64)
    )
    args = types.SimpleNamespace(
        cases=["bfloat16/1/plain", "bfloat16/8/verify-k4"],
        kernels=["auto"],
        layers=["unrolled"],
        budget_s=1e9,
        size="tiny",
    )
    rows = accelerator_step.time_steps(args)
    assert calls == [(1, "plain"), (8, "verify-k4")]
    assert rows[0][5] == "failed: RuntimeError: Triton: out of registers"
    assert rows[1][5] == 2.0
