"""`generate()`: the host side of a generation.

Validate, tokenize, right-pad to a length bucket, make one call of the compiled program, fetch
the result once, detokenize. All per-step work happens on the device inside that one call.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.models.model import Model
from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program
from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.proposers import resolve
from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec

MIN_BUCKET = 16  # shortest prompt bucket; buckets double from here up to BUCKET_STEP
BUCKET_STEP = 64  # longer prompts round up to a multiple of this
CAPACITY_GRANULE = 128  # cache capacity rounds up to a multiple of this


@dataclasses.dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per row, ending at EOS (included) or max_new_tokens
    texts: list[str] | None  # decoded new tokens (None without a tokenizer)
    metrics: SpecMetrics
    prompt_tokens: list[list[int]]  # the token ids each row was fed


def prompt_bucket(length: int) -> int:
    """The padded prompt length: 16, 32, 64, then the next multiple of 64.

    Coarser buckets compile fewer programs; finer ones waste less prefill on padding (a 769-token
    prompt padded to 1024 spent a third of its prefill on padding).
    """
    if length <= BUCKET_STEP:
        return max(MIN_BUCKET, 1 << (length - 1).bit_length())
    return -(-length // BUCKET_STEP) * BUCKET_STEP


# Compiled programs by (LoopSpec, params structure): a repeated call skips tracing and compiling.
_COMPILED: dict[tuple, Any] = {}


def compiled_program_count() -> int:
    """How many generation programs have been compiled in this process (tests use this)."""
    return len(_COMPILED)


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    # The sharding too: a program is compiled for its inputs' placement.
    return (treedef, tuple((x.shape, str(x.dtype), x.sharding) for x in leaves))


def _compiled(spec: LoopSpec, params, proposer_params, inputs: GenerationInputs) -> tuple[Any, float]:
    key = (spec, _signature(params), _signature(proposer_params), _signature(inputs))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    program = (
        jax.jit(generate_program, static_argnums=0).lower(spec, params, proposer_params, inputs).compile()
    )
    _COMPILED[key] = program
    return program, time.perf_counter() - start


def _tokenize(model: Model, prompts, chat: bool) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(
            f"prompts must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts must not be empty: got an empty list")
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if model.tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but the model has no tokenizer; pass token ids")
            if chat:
                messages = [{"role": "user", "content": prompt}]
                prompt = model.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
                ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = model.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, Sequence | np.ndarray) and all(
            isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt
        ):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
            if bad:
                vocab = model.config.vocab_size
                raise ValueError(f"prompts[{i}] holds token id {bad[0]} outside the vocabulary [0, {vocab})")
        else:
            raise ValueError(
                f"prompts[{i}] must be a str or a list of int token ids, got {type(prompt).__name__}"
            )
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token")
        rows.append(ids)
    return rows


def _eos_ids(model: Model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    return tuple(sorted(ids))


def generate(
    model: Model,
    prompts: str | Sequence[str] | Sequence[Sequence[int]],
    proposer=None,
    sampling: Sampling | None = None,
    max_new_tokens: int = 128,
    key: jax.Array | None = None,
    chat: bool = False,
    mesh=None,
) -> GenerateResult:
    """Generate up to `max_new_tokens` tokens per prompt; see DESIGN.md section 3."""
    if not isinstance(model, Model):
        raise ValueError(f"model must be a specjax.Model (from specjax.load), got {type(model).__name__}")
    if mesh is not None:
        sharding.check_mesh(mesh)
        sharding.check_model_split(mesh, model.config)
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a specjax.Sampling, got {type(sampling).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not sampling.greedy and key is None:
        raise ValueError(
            f"key is required when sampling with temperature={sampling.temperature} > 0: "
            "pass key=jax.random.key(seed)"
        )
    key = jax.random.key(0) if key is None else key
    warp = WarpSpec.of(sampling)
    proposer_spec, proposer_params = resolve(proposer, model, warp, mesh)
    k = 0 if proposer_spec is None else proposer_spec.k

    rows = _tokenize(model, prompts, chat)
    longest = max(len(r) for r in rows)
    context = model.config.max_position_embeddings
    if longest + max_new_tokens > context:
        raise ValueError(
            f"prompts: the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens} it "
            f"exceeds the model's context of {context} tokens"
        )
    B, bucket = len(rows), prompt_bucket(longest)
    if mesh is not None:
        sharding.check_batch_split(mesh, B)
    capacity = -(-(bucket + max_new_tokens + k + 1) // CAPACITY_GRANULE) * CAPACITY_GRANULE
    spec = LoopSpec(
        config=model.config,
        batch_size=B,
        prompt_bucket=bucket,
        capacity=capacity,
        warp=warp,
        eos_token_ids=_eos_ids(model),
        proposer=proposer_spec,
        mesh=mesh,
    )
    padded = np.zeros((B, bucket), np.int32)
    for b, row in enumerate(rows):
        padded[b, : len(row)] = row
    inputs = GenerationInputs(
        prompt_tokens=jnp.asarray(padded),
        prompt_lengths=jnp.asarray([len(r) for r in rows], jnp.int32),
        max_new_tokens=jnp.full((B,), max_new_tokens, jnp.int32),
        sampling=SamplingParams.of(sampling, B),
        key=key,
    )
    params = model.params
    if mesh is not None:  # no-ops for arrays already placed, e.g. by specjax.load(..., mesh=mesh)
        params = sharding.shard_params(params, model.config, mesh)
        if proposer_params is not None:  # a DraftModel's own weights, placed as it asks
            proposer_params = sharding.shard_params(
                proposer_params, proposer_spec.config, mesh, proposer_spec.tensor_parallel
            )
        inputs = sharding.shard_rows(inputs, mesh, B)
    program, compile_time = _compiled(spec, params, proposer_params, inputs)
    start = time.perf_counter()
    state = program(params, proposer_params, inputs)
    fetch = jax.device_get if mesh is None else sharding.fetch  # the latter spans hosts too
    tokens, lengths, nonfinite, counters = fetch(
        (state.tokens, state.lengths, state.nonfinite, state.metrics)
    )
    run_time = time.perf_counter() - start

    if nonfinite.any():
        bad = [int(b) for b in np.flatnonzero(nonfinite)]
        raise FloatingPointError(f"the model produced non-finite logits for rows {bad}: check its weights")
    new_tokens = [tokens[b, len(row) : lengths[b]].tolist() for b, row in enumerate(rows)]
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(t, skip_special_tokens=True) for t in new_tokens]
    metrics = SpecMetrics.from_counters(counters, k=k, compile_time_s=compile_time, run_time_s=run_time)
    return GenerateResult(tokens=new_tokens, texts=texts, metrics=metrics, prompt_tokens=rows)
