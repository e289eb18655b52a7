"""The request planner: everything a generation will be, decided once on the host before anything
runs, for `generate`, `stream`, the serving `Engine` and `export_generate` alike.

- the prompts' token ids (`tokenize`: strings, token ids or conversations through the chat
  template), each row's `Sampling`, the PRNG key, and the checks of all of them;
- the buckets: prompts are right-padded to a length bucket and the batch to a batch bucket, so
  that a new prompt length or batch size rarely compiles a new program;
- the cache's capacity (room for the prompt, the new tokens and one verify pass) and dtype;
- the backend a program is traced with (kernels, precision, layers unrolled or scanned);
- the static `LoopSpec` and the dynamic `GenerationInputs` of the compiled loop, and the weights
  in the layout of the backend's kernels (`Plan`, from `plan`);
- after the call, why each row ended (`finish_reasons`).
"""

from __future__ import annotations

import dataclasses
import reprlib
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.checks import check_int, is_int
from specjax.kernels import backend as backends
from specjax.kernels.layouts import with_panel_weights
from specjax.models.checkpoint import dtype_name
from specjax.models.model import Model
from specjax.speculate.grammar import build_grammar
from specjax.speculate.loop import GenerationInputs
from specjax.speculate.proposers import resolve
from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec
from specjax.speculate.spec import LoopSpec, memory_bytes, num_drafted, pages_pack
from specjax.speculate.stops import build_stop_strings, token_texts
from specjax.text import chat_prompt_ids, has_chat_template, is_conversation

