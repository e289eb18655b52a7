"""`generate()`: the host side of a generation (and `load()`, which places a model's weights on a
mesh for it).

Validate, tokenize, right-pad to a length bucket, make one call of the compiled program, fetch
the result once, detokenize. All per-step work happens on the device inside that one call.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import gc
import os
import reprlib
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import models, sharding
from specjax.kernels import backend as backends
from specjax.kernels.layouts import with_panel_weights
from specjax.models.checkpoint import dtype_name
from specjax.models.model import Model
from specjax.models.params import LlamaParams
from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program, memory_bytes, num_drafted
from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.proposers import resolve
from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec
from specjax.speculate.stops import build_stop_strings, cut_text, token_texts
from specjax.text import Message, chat_prompt_ids, is_conversation

MIN_BUCKET = 16  # shortest prompt bucket; buckets double from here up to BUCKET_STEP
BUCKET_STEP = 64  # longer prompts round up to a multiple of this
CAPACITY_GRANULE = 128  # cache capacity rounds up to a multiple of this


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per row, ending at a stop (its token included) or the limit
    texts: list[str] | None  # decoded new tokens, cut before a stop string (None without a tokenizer)
    metrics: SpecMetrics
    prompt_tokens: list[list[int]]  # the token ids each row was fed
    # Why each row ended: "stop" (EOS, a stop token id or a stop string) or "length" (it reached
    # max_new_tokens). A row whose last allowed token is a stop ends with "stop".
    finish_reasons: list[str]


def prompt_bucket(length: int) -> int:
    """The padded prompt length: 16, 32, 64, then the next multiple of 64.

    Coarser buckets compile fewer programs; finer ones waste less prefill on padding (a 769-token
    prompt padded to 1024 spent a third of its prefill on padding).
    """
    if length <= BUCKET_STEP:
        return max(MIN_BUCKET, 1 << (length - 1).bit_length())
    return -(-length // BUCKET_STEP) * BUCKET_STEP


def batch_bucket(num_rows: int, buckets: Sequence[int] | None = None, multiple_of: int = 1) -> int:
    """The padded batch size: the smallest of `buckets` (increasing) that holds `num_rows` and is a
    multiple of `multiple_of` (a mesh's data-parallel degree, over which rows split evenly). By
    default 1, 2, 4, 8, ... times `multiple_of`: a new batch size then compiles a new program only
    when it crosses a power of two. Padding rows cost a batch bucket's compute, nothing else (see
    `_generate`). ValueError, naming `batch_buckets`, when no bucket of the list fits."""
    if buckets is None:
        groups = -(-num_rows // multiple_of)
        return multiple_of * (1 << (groups - 1).bit_length())
    for size in buckets:
        if size >= num_rows and size % multiple_of == 0:
            return size
    if buckets[-1] < num_rows:
        raise ValueError(
            f"batch_buckets: {num_rows} prompts do not fit the largest bucket of {list(buckets)}; add "
            f"a bucket >= {num_rows}, or pass batch_buckets=None (1, 2, 4, 8, ...)"
        )
    raise ValueError(
        f"batch_buckets: no bucket of {list(buckets)} that holds {num_rows} prompts is a multiple of "
        f"the mesh's data-parallel degree {multiple_of} (rows split evenly over it); add one, e.g. "
        f"{-(-num_rows // multiple_of) * multiple_of}, or pass batch_buckets=None"
    )


def _check_batch_buckets(buckets) -> tuple[int, ...] | None:
    """batch_buckets as a tuple of batch sizes, or None for the default."""
    if buckets is None:
        return None
    sizes = tuple(buckets) if isinstance(buckets, Sequence) and not isinstance(buckets, str | bytes) else ()
    if (
        not sizes
        or not all(isinstance(b, int | np.integer) and not isinstance(b, bool) and b >= 1 for b in sizes)
        or any(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
    ):
        raise ValueError(
            "batch_buckets must be None (1, 2, 4, 8, ...) or a non-empty list of increasing positive "
            f"integers (the batch sizes to pad to), got {buckets!r}"
        )
    return tuple(int(b) for b in sizes)


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
# program), and the kernel allows 65,530 per process (XLA answers more with an abort or "LLVM
# compilation error: Cannot allocate memory"). When the process holds more than MAX_MAP_FRACTION of
# them, every program is dropped and jax.clear_caches() called (jax's other compiled functions).
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
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum} (or None to keep it), got {value!r}")
        _LIMITS[name] = int(value)
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
    """Drop every compiled program (ours and jax's caches) when the process nears its limit of
    memory maps; returns whether it did."""
    maps = _memory_maps()
    if maps is None or maps[0] <= MAX_MAP_FRACTION * maps[1]:
        return False
    clear_compiled_programs()
    jax.clear_caches()
    return True


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    # The sharding too: a program is compiled for its inputs' placement.
    return (treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves))


def _shapes(tree) -> tuple:
    """The tree's structure and each leaf's shape and dtype (not its values: cheap to compare)."""
    leaves, treedef = jax.tree.flatten(tree)
    return (str(treedef), tuple((x.shape, str(x.dtype)) for x in leaves))


# Params with panel weights, one copy per params object while it lives: id -> (weak ref, copy).
_PANELS: dict[int, tuple[weakref.ref, Any]] = {}


def _with_panels(params, packing=with_panel_weights):
    """`params` with panel weights for the CPU kernel (`packing`: a target's or a draft model's by
    default, a head's from its proposer spec), packed on the first call for these params (about
    a second for SmolLM2; the copy stays in memory beside the params while they live)."""
    cached = _PANELS.get(id(params))
    if cached is not None and cached[0]() is params:
        return cached[1]
    packed = packing(params)
    key, panels = id(params), _PANELS  # (the dict itself: at exit the module's names are gone first)
    _PANELS[key] = (weakref.ref(params, lambda _: panels.pop(key, None)), packed)
    return packed


def compile_program(spec: LoopSpec, params, proposer_params, inputs: GenerationInputs):
    """The generation program for these arguments, compiled (jax.stages.Compiled), from a function
    object of its own so that jax's caches let go of it with the caller's reference (see above)."""

    @functools.wraps(generate_program)
    def program(spec, params, proposer_params, inputs):
        return generate_program(spec, params, proposer_params, inputs)

    return jax.jit(program, static_argnums=0).lower(spec, params, proposer_params, inputs).compile()


def _compiled(spec: LoopSpec, params, proposer_params, inputs: GenerationInputs) -> tuple[Any, float]:
    key = (spec, _signature(params), _signature(proposer_params), _signature(inputs))
    global _NUM_COMPILED
    for used in _RECORDERS:
        used.add(key)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key].executable, 0.0
    _free_programs_near_the_map_limit()
    before = _resident_bytes()
    start = time.perf_counter()
    executable = compile_program(spec, params, proposer_params, inputs)
    compile_time = time.perf_counter() - start
    after = _resident_bytes()
    growth = None if before is None or after is None else after - before
    _COMPILED[key] = _Program(executable, _measured_bytes(executable, growth))
    _NUM_COMPILED += 1
    _drop_over_budget(keep=key)
    return executable, compile_time


def _tokenize(model: Model, prompts, chat: bool) -> list[list[int]]:
    """Token ids per row. `prompts` is one prompt (a str, or with chat=True a conversation: a list
    of message dicts) or a list of prompts (strs, token-id lists, conversations)."""
    if isinstance(prompts, str) or is_conversation(prompts):
        return [_prompt_ids(model, prompts, "prompts", chat)]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(
            "prompts must be a str, a list of str, a list of token-id lists or, with chat=True, a list "
            f"of messages or a list of such lists, got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty: got an empty list")
    return [_prompt_ids(model, prompt, f"prompts[{i}]", chat) for i, prompt in enumerate(prompts)]


def _prompt_ids(model: Model, prompt, name: str, chat: bool) -> list[int]:
    """One prompt's token ids; `name` is how errors call it ("prompts" or "prompts[i]")."""
    tokenizer = model.tokenizer
    if isinstance(prompt, str) or is_conversation(prompt):
        what = "a string" if isinstance(prompt, str) else "a list of messages"
        if tokenizer is None:
            raise ValueError(f"{name} is {what} but the model has no tokenizer; pass token ids")
        if not chat and not isinstance(prompt, str):
            raise ValueError(
                f"{name} is a list of messages: pass chat=True to render it with the tokenizer's chat "
                "template, or give the prompt as a str or token ids"
            )
        if chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"chat=True but the tokenizer of model {model.name!r} has no chat template; pass "
                "chat=False and give prompts as text formatted by hand or as token ids"
            )
        if not chat:
            ids = tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, str):  # one user message
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}], name)
        else:
            ids = chat_prompt_ids(tokenizer, prompt, name)
    elif isinstance(prompt, Sequence | np.ndarray) and all(
        isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt
    ):
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            vocab = model.config.vocab_size
            raise ValueError(f"{name} holds token id {bad[0]} outside the vocabulary [0, {vocab})")
    else:
        raise ValueError(
            f"{name} must be a str, a list of int token ids or, with chat=True, a list of messages "
            f'{{"role": str, "content": str}}, got {type(prompt).__name__} {reprlib.repr(prompt)}'
        )
    if len(ids) == 0:
        raise ValueError(f"{name} is empty: every prompt needs at least one token")
    return ids


