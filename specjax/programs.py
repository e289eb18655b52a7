"""The compiled generation programs a process keeps: `generate` finds its program here by the
call's static spec and its arguments' structure, and compiles it only when it is not kept.

A kept program holds host memory; the cache is bounded by what its programs hold and by their
count, and gives the memory of the programs it drops back to the system (below).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import gc
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import jax

from specjax.checks import check_int
from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program

# Compiled programs by (LoopSpec, params structure): a repeated call skips tracing and compiling.
# A kept program holds host memory: on XLA:CPU about 2.5 KB per instruction of its optimized HLO
# (the module, its buffer assignment, thunks and compiled kernels; the machine code itself is a
# few MB), so 60 to 400 MB for SmolLM2's programs (docs/benchmarks.md, "What a compiled program
# holds"). The cache is bounded by what its programs hold, measured for each when it is compiled
# (`_measured_bytes`), and by their count; the least recently used go first. Dropping a program
# frees its memory because
# - each is compiled from a function object of its own: jax's tracing, lowering and compilation
#   caches hold a program's jaxpr, HLO and executable under a weak reference to the function, so
#   they let go with it (compiled from the module's `generate_program`, every program stayed alive
#   in jax's caches whatever this cache dropped);
# - glibc keeps freed heap for reuse: after a drop, `malloc_trim` gives it back to the system.
# The map guard stays: each XLA:CPU executable holds memory maps of its code (300 to 1,400 per
# program), and the kernel allows 65,530 per process by default (vm.max_map_count; XLA answers more
# with an abort or "LLVM compilation error: Cannot allocate memory"). When the process holds more
# than MAX_MAP_FRACTION of them, the least recently used programs are dropped until the maps they
# were measured to add bring it back under (a warning says so, and that raising vm.max_map_count
# keeps more); only where that is not enough, every program, and jax.clear_caches() (jax's other
# compiled functions). Dropping them all at once made a sweep of 20 schemas x 6 methods recompile
# its 61 programs in every round (docs/benchmarks.md, "All 20 tasks again").
DEFAULT_MAX_PROGRAM_BYTES = 2 << 30
DEFAULT_MAX_PROGRAMS = 32
MAX_MAP_FRACTION = 0.6
# Host memory per HLO instruction of a program where the process's resident memory cannot be read
# (off Linux): fitted to SmolLM2's programs on XLA:CPU, which held 2.7 to 3.6 KB per instruction.
HOST_BYTES_PER_INSTRUCTION = 3000


@dataclasses.dataclass
class _Program:
    executable: Any  # jax.stages.Compiled
    nbytes: int  # memory it holds (`_measured_bytes`)
    maps: int = 0  # memory maps its compilation added to the process (0 where they cannot be read)


@dataclasses.dataclass(frozen=True)
class ProgramCacheInfo:
    """What the compiled-program cache holds now, and its bounds."""

    programs: int
    bytes: int  # the sum of what each kept program was measured to hold when compiled
    max_bytes: int
    max_programs: int
    compiled: int  # programs compiled in this process so far, dropped ones included


_COMPILED: collections.OrderedDict[tuple, _Program] = collections.OrderedDict()  # oldest use first
_LIMITS = {"max_bytes": DEFAULT_MAX_PROGRAM_BYTES, "max_programs": DEFAULT_MAX_PROGRAMS}
_NUM_COMPILED = 0
_RECORDERS: list[set] = []  # open `programs_used` blocks


def compiled_program_count() -> int:
    """How many generation programs have been compiled in this process (tests use this)."""
    return _NUM_COMPILED


def program_cache_info() -> ProgramCacheInfo:
    """How many compiled programs are kept, what they hold, and the cache's bounds."""
    return ProgramCacheInfo(
        programs=len(_COMPILED),
        bytes=sum(p.nbytes for p in _COMPILED.values()),
        compiled=_NUM_COMPILED,
        **_LIMITS,
    )


def set_program_cache(max_bytes: int | None = None, max_programs: int | None = None) -> ProgramCacheInfo:
    """Bound the cache of compiled generation programs by the memory they hold (`max_bytes`,
    default DEFAULT_MAX_PROGRAM_BYTES, 2 GiB) and by their number (`max_programs`, default 32);
    None leaves a bound as it is. The least recently used programs beyond either bound are dropped
    now and their memory given back; the program a call needs is kept even when it alone is over
    `max_bytes`. Returns the cache's state."""
    for name, value, minimum in (("max_bytes", max_bytes, 0), ("max_programs", max_programs, 1)):
        if value is not None:
            _LIMITS[name] = check_int(name, value, minimum)
    _drop_over_budget()
    return program_cache_info()


def clear_compiled_programs() -> None:
    """Drop every kept program and give the host memory they held back to the system (the next
    call of each kind compiles again). The models' weights, and their panel copies for the CPU
    kernels, stay: they belong to the models."""
    if _COMPILED:
        _COMPILED.clear()
        _give_back_memory()


@contextlib.contextmanager
def programs_used() -> Iterator[set]:
    """The keys of the programs that `generate` calls inside the block used (for `retire_programs`)."""
    used: set = set()
    _RECORDERS.append(used)
    try:
        yield used
    finally:
        _RECORDERS.remove(used)


