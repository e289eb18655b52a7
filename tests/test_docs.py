"""Figures in the docs that the library computes: they must be what it computes now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_memory_table_in_docs_models_is_estimate_memorys():
    spec = importlib.util.spec_from_file_location("memory_table", REPO / "benchmarks" / "memory_table.py")
    memory_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_table)
    assert memory_table.table() in (REPO / "docs" / "models.md").read_text()