MIN_BUCKET = 16  # shortest prompt bucket; buckets double from here up to BUCKET_STEP
BUCKET_STEP = 64  # longer prompts round up to a multiple of this
CAPACITY_GRANULE = 128  # cache capacity rounds up to a multiple of this
# A chunked prefill's chunk (LoopSpec.prefill_chunk): tokens of one row per pass.
PREFILL_CHUNK = 256
# Capacities of chunked programs: powers of two from MIN_CAPACITY to CAPACITY_DOUBLING, then
# multiples of it, so that prompts of 40 to 4,000 tokens share 6 programs.
MIN_CAPACITY = 256
CAPACITY_DOUBLING = 4096


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
    `plan`). ValueError, naming `batch_buckets`, when no bucket of the list fits."""
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


def check_batch_buckets(buckets) -> tuple[int, ...] | None:
    """batch_buckets as a tuple of batch sizes, or None for the default."""
    if buckets is None:
        return None
    sizes = tuple(buckets) if isinstance(buckets, Sequence) and not isinstance(buckets, str | bytes) else ()
    if (
        not sizes
        or not all(is_int(b) and b >= 1 for b in sizes)
        or any(a >= b for a, b in zip(sizes, sizes[1:], strict=False))
    ):
        raise ValueError(
            "batch_buckets must be None (1, 2, 4, 8, ...) or a non-empty list of increasing positive "
            f"integers (the batch sizes to pad to), got {buckets!r}"
        )
    return tuple(int(b) for b in sizes)


def capacity(tokens: int, proposer_spec) -> int:
    """Cache slots per row for `tokens` tokens (a padded prompt and its new tokens) and a verify
    pass past the last committed one (k drafts, or a tree's nodes), rounded up to a multiple of
    CAPACITY_GRANULE so that nearby lengths share a program."""
    width = num_drafted(proposer_spec)
    return -(-(tokens + width + 1) // CAPACITY_GRANULE) * CAPACITY_GRANULE


def chunked_capacity(longest: int, max_new_tokens: int, proposer_spec, chunk: int = PREFILL_CHUNK) -> int:
    """Cache slots per row of a program whose prefill runs in chunks (`LoopSpec.prefill_chunk`):
    the longest prompt rounded up to whole chunks (a last chunk's padding is written past the
    row's length), or the prompt, its new tokens and a verify pass, whichever is more; then the
    next power of two from MIN_CAPACITY, or past CAPACITY_DOUBLING the next multiple of it. The
    capacity is then all of the program that depends on the prompts' lengths: coarse steps, few
    programs (at most twice the slots a generation needs, which cost memory, not time, where
    attention reads each row's committed slots alone)."""
    width = num_drafted(proposer_spec)
    slots = max(-(-longest // chunk) * chunk, longest + max_new_tokens + width + 1)
    if slots <= CAPACITY_DOUBLING:
        return max(MIN_CAPACITY, 1 << (slots - 1).bit_length())
    return -(-slots // CAPACITY_DOUBLING) * CAPACITY_DOUBLING


def check_page_size(page_size, config, mesh) -> int | None:
    """`generate`'s page_size, checked: None, or a power of two of at least 16 slots, on one
    device, for a model without latent attention."""
    if page_size is None:
        return None
    if not is_int(page_size) or page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be None or a power of two of at least 16 slots, got {page_size!r}")
    if mesh is not None:
        raise ValueError(f"page_size={page_size}: a paged cache runs on one device; pass mesh=None")
    if config.kv_lora_rank:
        raise ValueError(
            f"page_size={page_size}: this model's latent attention (MLA) reads a dense cache; pass None"
        )
    return int(page_size)


def prefill_chunk_of(
    prefill_chunk, mesh, backend, longest: int, batch: int, packs: bool = False
) -> int | None:
    """`generate`'s prefill_chunk as LoopSpec.prefill_chunk, for `batch` rows (the batch bucket)
    whose longest prompt has `longest` tokens. "auto": PREFILL_CHUNK on one CPU device, where
    chunks were measured, unless one pass does less work (below); on a mesh (rows split over
    devices) and for accelerators, None (the prompts in one pass over the batch padded to a prompt
    bucket). An int: chunks of that many tokens (a multiple of 16), on one device. `packs`: the
    chunks would pack the rows' prompts end to end (LoopSpec.packs_prefill), which never computes
    more than one pass over the padded batch does (at most one chunk's padding in all)."""
    if prefill_chunk == "auto":
        if mesh is not None or not backend.cpu_only or backend.portable:
            return None
        if packs:
            return PREFILL_CHUNK
        # Chunks save work where rows are ragged: each row computes its prompt rounded up to whole
        # chunks, not the longest prompt's bucket. Where every prompt's bucket is shorter than a
        # chunk they save none: the B rows (padding rows included) run a chunk each, B x C token
        # positions, against B x bucket < B x C in one pass (1,000 rows of 6 tokens: 262,144
        # positions against 16,384, 18.6 s against 0.4 s). Such a batch runs in one pass (a small
        # program per bucket below C). A single row keeps its chunk, which wastes at most one
        # pass's padding, so that single prompts of any length share the few programs of the
        # capacity's steps; so do longer prompts, where one pass saves under one chunk a row and
        # compiles a larger program per 64-token bucket (docs/benchmarks.md, "A mixed batch").
        if batch > 1 and prompt_bucket(longest) < PREFILL_CHUNK:
            return None
        return PREFILL_CHUNK
    if prefill_chunk is None:
        return None
    if not is_int(prefill_chunk) or prefill_chunk < 16 or prefill_chunk % 16:
        raise ValueError(
            f'prefill_chunk must be "auto", None (one pass) or a multiple of 16 tokens, got {prefill_chunk!r}'
        )
    if mesh is not None:
        raise ValueError(
            f"prefill_chunk={prefill_chunk}: chunks of one row run on one device; on a mesh pass "
            '"auto" or None (the prompts in one pass, split by row)'
        )
    return int(prefill_chunk)


def check_logprobs(logprobs, vocab_size: int, name: str = "logprobs") -> int | None:
    """`generate`'s logprobs (or prompt_logprobs, `name`) as LoopSpec's: None (off) or the number N
    of most likely tokens reported beside each token's own logprob, an integer in 0..vocab_size."""
    if logprobs is None:
        return None
    if not is_int(logprobs) or not 0 <= logprobs <= vocab_size:
        raise ValueError(
            f"{name} must be None (off) or an integer in 0..{vocab_size} (the vocabulary's size): "
            f"the number of most likely tokens reported beside each token's own logprob, got {logprobs!r}"
        )
    return int(logprobs)


def cache_dtype_of(model: Model, cache_dtype) -> str:
    """The dtype name of the target's KV cache: `cache_dtype` ("float32", "bfloat16", "float16" or
    a jnp dtype), by default the model's own."""
    dtype = model.params.dtype.name
    try:
        return dtype if cache_dtype is None else dtype_name(cache_dtype)
    except ValueError as error:
        raise ValueError(f"cache_dtype: {error}") from None


def backend_for(
    model: Model,
    kernels="auto",
    matmul_precision=None,
    scan_layers=None,
    mesh=None,
    devices=None,
    platforms=None,
) -> backends.Backend:
    """The kernels and precision a program is traced with (specjax/kernels/backend.py): for
    `devices` (default: those of the mesh, or the default device), or, with `platforms`, for export
    to those platforms (no CPU FFI kernels: they are built for this host)."""
    precision = backends.default_precision(model.params.dtype.name, matmul_precision)
    if platforms is not None:
        sharded = mesh is not None
        return backends.Backend(
            tuple(platforms), kernels, precision, portable=True, sharded=sharded, scan_layers=scan_layers
        )
    if devices is None:  # the mesh's, or the default device
        devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    return backends.for_devices(devices, kernels, precision, mesh is not None, scan_layers)


def check_model(model) -> Model:
    if not isinstance(model, Model):
        raise ValueError(f"model must be a specjax.Model (from specjax.load), got {type(model).__name__}")
    return model


def check_fits_context(model: Model, longest: int, max_new_tokens: int, what: str = "prompts") -> None:
    """Refuse a prompt of `longest` tokens that with max_new_tokens exceeds the model's context."""
    context = model.config.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(
            f"{what}: the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens} it "
            f"exceeds the model's context of {context} tokens"
        )


def tokenize(model: Model, prompts, chat: bool) -> list[list[int]]:
    """Token ids per row. `prompts` is one prompt (a str, or with chat=True a conversation: a list
    of message dicts) or a list of prompts (strs, token-id lists, conversations)."""
    if isinstance(prompts, str) or is_conversation(prompts):
        return [prompt_ids(model, prompts, "prompts", chat)]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(
            "prompts must be a str, a list of str, a list of token-id lists or, with chat=True, a list "
            f"of messages or a list of such lists, got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty: got an empty list")
    return [prompt_ids(model, prompt, f"prompts[{i}]", chat) for i, prompt in enumerate(prompts)]


def prompt_ids(model: Model, prompt, name: str, chat: bool) -> list[int]:
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
        if chat and not has_chat_template(tokenizer):
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
    elif isinstance(prompt, Sequence | np.ndarray) and all(is_int(t) for t in prompt):
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


def eos_ids(model: Model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))


def row_samplings(sampling, num_rows: int) -> list[Sampling]:
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


def check_token_options(rows: list[Sampling], model: Model) -> None:
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


def call_key(key, rows: list[Sampling]) -> jax.Array:
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


def stop_token_ids(model: Model, rows: list[Sampling]) -> np.ndarray:
    """[B, M] int32: EOS and each row's stop token ids, padded with -1 (M a multiple of 4, so
    that a few more ids rarely compile a new program)."""
    eos = eos_ids(model)
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
    stats = device.memory_stats()  # None where the backend keeps none (the CPU)
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


def memory_shortfall(spec: LoopSpec, params=None) -> tuple[int, int] | None:
    """(bytes a program of `spec` needs beyond the weights, bytes the device has free) where it
    would not fit (`spec.memory_bytes`, estimated before anything is allocated); else None."""
    needed, available = memory_bytes(spec, params), available_memory_bytes()
    if spec.mesh is not None:  # rows and caches split over the data axis; an upper bound per device
        needed //= sharding.data_degree(spec.mesh)
    return (needed, available) if available is not None and needed > available else None


def check_memory(spec: LoopSpec, max_new_tokens: int, params=None) -> None:
    shortfall = memory_shortfall(spec, params)
    if shortfall is not None:
        (needed, available), gib = shortfall, 1 << 30
        raise ValueError(
            f"prompts and max_new_tokens={max_new_tokens}: a batch of {spec.batch_size} rows with prompts "
            f"padded to {spec.prompt_bucket} tokens and {spec.capacity} cache slots per row needs about "
            f"{needed:,} bytes ({needed / gib:.2f} GiB: KV caches, buffers and the prefill's and "
            f"attention's working memory), but the device has {available / gib:.2f} GiB free; use "
            "fewer or shorter prompts per call or a smaller max_new_tokens"
        )


@dataclasses.dataclass
class Plan:
    """A generation's program and arguments, made on the host before anything runs: `generate`
    compiles and calls it, `export_generate` lowers it for other platforms."""

    spec: LoopSpec
    params: Any
    proposer_params: Any
    inputs: GenerationInputs
    rows: list[list[int]]  # each prompt's token ids
    samplings: list[Sampling]  # each row's options


def plan(
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
    prefill_chunk="auto",
    logprobs=None,
    prompt_logprobs=None,
    page_size=None,
    *,
    agreement=None,
    devices=None,
    platforms=None,
) -> Plan:
    """Check `generate`'s arguments and make its program's spec and arguments: for `devices`
    (default: those of the mesh, or the default device), or, with `platforms`, for export to those
    platforms (no CPU FFI kernels: they are built for this host)."""
    check_model(model)
    if mesh is not None:
        sharding.check_mesh(mesh)
        sharding.check_model_split(mesh, model.config)
    check_int("max_new_tokens", max_new_tokens, 1)
    batch_buckets = check_batch_buckets(batch_buckets)
    logprobs = check_logprobs(logprobs, model.config.vocab_size)
    prompt_logprobs = check_logprobs(prompt_logprobs, model.config.vocab_size, "prompt_logprobs")
    dtype, cache_dtype = model.params.dtype.name, cache_dtype_of(model, cache_dtype)
    rows = tokenize(model, prompts, chat)
    samplings = row_samplings(sampling, len(rows))
    check_token_options(samplings, model)
    key = call_key(key, samplings)
    warp = WarpSpec.of(samplings)
    backend = backend_for(model, kernels, matmul_precision, scan_layers, mesh, devices, platforms)
    proposer_spec, proposer_params = resolve(proposer, model, warp, mesh)

    longest = max(len(r) for r in rows)
    check_fits_context(model, longest, max_new_tokens)
    # Padding rows (B - num_rows of them) have a one-token prompt, neutral options and no token to
    # generate: the loop counts them done from the start (see `prefill`); they are dropped below.
    num_rows = len(rows)
    B = batch_bucket(num_rows, batch_buckets, 1 if mesh is None else sharding.data_degree(mesh))
    page_size = check_page_size(page_size, model.config, mesh)
    chunk = prefill_chunk_of(
        prefill_chunk, mesh, backend, longest, B, pages_pack(page_size, backend, model.config, dtype)
    )
    if prompt_logprobs is not None:  # scored in the one-pass prefill (speculate/prompt_logprobs.py)
        if chunk is not None and prefill_chunk != "auto":
            raise ValueError(
                f"prompt_logprobs={prompt_logprobs} scores the prompts in one pass: give prefill_chunk "
                f'"auto" or None with it, got {prefill_chunk!r}'
            )
        chunk = None
    if chunk is None:
        bucket = prompt_bucket(longest)
        slots = capacity(bucket + max_new_tokens, proposer_spec)
    else:  # the prompts in the token buffer's width: the program depends on its capacity alone
        bucket = slots = chunked_capacity(longest, max_new_tokens, proposer_spec, chunk)
    if page_size is not None:  # whole pages per row (capacities are multiples of 16)
        slots = -(-slots // page_size) * page_size
        bucket = slots if chunk is not None else bucket
    padding = B - num_rows
    padded_samplings = samplings + [Sampling()] * padding  # warp and key come from the real rows
    if mesh is not None:
        sharding.check_batch_split(mesh, B)
    spec = LoopSpec(
        config=model.config,
        batch_size=B,
        prompt_bucket=bucket,
        capacity=slots,
        warp=warp,
        proposer=proposer_spec,
        mesh=mesh,
        dtype=dtype,
        cache_dtype=cache_dtype,
        backend=backend,
        prefill_chunk=chunk,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        page_size=page_size,
    )
    if platforms is None:  # (an exported program's device is not this one)
        check_memory(spec, max_new_tokens, model.params)
    padded = np.zeros((B, bucket), np.int32)
    for b, row in enumerate(rows):
        padded[b, : len(row)] = row
    stop_strings = None
    if any(s.stop for s in samplings):
        stop_strings = build_stop_strings(
            model.tokenizer, model.config.vocab_size, [s.stop for s in padded_samplings]
        )
    sampling_params = SamplingParams.of(padded_samplings, B, model.config.vocab_size)
    if any(s.constraint is not None for s in samplings):
        grammar = build_grammar(
            model.tokenizer, model.config.vocab_size, eos_ids(model), [s.constraint for s in padded_samplings]
        )
        sampling_params = sampling_params.replace(grammar=grammar)
    inputs = GenerationInputs(
        prompt_tokens=jnp.asarray(padded),
        prompt_lengths=jnp.asarray([len(r) for r in rows] + [1] * padding, jnp.int32),
        max_new_tokens=jnp.asarray([max_new_tokens] * num_rows + [0] * padding, jnp.int32),
        sampling=sampling_params,
        key=key,
        seeds=jnp.asarray([s.seed or 0 for s in padded_samplings], jnp.uint32),
        seeded=jnp.asarray([s.seed is not None for s in padded_samplings]),
        stop_token_ids=jnp.asarray(stop_token_ids(model, padded_samplings)),
        stop_strings=stop_strings,
    )
    agreement = agreement or sharding.CallAgreement(None, "plan")
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
        if proposer_params is not None:  # as the proposer asks: a draft model's split, heads replicated
            proposer_params = proposer_spec.place_params(proposer_params, mesh)
        inputs = sharding.shard_rows(inputs, mesh, B)
    else:
        params, proposer_params = kernel_weights(spec, params, proposer_params)
    return Plan(spec, params, proposer_params, inputs, rows, samplings)


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
    if spec.proposer is not None and proposer_params is not None:  # a draft model's, a head's own
        proposer_params = _with_panels(proposer_params, spec.proposer.with_panel_weights)
    return params, proposer_params


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
    if packed is params:  # nothing packed (a proposer whose params keep their layout)
        return params
    key, panels = id(params), _PANELS  # (the dict itself: at exit the module's names are gone first)
    _PANELS[key] = (weakref.ref(params, lambda _: panels.pop(key, None)), packed)
    return packed


def finish_reasons(
    model: Model,
    new_tokens: list[list[int]],
    samplings: list[Sampling],
    at_limit: list[bool],
    cut: list[bool],
    eos: Sequence[int] | None = None,
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
    across tokens (stops.py), `cut_text` cannot. `eos`: the ids that stop a row besides its stop
    token ids (None: the model's EOS; () for a request that ignores EOS)."""
    eos = set(eos_ids(model) if eos is None else eos)
    reasons = []
    for tokens, sampling, full, was_cut in zip(new_tokens, samplings, at_limit, cut, strict=True):
        stopped = not full or was_cut or tokens[-1] in eos | set(sampling.stop_token_ids)
        if not stopped and sampling.stop:
            texts = token_texts(model.tokenizer, model.config.vocab_size)  # cached per tokenizer
            read = "".join(texts[t] for t in tokens)
            stopped = any(s in read for s in sampling.stop)
        reasons.append("stop" if stopped else "length")
    return reasons