def retire_programs(keys) -> None:
    """Mark programs no longer needed (a sweep has finished with them): they become the least
    recently used, the first dropped when the cache reaches a bound, and stay usable until then."""
    for key in keys:
        if key in _COMPILED:
            _COMPILED.move_to_end(key, last=False)


def _drop_over_budget(keep: tuple | None = None) -> None:
    """Drop least recently used programs until both bounds hold (never `keep`)."""
    held = sum(p.nbytes for p in _COMPILED.values())
    dropped = False
    for key in list(_COMPILED):
        if len(_COMPILED) <= _LIMITS["max_programs"] and held <= _LIMITS["max_bytes"]:
            break
        if key != keep:
            held -= _COMPILED.pop(key).nbytes
            dropped = True
    if dropped:
        _give_back_memory()


def _give_back_memory() -> None:
    """Free what dropped programs held: collect the reference cycles around their executables, then
    return freed heap pages to the system (glibc keeps them otherwise: after dropping 4 SmolLM2
    programs, resident memory fell by 1 MB without this, by 300 MB with it)."""
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    """glibc, for malloc_trim; None elsewhere (macOS, musl), where nothing is trimmed."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _resident_bytes() -> int | None:
    """The process's resident memory after returning freed heap to the system; None off Linux."""
    _trim_heap()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _measured_bytes(executable, resident_growth: int | None) -> int:
    """What a just-compiled program holds: the code and temporaries its memory analysis reports
    (device memory on an accelerator; XLA:CPU reports no code size and temporaries it allocates per
    run) plus its host memory, the growth of resident memory over its compilation (which its memory
    analysis does not see: 60 to 400 MB per SmolLM2 program where the analysis says 0.6 to 5.5).
    Where that cannot be read, or came out below a quarter of the estimate (memory freed by
    something else meanwhile), the host part is HOST_BYTES_PER_INSTRUCTION per HLO instruction."""
    try:
        analysis = executable.memory_analysis()
        device = analysis.generated_code_size_in_bytes + analysis.temp_size_in_bytes
    except Exception:  # noqa: BLE001 - backends without an analysis
        device = 0
    try:
        module = executable.runtime_executable().hlo_modules()[0]
        instructions = sum(len(c.instructions()) for c in module.computations())
    except Exception:  # noqa: BLE001 - an executable without its HLO
        instructions = 0
    estimate = HOST_BYTES_PER_INSTRUCTION * instructions
    host = estimate if resident_growth is None or resident_growth < estimate // 4 else resident_growth
    return int(device + host)


def _memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's limit per process), or None off Linux."""
    try:
        with open("/proc/self/maps") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return held, int(f.read())
    except (OSError, ValueError):
        return None


def _free_programs_near_the_map_limit() -> bool:
    """When the process nears its limit of memory maps: drop the least recently used programs
    until the maps they added bring it under MAX_MAP_FRACTION, or, where that cannot, every
    compiled program (ours and jax's caches). Returns whether it dropped any."""
    maps = _memory_maps()
    if maps is None or maps[0] <= MAX_MAP_FRACTION * maps[1]:
        return False
    held, limit = maps
    allowed = MAX_MAP_FRACTION * limit
    dropped = 0
    for key in list(_COMPILED):
        if held <= allowed:
            break
        held -= _COMPILED.pop(key).maps
        dropped += 1
    warnings.warn(
        f"specjax: the process holds {maps[0]} of its {limit} memory maps (vm.max_map_count); "
        f"dropped {dropped} compiled programs, least recently used first, which later calls compile "
        "again. Raising vm.max_map_count (sysctl, as root) keeps more.",
        RuntimeWarning,
        stacklevel=3,
    )
    if held > allowed:  # maps the programs did not add (or could not be counted): drop everything
        clear_compiled_programs()
        jax.clear_caches()
    else:
        _give_back_memory()
    return True


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    # The sharding too: a program is compiled for its inputs' placement.
    return (treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves))


def compile_program(spec: LoopSpec, params, proposer_params, inputs: GenerationInputs):
    """The generation program for these arguments, compiled (jax.stages.Compiled), from a function
    object of its own so that jax's caches let go of it with the caller's reference (see above)."""

    @functools.wraps(generate_program)
    def program(spec, params, proposer_params, inputs):
        return generate_program(spec, params, proposer_params, inputs)

    return jax.jit(program, static_argnums=0).lower(spec, params, proposer_params, inputs).compile()


def compiled(spec: LoopSpec, params, proposer_params, inputs: GenerationInputs) -> tuple[Any, float]:
    """(the program for these arguments, seconds spent compiling it: 0 when it was kept)."""
    key = (spec, _signature(params), _signature(proposer_params), _signature(inputs))
    global _NUM_COMPILED
    for used in _RECORDERS:
        used.add(key)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key].executable, 0.0
    _free_programs_near_the_map_limit()
    before, maps_before = _resident_bytes(), _memory_maps()
    start = time.perf_counter()
    executable = compile_program(spec, params, proposer_params, inputs)
    compile_time = time.perf_counter() - start
    after, maps_after = _resident_bytes(), _memory_maps()
    growth = None if before is None or after is None else after - before
    maps = 0 if maps_before is None or maps_after is None else max(0, maps_after[0] - maps_before[0])
    _COMPILED[key] = _Program(executable, _measured_bytes(executable, growth), maps)
    _NUM_COMPILED += 1
    _drop_over_budget(keep=key)
    return executable, compile_time
