"""The real clients the server is tested with (tests/test_clients.py): lm-evaluation-harness,
guidellm and aiperf, run as their own command-line programs from a virtual environment of
their own, `.venv-clients` at the repo root (`make .venv-clients/.installed` builds it; `make
test` does first, and without it the tests fail saying so). Their pinned dependencies (pandas,
httpx, huggingface_hub, ...) conflict with the main environment's, so they never share it: the
tests start the server in this process and the clients in child processes, which reach it over
HTTP only.

Every client runs offline (no Hugging Face hub, no dataset downloads): the tasks and the
tokenizer are local files the tests write."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CLIENTS_VENV = REPO / ".venv-clients"
CLIENTS_STAMP = ".venv-clients/.installed"  # the Makefile's target for the environment
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def client_program(name: str) -> Path:
    """The path of a client's command in .venv-clients, or fail the test saying how to build it.
    (Not a skip: `make test` builds the environment before it runs the tests, so a missing one is
    a broken setup, and a skipped client test would check nothing.)"""
    path = CLIENTS_VENV / "bin" / name
    if not (REPO / CLIENTS_STAMP).is_file() or not path.is_file():
        pytest.fail(f"the real clients' environment is missing ({path}): run `make {CLIENTS_STAMP}`")
    return path


def run_client(
    name: str, args: list[str], cwd: Path, timeout: float = 600, offline: dict | None = None
) -> tuple[str, float]:
    """Run a client's command with `args` in `cwd`, offline (the environment `offline`, default
    OFFLINE); (its output, seconds). A non-zero exit fails the test with the output's tail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "XLA_"))}
    env |= (OFFLINE if offline is None else offline) | {
        "HOME": str(cwd),
        "NO_COLOR": "1",
        "OPENAI_API_KEY": "x",
    }
    start = time.perf_counter()
    done = subprocess.run(
        [str(client_program(name)), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} exited with {done.returncode}:\n{output[-6000:]}"
    return output, seconds
