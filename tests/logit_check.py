"""Logits of our forward for a padded batch, prefilled and then decoded token by token.

Shared by the loader tests: each row's reference comes from a torch model run on that row alone,
so padding, per-row cache lengths and the cache itself are all under test.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from specjax.models import forward, init_cache

_forward = jax.jit(forward, static_argnums=1)


def prefill_and_decode(model, prompts: list[list[int]], continuations: list[list[int]]):
    """Our logits for each row: prefill [len(prompt), V] and decode [len(continuation), V].

    The prompts are right-padded into one prefill call; then continuation tokens are fed one per
    step through the KV cache (row b's step s sees prompt + continuation[:s+1]).
    """
    B, T = len(prompts), max(len(p) for p in prompts)
    steps = len(continuations[0])
    assert all(len(c) == steps for c in continuations)
    tokens = np.zeros((B, T), np.int32)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = prompt
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    cache = init_cache(model.config, B, T + steps)
    logits, _, cache = _forward(model.params, model.config, tokens, positions, cache)
    cache = cache.advance(np.array([len(p) for p in prompts], np.int32))
    prefill = [np.asarray(logits[b, : len(p)]) for b, p in enumerate(prompts)]
    decode = [[] for _ in range(B)]
    for s in range(steps):
        step_tokens = np.array([[c[s]] for c in continuations], np.int32)
        positions = np.asarray(cache.lengths)[:, None]
        logits, _, cache = _forward(model.params, model.config, step_tokens, positions, cache)
        cache = cache.advance(np.ones(B, np.int32))
        for b in range(B):
            decode[b].append(np.asarray(logits[b, 0]))
    return prefill, [np.stack(rows) if rows else np.zeros((0,)) for rows in decode]


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """Worst over positions of max |ours - reference| / max |reference| at that position."""
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    diff = np.abs(ours - reference).max(axis=-1)
    scale = np.abs(reference).max(axis=-1)
    return float((diff / scale).max())


def torch_logits(torch_model, ids: list[int]) -> np.ndarray:
    """[len(ids), V] float32 logits of a torch causal LM on one unpadded row."""
    with torch.no_grad():
        out = torch_model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def compare_with_torch(model, torch_model, prompts, continuations) -> float:
    """The worst relative logit error of our prefill + cached decode against the torch model."""
    prefill, decode = prefill_and_decode(model, prompts, continuations)
    worst = 0.0
    for b, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
        # The reference sees the whole row at once: its logits at position len(prompt) + s are the
        # ones our decode step s produces after being fed continuation[s].
        reference = torch_logits(torch_model, prompt + continuation)
        n = len(prompt)
        worst = max(worst, relative_error(prefill[b], reference[:n]))
        if continuation:
            worst = max(worst, relative_error(decode[b], reference[n : n + len(continuation)]))
    return worst
