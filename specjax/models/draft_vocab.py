"""Draft vocabularies: the tokens a trained head (Medusa, EAGLE) may draft.

Reading the full LM head is the largest cost of a head's draft step on a small target
(SmolLM2-135M: a 113 MB head beside a 16 MB EAGLE layer), so a head may draft from a subset of
the vocabulary: the most frequent tokens of its training data, as FR-Spec and EAGLE-3 do. The
target's head columns for those tokens are gathered once per generate call. Verification still
scores the full vocabulary, so a subset only limits what can be drafted, never what is emitted.

Einsum letters: D hidden, W draft vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.kernels import PanelWeight, backend
from specjax.models.params import LlamaParams
from specjax.models.quantized import columns


def check_draft_vocab(owner: str, vocab, vocab_size: int, size: int | None = None) -> np.ndarray:
    """A draft vocabulary as int32 numpy: distinct token ids in [0, vocab_size), `size` of them
    when given (a head's config says how many)."""
    array = np.asarray(vocab)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{owner} draft vocab must be a non-empty 1-D array of token ids, got {array!r:.80}")
    if array.min() < 0 or array.max() >= vocab_size:
        raise ValueError(
            f"{owner} draft vocab must hold token ids in [0, {vocab_size}), "
            f"got min {array.min()} max {array.max()}"
        )
    if len(np.unique(array)) != len(array):
        raise ValueError(f"{owner} draft vocab must not repeat a token id")
    if size is not None and len(array) != size:
        raise ValueError(f"{owner} head vocab holds {len(array)} tokens, its config draft_vocab_size {size}")
    return array.astype(np.int32)


def frequent_tokens(sequences, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent token ids in `sequences` (lists or arrays of ids), most frequent
    first, ties by id; tokens never seen fill the remainder in id order."""
    check_int("draft vocab size", size, 1, vocab_size)
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        np.add.at(counts, np.asarray(seq, np.int64), 1)
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return order[:size].astype(np.int32)


def draft_head_matrix(target_params: LlamaParams, vocab: jax.Array) -> jax.Array:
    """The target's LM head restricted to the draft vocabulary: [D, W] (a quantized head's
    columns stay quantized)."""
    if target_params.lm_head is None:
        return target_params.embed[vocab].T
    return columns(target_params.lm_head, vocab)


def draft_logits(head_matrix: jax.Array | PanelWeight, features: jax.Array) -> jax.Array:
    """features [..., D] -> logits over the draft vocabulary [..., W], float32 (one 2-D product:
    see llama.lm_head for why); head_matrix may be panels (`pack`, for drafting on the CPU)."""
    rows = features.reshape(-1, features.shape[-1])
    logits = backend.active().product_f32(rows, head_matrix)  # (a QuantizedWeight too)
    return logits.reshape(*features.shape[:-1], head_matrix.shape[-1]).astype(jnp.float32)
