"""Self-distillation data for the head trainers (Medusa, EAGLE).

The data are sequences (prompt + what the target generated for it, from `specjax.generate`) and
the target's final-normed hidden states along them, computed once (`distill_data`): the target
stays frozen, so training touches only the heads, and one set can train several kinds of head
(`DistillationData.save` / `load`).

Einsum letters: N sequences, B batch, T positions, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.models.cache import init_cache
from specjax.models.draft_vocab import frequent_tokens
from specjax.models.llama import forward_hidden
from specjax.models.model import Model
from specjax.models.params import LlamaParams
from specjax.models.signature import target_signature


@dataclasses.dataclass(frozen=True)
class DistillationData:
    """Distillation data, host-side numpy arrays.

    hidden [N, T, D] float32: the target's final-normed states; tokens [N, T] int32; mask [N, T]
    bool, True on the sequence's tokens, False on the right padding. `target` is the
    `target_signature` of the model they were taken from (None if unknown).
    """

    hidden: np.ndarray
    tokens: np.ndarray
    mask: np.ndarray
    target: dict | None = None

    def __post_init__(self):
        ok = self.tokens.ndim == 2 and self.hidden.ndim == 3
        if not ok or self.hidden.shape[:2] != self.tokens.shape or self.mask.shape != self.tokens.shape:
            raise ValueError(
                f"DistillationData shapes disagree: hidden {self.hidden.shape}, tokens {self.tokens.shape}, "
                f"mask {self.mask.shape} (allowed: [N, T, D], [N, T], [N, T])"
            )

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())

    def summary(self) -> dict:
        """What a run records about its data (training checkpoints, a head's meta)."""
        return {"num_sequences": self.num_sequences, "num_tokens": self.num_tokens}

    def check_target(self, model: Model) -> None:
        """Refuse a model the data were not taken from (the name aside: it is for people)."""
        if self.hidden.shape[2] != model.config.hidden_size:
            raise ValueError(
                f"data has hidden size {self.hidden.shape[2]}, the target {model.config.hidden_size}: "
                "distill the data from this target (specjax.train.distill_data)"
            )
        if self.target is None:
            return
        theirs = target_signature(model)
        if {k: v for k, v in theirs.items() if k != "name"} != {
            k: v for k, v in self.target.items() if k != "name"
        }:
            raise ValueError(
                f"data were distilled from target {self.target}, not from {theirs}: distill the data "
                "from this target (specjax.train.distill_data)"
            )

    def save(self, path: str | Path) -> None:
        """Write the arrays to `path` (an uncompressed .npz, written at exactly that name)."""
        arrays = {"hidden": self.hidden, "tokens": self.tokens, "mask": self.mask}
        if self.target is not None:
            arrays["target"] = np.array(json.dumps(self.target))  # a unicode scalar: no pickling
        with open(path, "wb") as file:
            np.savez(file, **arrays)

    @classmethod
    def load(cls, path: str | Path) -> DistillationData:
        """Read a set written by `save`; the constructor checks the shapes agree."""
        try:
            with np.load(path) as file:
                arrays = {name: file[name] for name in file.files}
        except FileNotFoundError as e:
            raise ValueError(f"no such distillation data file {str(path)!r}") from e
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            raise ValueError(f"{str(path)!r} is not a saved DistillationData (.npz): {e}") from e
        missing = {"hidden", "tokens", "mask"} - set(arrays)
        if missing:
            raise ValueError(f"{str(path)!r} is not a saved DistillationData: it has no {sorted(missing)}")
        return cls(
            hidden=arrays["hidden"].astype(np.float32, copy=False),
            tokens=arrays["tokens"].astype(np.int32, copy=False),
            mask=arrays["mask"].astype(bool, copy=False),
            target=json.loads(str(arrays["target"])) if "target" in arrays else None,
        )


def check_training_data(target: Model, data: DistillationData) -> None:
    """The trainers' checks on their `target` and `data` arguments."""
    if not isinstance(target, Model):
        raise ValueError(f"target must be a specjax.Model, got {type(target).__name__}")
    if not isinstance(data, DistillationData):
        raise ValueError(f"data must be a DistillationData (from distill_data), got {type(data).__name__}")
    data.check_target(target)


@functools.partial(jax.jit, static_argnames=("config",))
def _hidden_states(params: LlamaParams, config, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] (right-padded: causal attention keeps padding out of real positions) ->
    final-normed hidden states [B, T, D]."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    hidden, _ = forward_hidden(params, config, tokens, positions, init_cache(config, B, T), empty_cache=True)
    return hidden.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config", "layers"))
def _captured(params: LlamaParams, config, tokens: jax.Array, layers: tuple[int, ...]) -> jax.Array:
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = init_cache(config, B, T)
    _, _, captured = forward_hidden(
        params, config, tokens, positions, cache, empty_cache=True, capture=layers
    )
    return captured.astype(jnp.float32)


def target_features(target: Model, data: DistillationData, layers, batch_size: int = 8) -> np.ndarray:
    """The streams entering the target's `layers` along the data's sequences, side by side:
    [N, T, len(layers) * D] float32 (what EAGLE-3 and DFlash heads fuse), `batch_size` rows at a
    time (the last batch padded with empty rows: one compiled program)."""
    layers = tuple(int(i) for i in layers)
    N, T = data.tokens.shape
    out = np.zeros((N, T, len(layers) * target.config.hidden_size), np.float32)
    for start in range(0, N, batch_size):
        rows = data.tokens[start : start + batch_size]
        padded = np.zeros((batch_size, T), np.int32)
        padded[: len(rows)] = rows
        out[start : start + len(rows)] = np.asarray(
            _captured(target.params, target.config, jnp.asarray(padded), layers)
        )[: len(rows)]
    return out


def distill_data(
    target: Model, sequences: list[list[int]], max_len: int, batch_size: int = 8
) -> DistillationData:
    """The target's hidden states along `sequences` (prompt + the target's continuation each),
    right-padded to `max_len`, computed `batch_size` rows at a time (one compiled program: the
    last batch is padded with empty rows)."""
    if not isinstance(target, Model):
        raise ValueError(f"target must be a specjax.Model, got {type(target).__name__}")
    check_int("max_len", max_len, 2)
    check_int("batch_size", batch_size, 1)
    if max_len > target.config.max_position_embeddings:
        raise ValueError(
            f"max_len must be at most the target's max_position_embeddings "
            f"{target.config.max_position_embeddings}, got {max_len}"
        )
    if isinstance(sequences, str) or not sequences:
        raise ValueError("sequences must be a non-empty list of token-id lists")
    N, V = len(sequences), target.config.vocab_size
    tokens = np.zeros((N, max_len), np.int32)
    mask = np.zeros((N, max_len), bool)
    for i, seq in enumerate(sequences):
        seq = np.asarray(seq)
        if seq.ndim != 1 or not 1 <= len(seq) <= max_len:
            raise ValueError(
                f"sequences[{i}] must be a list of 1 to max_len={max_len} token ids, got shape {seq.shape}"
            )
        if not np.issubdtype(seq.dtype, np.integer) or seq.min() < 0 or seq.max() >= V:
            raise ValueError(f"sequences[{i}] must hold token ids in [0, {V}), got {seq.tolist()[:8]}...")
        tokens[i, : len(seq)] = seq
        mask[i, : len(seq)] = True
    hidden = np.zeros((N, max_len, target.config.hidden_size), np.float32)
    for start in range(0, N, batch_size):
        rows = tokens[start : start + batch_size]
        padded = np.zeros((batch_size, max_len), np.int32)
        padded[: len(rows)] = rows
        out = _hidden_states(target.params, target.config, jnp.asarray(padded))
        hidden[start : start + len(rows)] = np.asarray(out)[: len(rows)]
    return DistillationData(hidden=hidden, tokens=tokens, mask=mask, target=target_signature(target))


def choose_draft_vocab(target: Model, data: DistillationData, draft_vocab_size: int | None) -> np.ndarray:
    """A head's draft vocabulary: the `draft_vocab_size` most frequent tokens of the data, most
    frequent first (None: the whole vocabulary, in order)."""
    V = target.config.vocab_size
    if draft_vocab_size is None:
        return np.arange(V, dtype=np.int32)
    check_int("draft_vocab_size", draft_vocab_size, 1)
    if draft_vocab_size > V:
        raise ValueError(
            f"draft_vocab_size must be at most the target's vocab size {V}, got {draft_vocab_size}"
        )
    return frequent_tokens([data.tokens[data.mask]], V, draft_vocab_size)
