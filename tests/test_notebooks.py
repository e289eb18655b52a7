"""The notebooks in notebooks/ run end to end on small settings (SPECJAX_NOTEBOOK_SMALL=1).

Each notebook is executed by nbclient in a fresh `python3` kernel: jupyter_client starts a
kernelspec whose command is `python` with this interpreter (sys.executable), so under
`make test` the kernel is .venv's python. The kernel's working folder is notebooks/, as in
Jupyter, so the notebooks' relative paths (../heads/...) hold. Any cell error fails the test
(CellExecutionError names the cell and the traceback).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 600  # one cell at most; the small settings need well under a minute per cell


def kernel_env() -> dict[str, str]:
    """This process's environment with the small settings, without the fake CPU devices that
    conftest.py sets for the sharding tests: the notebook runs as a user's would."""
    env = dict(os.environ, SPECJAX_NOTEBOOK_SMALL="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_notebook(name: str):
    """Execute notebooks/<name> in memory (the saved file is left as it is); returns the executed
    notebook and the seconds it took."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    start = time.perf_counter()
    client.execute(env=kernel_env())  # raises CellExecutionError on the first failing cell
    return nb, time.perf_counter() - start


def outputs(nb, kind: str) -> list:
    """Outputs carrying MIME type `kind` (e.g. "image/png") over all code cells."""
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


@pytest.mark.slow  # 3-7 minutes on 2 CPU cores: over the default suite's budget
def test_quickstart_runs():
    nb, seconds = run_notebook("quickstart.ipynb")
    print(f"quickstart.ipynb (small): {seconds:.1f} s")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "same tokens as plain decoding: True" in text  # greedy EAGLE output equals plain
    assert len(outputs(nb, "image/png")) >= 1  # the per-position acceptance chart


@pytest.mark.slow  # about 2 minutes on 2 CPU cores: one compile per configuration dominates
def test_acceptance_study_runs():
    nb, seconds = run_notebook("acceptance_study.ipynb")
    print(f"acceptance_study.ipynb (small): {seconds:.1f} s")
    # acceptance curves, speedup vs k, temperature, counterfactual k, forced-acceptance overhead
    assert len(outputs(nb, "image/png")) >= 5
