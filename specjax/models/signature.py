"""What identifies the target a trained head (Medusa, EAGLE) belongs to, and the check on use."""

from __future__ import annotations

import hashlib
from typing import Protocol

import jax

from specjax.models.config import LlamaConfig
from specjax.models.params import LlamaParams


class Target(Protocol):
    """What a signature reads of a model: a `specjax.models.Model`, described here rather than
    imported, because model.py checks heads against it (`Model.with_mtp`): importing it would
    close an import circle."""

    name: str
    config: LlamaConfig
    params: LlamaParams


def target_signature(model: Target) -> dict:
    """What identifies the model a head was trained on: its name, the config fields the head
    depends on, and a digest of a few of its weights (two random models of one config differ)."""
    c = model.config
    params = jax.device_get((model.params.embed[:4], model.params.final_norm))
    sample = b"".join(a.tobytes() for a in params)
    return {
        "name": model.name,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_layers,
        "weights_digest": hashlib.sha256(sample).hexdigest()[:16],
    }


def check_signature(kind: str, signature: dict, model: Target, trainer: str) -> None:
    """Refuse `model` unless it is the target `signature` was taken from, naming both. The name is
    left out of the comparison: it is for people, and one model loaded from two paths has two."""
    theirs = target_signature(model)
    if {k: v for k, v in theirs.items() if k != "name"} != {
        k: v for k, v in signature.items() if k != "name"
    }:
        raise ValueError(
            f"{kind} head was trained for target {signature}, not for {theirs}: train a head for "
            f"this model ({trainer})"
        )
