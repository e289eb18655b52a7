"""Compiled programs are kept for reuse, and all dropped when the process nears the kernel's limit
of memory maps (a long sweep hit it: XLA then fails to compile)."""

import gc

from tiny import tiny_model

import specjax
from specjax import api

TARGET = tiny_model(seed=1)


def test_programs_are_reused_and_freed_near_the_map_limit(monkeypatch):
    specjax.generate(TARGET, [[1, 2, 3]], max_new_tokens=8)
    count = api.compiled_program_count()
    specjax.generate(TARGET, [[4, 5]], max_new_tokens=8)  # the same program
    assert api.compiled_program_count() == count
    held, limit = api._memory_maps()
    assert 0 < held < limit
    monkeypatch.setattr(api, "MAX_MAP_FRACTION", held / limit / 2)  # as if near the limit
    assert api._free_programs_near_the_map_limit()
    gc.collect()
    assert not api._COMPILED
    assert api._memory_maps()[0] < held  # the executables' maps are gone
    specjax.generate(TARGET, [[1, 2, 3]], max_new_tokens=8)  # compiles again, and works
    assert api.compiled_program_count() == count + 1
