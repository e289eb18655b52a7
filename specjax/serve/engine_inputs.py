"""What the engine builds before its programs run (specjax/serve/engine.py): its rows' capacity and
the memory check, and the loop's inputs from its slots' requests (per row its sampling options,
stop token ids, stop-string mask and whether it speculates)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import planner
from specjax.serve.engine_config import MAX_STOP_TOKEN_IDS, EngineConfig, admission_bucket
from specjax.speculate.grammar import Grammar
from specjax.speculate.loop import GenerationInputs, LoopSpec
from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec
from specjax.speculate.stops import StopStrings


def engine_capacity(config: EngineConfig, proposer_spec) -> int:
    """Cache slots per row: max_model_len tokens and a verify pass, and room for a long prompt's
    last chunk, whose padding is written past the prompt."""
    capacity = planner.capacity(config.max_model_len, proposer_spec)
    chunk = config.prefill_chunk
    return capacity if chunk is None else max(capacity, -(-config.max_model_len // chunk) * chunk)


def check_memory(config: EngineConfig, spec: LoopSpec, params) -> None:
    """Refuse a batch whose caches and working memory do not fit (before allocating them): with
    long prompts in chunks, the widest one-pass prefill is a chunk's, beside one more row (the
    prompt in chunks)."""
    chunk, length = config.prefill_chunk, config.max_model_len
    longest = length if chunk is None else min(length, chunk)
    rows = config.max_batch + (chunk is not None and length > chunk)
    bucket = min(admission_bucket(longest), spec.capacity)
    spec = dataclasses.replace(spec, prompt_bucket=bucket, batch_size=rows)
    shortfall = planner.memory_shortfall(spec, params)
    if shortfall is not None:
        (needed, available), gib = shortfall, 1 << 30
        raise ValueError(
            f"max_batch={config.max_batch} and max_model_len={length}: the slots' caches "
            f"({spec.capacity} slots per row) and working memory need about {needed / gib:.2f} GiB, "
            f"but the device has {available / gib:.2f} GiB free; use a smaller max_batch or "
            "max_model_len"
        )


def loop_inputs(
    samplings: Sequence[Sampling],
    stop_ids: Sequence[frozenset],
    speculate: Sequence[bool],
    *,
    vocab_size: int,
    warp: WarpSpec,
    key: jax.Array,
    stop_tables: StopStrings | None,
    stop_masks: Sequence[int],
    grammar: Grammar | None = None,
    prompt_tokens=None,
    prompt_lengths=None,
    max_new_tokens=None,
    seeded: bool = False,
) -> GenerationInputs:
    """Inputs of len(samplings) rows. The prompt's fields default to a one-token prompt with
    nothing to generate (what the loop over running rows reads none of, and what a free row
    holds); `seeded`: the rows' own seeds, where their Sampling has one (a prefill's); `grammar`:
    the constraint tables, with the rows' start states (engine_automata.ConstraintPool)."""
    n = len(samplings)
    params = SamplingParams.of(list(samplings), n, vocab_size).replace(grammar=grammar)
    if warp.logit_bias and params.logit_bias is None:  # the program reads one
        params = params.replace(logit_bias=jnp.zeros((n, vocab_size)))
    table = np.full((n, MAX_STOP_TOKEN_IDS), -1, np.int32)
    for i, ids in enumerate(stop_ids):
        table[i, : len(ids)] = sorted(ids)
    stop_strings = None
    if stop_tables is not None:
        stop_strings = stop_tables.replace(row_mask=jnp.asarray(list(stop_masks), jnp.int32))
    return GenerationInputs(
        prompt_tokens=jnp.zeros((n, 1), jnp.int32) if prompt_tokens is None else jnp.asarray(prompt_tokens),
        prompt_lengths=jnp.asarray(np.ones(n) if prompt_lengths is None else prompt_lengths, jnp.int32),
        max_new_tokens=jnp.asarray(np.zeros(n) if max_new_tokens is None else max_new_tokens, jnp.int32),
        sampling=params,
        key=key,
        seeds=jnp.asarray([(s.seed or 0) if seeded else 0 for s in samplings], jnp.uint32),
        seeded=jnp.asarray([seeded and s.seed is not None for s in samplings], bool),
        stop_token_ids=jnp.asarray(table),
        stop_strings=stop_strings,
        speculate=jnp.asarray(list(speculate), bool),
    )


def check_warp(sampling: Sampling, have: WarpSpec) -> None:
    """A request may use only the sampling code paths the engine was compiled with (`have`)."""
    need = WarpSpec.of(sampling)
    paths = {
        "top_k": (need.top_k, have.top_k),
        "top_p": (need.top_p, have.top_p),
        "min_p": (need.min_p, have.min_p),
        "penalties": (need.penalties, have.penalties),
        "logit_bias": (need.logit_bias, have.logit_bias),
    }
    missing = [name for name, (wanted, built) in paths.items() if wanted and not built]
    if not need.greedy and have.greedy:
        missing.insert(0, "temperature > 0")
    if missing:
        raise ValueError(
            f"sampling: this engine was built without {', '.join(missing)} (its warp is {have}); "
            "build it with warp=None (every option) to serve such requests"
        )