def _eos_ids(model: Model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _per_row_sampling(sampling, num_rows: int) -> list[Sampling]:
    """One Sampling per prompt, from one for all or a list of them."""
    if sampling is None:
        return [Sampling()] * num_rows
    if isinstance(sampling, Sampling):
        return [sampling] * num_rows
    if not isinstance(sampling, Sequence) or isinstance(sampling, str):
        raise ValueError(
            "sampling must be a specjax.Sampling or a list of them (one per prompt), "
            f"got {type(sampling).__name__}"
        )
    rows = list(sampling)
    if len(rows) != num_rows:
        raise ValueError(
            f"sampling: a list of {len(rows)} Sampling values for {num_rows} prompts; give one per prompt"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, Sampling):
            raise ValueError(f"sampling[{i}] must be a specjax.Sampling, got {type(row).__name__}")
    return rows


def _check_token_options(rows: list[Sampling], model: Model) -> None:
    """Token ids in logit_bias and stop_token_ids must be in the vocabulary; stop strings need a
    tokenizer."""
    vocab = model.config.vocab_size
    for i, row in enumerate(rows):
        where = "sampling" if len(rows) == 1 else f"sampling[{i}]"
        for token in row.logit_bias or {}:
            if token >= vocab:
                raise ValueError(
                    f"{where}.logit_bias has token id {token} outside the vocabulary [0, {vocab})"
                )
        for token in row.stop_token_ids:
            if token >= vocab:
                raise ValueError(
                    f"{where}.stop_token_ids has token id {token} outside the vocabulary [0, {vocab})"
                )
        if row.stop and model.tokenizer is None:
            raise ValueError(f"{where}.stop needs a tokenizer to read token texts; the model has none")


def _key(key, rows: list[Sampling]) -> jax.Array:
    needs_key = [s for s in rows if not s.greedy and s.seed is None]
    if key is None:
        if needs_key:
            raise ValueError(
                f"key is required when sampling with temperature={needs_key[0].temperature} > 0 and no "
                "seed: pass key=jax.random.key(seed), or a seed in each Sampling"
            )
        return jax.random.key(0)
    return as_key(key)


def as_key(key) -> jax.Array:
    """One jax PRNG key: a typed key as it is, the raw uint32 pair of jax.random.PRNGKey wrapped;
    anything else a ValueError naming `key`."""
    if (
        isinstance(key, jax.Array)
        and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        and key.shape == ()
    ):
        return key
    if isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape == (2,):  # jax.random.PRNGKey
        return jax.random.wrap_key_data(key)
    raise ValueError(f"key must be one jax PRNG key (jax.random.key(seed)), got {key!r}")


def _stop_token_ids(model: Model, rows: list[Sampling]) -> np.ndarray:
    """[B, M] int32: EOS and each row's stop token ids, padded with -1 (M a multiple of 4, so
    that a few more ids rarely compile a new program)."""
    eos = _eos_ids(model)
    per_row = [sorted(set(eos) | set(s.stop_token_ids)) for s in rows]
    width = max(4, -(-max(len(ids) for ids in per_row) // 4) * 4)
    out = np.full((len(rows), width), -1, np.int32)
    for b, ids in enumerate(per_row):
        out[b, : len(ids)] = ids
    return out


def available_memory_bytes() -> int | None:
    """Free memory of the default device: the allocator's limit minus its use on an accelerator,
    the host's available memory on CPU; None when unknown."""
    device = jax.local_devices()[0]  # jax.devices()[0] may be another process's
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_memory(spec: LoopSpec, max_new_tokens: int, params=None) -> None:
    needed, available = memory_bytes(spec, params), available_memory_bytes()
    if spec.mesh is not None:  # rows and caches split over the data axis; an upper bound per device
        needed //= sharding.data_degree(spec.mesh)
    if available is not None and needed > available:
        gib = 1 << 30
        raise ValueError(
            f"prompts and max_new_tokens={max_new_tokens}: a batch of {spec.batch_size} rows with prompts "
            f"padded to {spec.prompt_bucket} tokens and {spec.capacity} cache slots per row needs about "
            f"{needed:,} bytes ({needed / gib:.2f} GiB: KV caches, buffers and the prefill's and "
            f"attention's working memory), but the device has {available / gib:.2f} GiB free; use "
            "fewer or shorter prompts per call or a smaller max_new_tokens"
        )


def load(
    source,
    dtype: Any = "float32",
    cache_dir=None,
    mesh=None,
    quantization: str | None = None,
    group_size: int | None = None,
    tokenizer=None,
) -> Model:
    """Load a model with its tokenizer (`specjax.models.load`), placed on `mesh` when given one.

    source: a built-in name (e.g. "smollm2-135m"), an HF checkpoint folder (`config.json` +
        safetensors) or a `.gguf` file.
    dtype: "float32", "bfloat16" or "float16" (or the jnp dtype) for weights and activations; norm
        statistics, softmax, logits, sampling and verification stay float32.
    cache_dir: where converted GGUF weights are kept; default `$SPECJAX_CACHE` or `~/.cache/specjax`.
    mesh: a jax Mesh from `specjax.sharding.make_mesh`: each device receives only its slice of
        each weight, ready for `generate(..., mesh=mesh)`; on a mesh that spans processes, each
        process reads from the checkpoint only the slices its own devices hold. The model's heads
        and ffw size must divide the mesh's model axis.
    quantization: None (the source's own weights: float, or an FP8 checkpoint's FP8 as
        released), "gguf" (keep a .gguf file's blocks: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), "int8",
        "int4" or "fp8" (quantize the projections and the LM head at load, from any source; an
        FP8 checkpoint's own FP8 weights are kept by "fp8", requantized by the others);
        `group_size`: int4's groups, 32 (default) or 128. See docs/models.md, "Quantized weights".
    tokenizer: an HF tokenizer to use instead of the source's own: for a GGUF whose tokenizer
        specjax does not rebuild (a ValueError names it), e.g.
        `transformers.AutoTokenizer.from_pretrained("the HF repo")`. Its ids must be the model's.
    """
    options = dict(dtype=dtype, cache_dir=cache_dir, quantization=quantization, group_size=group_size)
    if mesh is None:
        return models.load(source, **options, tokenizer=tokenizer)
    sharding.check_mesh(mesh)

    def placer_for(config):
        sharding.check_model_split(mesh, config)  # before any weight is read
        return sharding.slice_placer(config, mesh)  # this process reads only its devices' slices

    return models.load(source, **options, placer_for=placer_for, tokenizer=tokenizer)


def generate(
    model: Model,
    prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[Message] | Sequence[Sequence[Message]],
    proposer=None,
    sampling: Sampling | Sequence[Sampling] | None = None,
    max_new_tokens: int = 128,
    key: jax.Array | None = None,
    chat: bool = False,
    mesh=None,
    cache_dtype=None,
    kernels: str = "auto",
    matmul_precision: str | None = None,
    batch_buckets: Sequence[int] | None = None,
    scan_layers: bool | None = None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` tokens per prompt; see DESIGN.md section 3.

    `prompts` is one prompt or a list of them. A prompt is a str, a list of token ids, or, with
    `chat=True`, a conversation: a list of messages `{"role": "system" | "user" | "assistant",
    "content": str}` rendered by the tokenizer's chat template with the assistant's turn opened
    (`specjax.chat_prompt_ids`). With `chat=True` a str is one user message; token ids are fed as
    they are. So a list of dicts is one conversation, a list of lists of dicts a batch of them.
    `result.finish_reasons[b]` is "stop" where row b ended at EOS, a stop token id or a stop
    string, "length" where it reached `max_new_tokens`.

    Which proposer to try first: `NGram(k=8)`, or `Dynamic(NGram(k=8))` to let each row lower k
    where drafts fail, for input-grounded work (edits, summaries, RAG, code): drafting is free
    and the answer repeats the prompt (`make demo`: 2.4x plain decoding on edits on a 2-core CPU).
    A trained head (`Eagle3`, `Eagle`, `Medusa`, `DFlash`) where its acceptance is high and a
    verify pass costs little more than a step (an accelerator). `proposer=None` (plain decoding)
    for short open-ended chat on a CPU, where few drafts are right and each verify pass over
    k + 1 tokens costs more than a plain step. Every proposer is lossless.

    `sampling` is one Sampling for every row or a list with one per prompt; rows may mix greedy
    and sampled decoding and any options in one compiled program. `cache_dtype` ("float32",
    "bfloat16" or "float16"; default: the model's dtype) is the dtype of the target's KV cache; a
    proposer's own cache (a draft model's, an EAGLE head's) follows its own weights.

    `kernels` picks the kernels (specjax/kernels/backend.py): "auto" (the platform's own: the CPU
    kernels on a CPU, Pallas attention on a GPU or TPU for heads 64, 128 or 256 wide, plain XLA
    attention for other heads), "xla" (plain XLA everywhere), or
    "pallas:tpu" / "pallas:cuda" (that accelerator's Pallas kernels, interpreted where the program
    runs elsewhere: slow, for checking their numerics). `matmul_precision` (jax's names:
    "default", "high", "highest", ...) is the precision of the products; default "highest" for a
    float32 model, so that its products are float32 on every platform (accelerators otherwise use
    TF32 or bfloat16 passes), and the platform's default for bfloat16 and float16 models.

    The batch is padded to a bucket so that a new number of prompts rarely compiles a new program:
    `batch_buckets` lists the batch sizes to pad to (increasing), default 1, 2, 4, 8, ...; on a
    mesh, the smallest that is a multiple of its data-parallel degree. Padding rows are done from
    the start: they cost their share of each step's compute and appear nowhere in the result.

    `scan_layers`: run each run of decoder layers of one shape as one loop over their stacked weights
    (True), so that the program and its compile time stay the same size whatever the depth, or
    unrolled (False). Default (None): unrolled on every platform, since XLA copies each layer's
    slice out of the stack before its products: a decoding step 1.8x slower on the CPU, 2.5x on
    an H200 (a bfloat16 8B model: 11.9 against 4.8 ms). Scanning stacks the layers' weights once
    per call: a copy of them in device memory while the program runs.

    On a mesh that spans processes (after `jax.distributed.initialize`), every process makes the
    same call and receives the whole result; a process whose prompts, options or mesh differ from
    the others' makes every process raise a ValueError before anything is compiled
    (specjax/sharding/processes.py).
    """
    agreement = sharding.CallAgreement(mesh, "generate")
    try:
        options = dict(
            proposer=proposer,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            key=key,
            chat=chat,
            mesh=mesh,
            cache_dtype=cache_dtype,
            kernels=kernels,
            matmul_precision=matmul_precision,
            batch_buckets=batch_buckets,
            scan_layers=scan_layers,
        )
        return _generate(model, prompts, options, agreement)
    except Exception:
        agreement.fail()  # the other processes must not wait for this one's fingerprint
        raise


@dataclasses.dataclass
class Prepared:
    """A generation's program and arguments, made on the host before anything runs: `generate`
    compiles and calls it, `export_generate` lowers it for other platforms."""

    spec: LoopSpec
    params: Any
    proposer_params: Any
    inputs: GenerationInputs
    rows: list[list[int]]  # each prompt's token ids
    samplings: list[Sampling]  # each row's options


def _generate(model, prompts, options: dict, agreement) -> GenerateResult:
    return _run(model, prepare(model, prompts, **options, agreement=agreement))


def prepare(
    model,
    prompts,
    proposer=None,
    sampling=None,
    max_new_tokens=128,
    key=None,
    chat=False,
    mesh=None,
    cache_dtype=None,
    kernels="auto",
    matmul_precision=None,
    batch_buckets=None,
    scan_layers=None,
    *,
    agreement=None,
    devices=None,
    platforms=None,
) -> Prepared:
    """Validate `generate`'s arguments and make its program's spec and arguments: for `devices`
    (default: those of the mesh, or the default device), or, with `platforms`, for export to those
    platforms (no CPU FFI kernels: they are built for this host)."""
    if not isinstance(model, Model):
        raise ValueError(f"model must be a specjax.Model (from specjax.load), got {type(model).__name__}")
    if mesh is not None:
        sharding.check_mesh(mesh)
        sharding.check_model_split(mesh, model.config)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    batch_buckets = _check_batch_buckets(batch_buckets)
    dtype = model.params.dtype.name
    try:
        cache_dtype = dtype if cache_dtype is None else dtype_name(cache_dtype)
    except ValueError as error:
        raise ValueError(f"cache_dtype: {error}") from None
    rows = _tokenize(model, prompts, chat)
    samplings = _per_row_sampling(sampling, len(rows))
    _check_token_options(samplings, model)
    key = _key(key, samplings)
    warp = WarpSpec.of(samplings)
    precision = backends.default_precision(dtype, matmul_precision)
    if platforms is None:
        if devices is None:  # the mesh's, or the default device
            devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
        backend = backends.for_devices(devices, kernels, precision, mesh is not None, scan_layers)
    else:
        backend = backends.Backend(
            tuple(platforms),
            kernels,
            precision,
            portable=True,
            sharded=mesh is not None,
            scan_layers=scan_layers,
        )
    proposer_spec, proposer_params = resolve(proposer, model, warp, mesh)

    longest = max(len(r) for r in rows)
    context = model.config.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(
            f"prompts: the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens} it "
            f"exceeds the model's context of {context} tokens"
        )
    # Padding rows (B - num_rows of them) have a one-token prompt, neutral options and no token to
    # generate: the loop counts them done from the start (see `prefill`); they are dropped below.
    num_rows, bucket = len(rows), prompt_bucket(longest)
    B = batch_bucket(num_rows, batch_buckets, 1 if mesh is None else sharding.data_degree(mesh))
    padding = B - num_rows
    row_samplings = samplings + [Sampling()] * padding  # warp and key come from the real rows
    if mesh is not None:
        sharding.check_batch_split(mesh, B)
    # Room for a verify pass past the last committed token: k drafts, or a tree's nodes.
    width = num_drafted(proposer_spec)
    capacity = -(-(bucket + max_new_tokens + width + 1) // CAPACITY_GRANULE) * CAPACITY_GRANULE
    spec = LoopSpec(
        config=model.config,
        batch_size=B,
        prompt_bucket=bucket,
        capacity=capacity,
        warp=warp,
        proposer=proposer_spec,
        mesh=mesh,
        dtype=dtype,
        cache_dtype=cache_dtype,
        backend=backend,
    )
    if platforms is None:  # (an exported program's device is not this one)
        _check_memory(spec, max_new_tokens, model.params)
    padded = np.zeros((B, bucket), np.int32)
    for b, row in enumerate(rows):
        padded[b, : len(row)] = row
    stop_strings = None
    if any(s.stop for s in samplings):
        stop_strings = build_stop_strings(
            model.tokenizer, model.config.vocab_size, [s.stop for s in row_samplings]
        )
    inputs = GenerationInputs(
        prompt_tokens=jnp.asarray(padded),
        prompt_lengths=jnp.asarray([len(r) for r in rows] + [1] * padding, jnp.int32),
        max_new_tokens=jnp.asarray([max_new_tokens] * num_rows + [0] * padding, jnp.int32),
        sampling=SamplingParams.of(row_samplings, B, model.config.vocab_size),
        key=key,
        seeds=jnp.asarray([s.seed or 0 for s in row_samplings], jnp.uint32),
        seeded=jnp.asarray([s.seed is not None for s in row_samplings]),
        stop_token_ids=jnp.asarray(_stop_token_ids(model, row_samplings)),
        stop_strings=stop_strings,
    )
    agreement = agreement or sharding.CallAgreement(None, "prepare")
    agreement.check(  # a no-op unless the mesh spans processes; then one small all-gather
        {
            "prompts": (padded, inputs.prompt_lengths),
            "options": (dataclasses.replace(spec, mesh=None), samplings, key, inputs.max_new_tokens, chat),
            "model and proposer": (_shapes(model.params), _shapes(proposer_params)),
            "mesh": sharding.mesh_fingerprint(mesh),
        }
    )
    params = model.params
    if mesh is not None:  # no-ops for arrays already placed, e.g. by specjax.load(..., mesh=mesh)
        params = sharding.shard_params(params, model.config, mesh)
        placing = getattr(proposer_spec, "place_params", None)  # a draft model's own, as it asks
        if proposer_params is not None and placing is not None:
            proposer_params = placing(proposer_params, mesh)
        elif proposer_params is not None:  # heads (Medusa) or a custom proposer's: replicated
            proposer_params = sharding.replicate(proposer_params, mesh)
        inputs = sharding.shard_rows(inputs, mesh, B)
    else:
        params, proposer_params = kernel_weights(spec, params, proposer_params)
    return Prepared(spec, params, proposer_params, inputs, rows, samplings)


def kernel_weights(spec: LoopSpec, params, proposer_params):
    """The weights in the layout of the backend's kernels: with the CPU decoding kernels, the
    target's, a draft model's and a trained head's panel weights (see specjax.kernels); as they
    are otherwise."""
    if not spec.backend.cpu_kernels:
        return params, proposer_params
    # The kernels compute in float32: a bfloat16 or float16 model keeps XLA's products, so it
    # runs in its own dtype (slowly on a CPU, which has no fast bfloat16 products).
    if spec.dtype == "float32":
        params = _with_panels(params)
    if isinstance(proposer_params, LlamaParams) and proposer_params.dtype == jnp.float32:
        proposer_params = _with_panels(proposer_params)
    head_panels = getattr(spec.proposer, "with_panel_weights", None)  # a trained head's own
    if head_panels is not None and proposer_params is not None:
        proposer_params = _with_panels(proposer_params, head_panels)
    return params, proposer_params


def _run(model: Model, prepared: Prepared) -> GenerateResult:
    """Compile (or find) the prepared program, run it and make the result."""
    spec, params, proposer_params, inputs = (
        prepared.spec,
        prepared.params,
        prepared.proposer_params,
        prepared.inputs,
    )
    rows, samplings, mesh, k = prepared.rows, prepared.samplings, spec.mesh, spec.k
    num_rows = len(rows)  # the batch's real rows; the program's spec.batch_size pads them
    program, compile_time = _compiled(spec, params, proposer_params, inputs)
    start = time.perf_counter()
    state = program(params, proposer_params, inputs)
    fetch = jax.device_get if mesh is None else sharding.fetch  # the latter spans hosts too
    own_counters = getattr(spec.proposer, "counters", None)  # a proposer's own counts (Hybrid)
    own = None if own_counters is None else own_counters(state.proposer_state)
    tokens, lengths, max_lengths, nonfinite_step, counters, own = fetch(
        (state.tokens, state.lengths, state.max_lengths, state.nonfinite_step, state.metrics, own)
    )
    run_time = time.perf_counter() - start
    # Drop the padding rows: every per-row array, the metrics' counters included.
    nonfinite_step, counters, own = jax.tree.map(lambda x: x[:num_rows], (nonfinite_step, counters, own))

    if (nonfinite_step >= 0).any():
        bad = ", ".join(
            f"row {b} at step {nonfinite_step[b]}" + (" (the prefill)" if nonfinite_step[b] == 0 else "")
            for b in np.flatnonzero(nonfinite_step >= 0)
        )
        raise FloatingPointError(
            f"the model produced non-finite logits (NaN or inf) for {bad}: check its weights "
            f"(model {model.name!r})"
        )
    new_tokens = [tokens[b, len(row) : lengths[b]].tolist() for b, row in enumerate(rows)]
    texts, cut = None, [False] * num_rows
    if model.tokenizer is not None:
        whole = [model.tokenizer.decode(t, skip_special_tokens=True) for t in new_tokens]
        texts = [cut_text(text, s.stop) for text, s in zip(whole, samplings, strict=True)]
        cut = [len(a) < len(b) for a, b in zip(texts, whole, strict=True)]
    at_limit = (lengths >= max_lengths)[:num_rows].tolist()
    metrics = SpecMetrics.from_counters(
        counters, k=k, compile_time_s=compile_time, run_time_s=run_time, proposer=own
    )
    return GenerateResult(
        tokens=new_tokens,
        texts=texts,
        metrics=metrics,
        prompt_tokens=rows,
        finish_reasons=_finish_reasons(model, new_tokens, samplings, at_limit, cut),
    )


def _finish_reasons(
    model: Model,
    new_tokens: list[list[int]],
    samplings: list[Sampling],
    at_limit: list[bool],
    cut: list[bool],
) -> list[str]:
    """Why each row ended: "stop" or "length" (see GenerateResult.finish_reasons).

    at_limit[b]: the row holds max_new_tokens new tokens; cut[b]: its text was cut at a stop string.

    The loop marks a row done at its first stop or at its limit and keeps no record of which. A row
    that ended short of its limit stopped. One that reached it stopped too when its last token is a
    stop: EOS, a stop token id, or the token that completes a stop string in the token texts that
    the loop's automaton reads (`token_texts`, from the first new token on; the loop would have
    ended the row at any earlier occurrence). These texts can differ from the decoded text: a
    SentencePiece tokenizer drops the first token's leading space. A row whose text was cut at a
    stop string counts as stopped as well: the loop can miss a string holding a character split
    across tokens (stops.py), `cut_text` cannot."""
    eos = set(_eos_ids(model))
    reasons = []
    for tokens, sampling, full, was_cut in zip(new_tokens, samplings, at_limit, cut, strict=True):
        stopped = not full or was_cut or tokens[-1] in eos | set(sampling.stop_token_ids)
        if not stopped and sampling.stop:
            texts = token_texts(model.tokenizer, model.config.vocab_size)  # cached per tokenizer
            read = "".join(texts[t] for t in tokens)
            stopped = any(s in read for s in sampling.stop)
        reasons.append("stop" if stopped else "length")
    return reasons
