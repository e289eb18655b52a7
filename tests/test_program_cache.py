"""Compiled programs are kept for reuse, and dropped, least recently used first, when the process
nears the kernel's limit of memory maps (a long sweep hit it: XLA then fails to compile)."""

import gc
import weakref

import pytest
from tiny import tiny_model

import specjax
from specjax import programs

TARGET = tiny_model(seed=1)


def test_programs_are_reused_and_freed_near_the_map_limit(monkeypatch):
    specjax.generate(TARGET, [[1, 2, 3]], max_new_tokens=8)
    count = programs.compiled_program_count()
    specjax.generate(TARGET, [[4, 5]], max_new_tokens=8)  # the same program
    assert programs.compiled_program_count() == count
    held, limit = programs._memory_maps()
    assert 0 < held < limit
    monkeypatch.setattr(programs, "MAX_MAP_FRACTION", held / limit / 2)  # as if near the limit
    with pytest.warns(RuntimeWarning, match="Raising vm.max_map_count"):  # (more than its programs')
        assert programs._free_programs_near_the_map_limit()
    gc.collect()
    assert not programs._COMPILED
    assert programs._memory_maps()[0] < held  # the executables' maps are gone
    monkeypatch.undo()  # (the limit where it was)
    specjax.generate(TARGET, [[1, 2, 3]], max_new_tokens=8)  # compiles again, and works
    assert programs.compiled_program_count() == count + 1


def test_near_the_map_limit_the_least_recently_used_programs_go_first(monkeypatch):
    """Two programs kept, the process just past the guard's fraction by fewer maps than the older
    one added: that one is dropped, the other kept (and used again without compiling)."""
    specjax.clear_compiled_programs()
    _call(1)
    _call(2)
    oldest, newest = list(programs._COMPILED)
    added = programs._COMPILED[oldest].maps
    assert added > 0  # an XLA:CPU program maps its code
    held, limit = programs._memory_maps()
    monkeypatch.setattr(programs, "MAX_MAP_FRACTION", (held - added // 2) / limit)
    with pytest.warns(RuntimeWarning, match="dropped 1 compiled programs, least recently used first"):
        assert programs._free_programs_near_the_map_limit()
    assert list(programs._COMPILED) == [newest]
    count = programs.compiled_program_count()
    _call(2)
    assert programs.compiled_program_count() == count


@pytest.fixture
def default_limits():
    yield
    specjax.set_program_cache(
        max_bytes=programs.DEFAULT_MAX_PROGRAM_BYTES, max_programs=programs.DEFAULT_MAX_PROGRAMS
    )


def _call(batch: int):
    """One generate call whose program depends on the batch size only (1, 2 and 4 are batch
    buckets of their own)."""
    specjax.generate(TARGET, [[1, 2, 3]] * batch, max_new_tokens=8)


@pytest.mark.slow  # make test-all: the default suite keeps within its 20 minutes
def test_the_budget_drops_least_recently_used_programs(default_limits):
    specjax.clear_compiled_programs()
    for batch in (1, 2, 4):
        _call(batch)
    info = specjax.program_cache_info()
    assert info.programs == 3 and info.bytes > 0
    sizes = {key[0].batch_size: p.nbytes for key, p in programs._COMPILED.items()}
    assert info.bytes == sum(sizes.values())
    _call(1)  # batch 1 is now the most recently used, batch 2 the least
    info = specjax.set_program_cache(max_bytes=info.bytes - 1)
    assert sorted(key[0].batch_size for key in programs._COMPILED) == [1, 4]
    assert info.bytes == sizes[1] + sizes[4] <= info.max_bytes
    # The program a call needs is kept even alone over the budget; the rest go.
    specjax.set_program_cache(max_bytes=0)
    assert specjax.program_cache_info().programs == 0
    count = programs.compiled_program_count()
    _call(2)
    assert [key[0].batch_size for key in programs._COMPILED] == [2]
    _call(2)  # kept: not compiled again
    assert programs.compiled_program_count() == count + 1
    specjax.set_program_cache(max_bytes=1 << 40, max_programs=2)
    _call(1)
    _call(4)
    assert [key[0].batch_size for key in programs._COMPILED] == [1, 4]


def test_a_dropped_program_is_freed():
    # jax's own caches must not keep it: only the program cache held a reference.
    specjax.clear_compiled_programs()
    _call(1)
    (program,) = [p.executable for p in programs._COMPILED.values()]
    dropped = weakref.ref(program)
    del program
    specjax.clear_compiled_programs()
    assert dropped() is None


def test_what_a_program_is_measured_to_hold():
    specjax.clear_compiled_programs()
    _call(1)
    (program,) = programs._COMPILED.values()
    module = program.executable.runtime_executable().hlo_modules()[0]
    instructions = sum(len(c.instructions()) for c in module.computations())
    estimate = instructions * programs.HOST_BYTES_PER_INSTRUCTION
    analysis = program.executable.memory_analysis()
    device = analysis.generated_code_size_in_bytes + analysis.temp_size_in_bytes
    # Without a reading of resident memory, or with an implausibly small one, the estimate.
    assert programs._measured_bytes(program.executable, None) == device + estimate
    assert programs._measured_bytes(program.executable, estimate // 5) == device + estimate
    assert programs._measured_bytes(program.executable, 3 * estimate) == device + 3 * estimate
    assert program.nbytes >= device + estimate // 4


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_bytes": -1}, "max_bytes must be an integer >= 0"),
        ({"max_bytes": 1.5}, "max_bytes must be an integer >= 0"),
        ({"max_programs": 0}, "max_programs must be an integer >= 1"),
        ({"max_programs": True}, "max_programs must be an integer >= 1"),
    ],
)
def test_set_program_cache_refuses_bad_bounds(arguments, message, default_limits):
    with pytest.raises(ValueError, match=message):
        specjax.set_program_cache(**arguments)


@pytest.mark.slow  # make test-all: the default suite keeps within its 20 minutes
def test_ablate_retires_the_programs_of_finished_groups(monkeypatch):
    specjax.clear_compiled_programs()
    retired = []  # (cells run so far, whether each retired program is greedy)
    real_retire = programs.retire_programs
    cells = []
    real_run_cell = specjax.ablation._run_cell

    def run_cell(*args, **kwargs):
        cells.append(args[2])
        return real_run_cell(*args, **kwargs)

    def retire(keys):
        retired.append((len(cells), sorted({key[0].warp.greedy for key in keys})))
        real_retire(keys)

    monkeypatch.setattr(specjax.ablation, "_run_cell", run_cell)
    monkeypatch.setattr(programs, "retire_programs", retire)
    specjax.ablate(
        TARGET,
        {"a": [[1, 2, 3, 1, 2]]},
        proposers=[specjax.NGram(k=2)],
        samplings=[specjax.Sampling(), specjax.Sampling(temperature=0.7)],
        seeds=[0, 1],
        max_new_tokens=8,
        chat=False,
        progress=False,
    )
    # Cells: greedy plain, NGram (seed 0), again (seed 1), then the same sampled. A group (plain or
    # NGram, greedy or sampled) finishes at its seed-1 cell: its programs retire there, never before.
    assert len(cells) == 8
    assert retired == [(3, [True]), (4, [True]), (7, [False, True]), (8, [False, True])]
