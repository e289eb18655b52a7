"""How the CPU kernels share a call's work between threads (specjax/kernels/kernels.h), checked in
C++ with a pool of plain threads: on this machine XLA's pool has as many threads as cores, so the
products' own tests reach only what two threads do."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jax

from specjax import kernels

CHECK = Path(__file__).with_name("threads_check.cc")


def test_run_from_both_ends_runs_every_unit_once_in_each_threads_order(tmp_path):
    """1 to 9 threads over 0 to 301 units, the pool's tasks starting at once, only after the call
    has returned, or half of them so (a segment whose back thread never comes): every unit runs
    exactly once, before the call returns; a thread keeps one direction and takes a segment's units
    in its order."""
    binary = tmp_path / "threads_check"
    command = [kernels._compiler(), "-O1", "-std=c++17", "-pthread", "-w", f"-I{kernels.HEADER.parent}"]
    command += [f"-I{jax.ffi.include_dir()}", str(CHECK), "-o", str(binary)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
