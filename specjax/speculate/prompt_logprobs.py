"""Prompt logprobs (`generate(..., prompt_logprobs=N)`): each prompt token's logprob given the
tokens before it, and the N most likely tokens there, from the prefill's own pass.

The distribution is the model's own: the log-softmax of the raw logits at temperature 1 (no logit
bias, penalties or filters: the prompt's tokens were not sampled), as vLLM reports prompt
logprobs. The first prompt token has none (nothing comes before it).

A program with prompt logprobs prefills in one pass (`scored_whole_prefill`, `whole_prefill`'s
pass keeping every position's hidden state) and applies the LM head to those states
`SCORE_CHUNK` positions at a time, so that only [B, SCORE_CHUNK, V] logits exist at once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from specjax.models.cache import KVCache
from specjax.models.llama import lm_head
from specjax.models.params import LlamaParams
from specjax.speculate.logprobs import LogprobRecords, records
from specjax.speculate.sampling import WarpSpec
from specjax.speculate.spec import LoopSpec
from specjax.speculate.state import GenerationInputs, forward

SCORE_CHUNK = 16  # prompt positions per LM-head application (prompt buckets are multiples of 16)


def scored_whole_prefill(spec: LoopSpec, params: LlamaParams, inputs: GenerationInputs, cache: KVCache):
    """`whole_prefill` (speculate/prefill.py) that also scores the prompts: (logits [B, V] at each
    row's last prompt token, the proposer's features or None, the cache holding the prompts, and
    the prompt's records [B, T, ...]: at column t, prompt token t + 1's)."""
    B, T = inputs.prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, features, cache = forward(spec, params, inputs.prompt_tokens, positions, cache, empty_cache=True)
    logits = lm_head(params, hidden[jnp.arange(B), inputs.prompt_lengths - 1], spec.config)  # [B, V]
    scored = prompt_records(spec, params, hidden, inputs.prompt_tokens)
    features = features if spec.proposer_reads_features else None
    return logits, features, cache.advance(inputs.prompt_lengths), scored


def prompt_records(spec: LoopSpec, params: LlamaParams, hidden: jax.Array, prompt_tokens: jax.Array):
    """LogprobRecords [B, T, ...] of prompt_tokens [B, T] from the final-normed hidden states
    [B, T, D] of the pass over them: column t holds token t + 1 under the logits at t (the last
    column, and columns past a row's prompt, hold values never read)."""
    B, T, D = hidden.shape
    C = math.gcd(T, SCORE_CHUNK)
    following = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((B, 1), prompt_tokens.dtype)], axis=1)

    def score(chunk) -> LogprobRecords:
        states, tokens = chunk  # [B, C, D], [B, C]
        logits = lm_head(params, states, spec.config)  # [B, C, V]
        return records(spec.prompt_logprobs, logits, None, WarpSpec(), tokens)  # raw: temperature 1

    states = hidden.reshape(B, T // C, C, D).swapaxes(0, 1)
    tokens = following.reshape(B, T // C, C).swapaxes(0, 1)
    out = jax.lax.map(score, (states, tokens))  # [T/C, B, C, ...]
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape((B, T) + x.shape[3:]), out)
