"""Medusa heads (Cai et al. 2024) as pure functions over a params pytree.

Head i is one residual SiLU block on the target's last hidden state h (final-normed, the input of
the LM head): `h_i = h + silu(h @ w[i] + b[i])`, read through the target's own (frozen) LM head.
Given the hidden state at position t, the target's head predicts the token at t + 1 and head i
the token at t + 2 + i.

Einsum letters: M heads, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax.models.llama import LlamaParams, lm_head
from specjax.models.model import Model


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """Static shape of a set of Medusa heads."""

    num_heads: int
    hidden_size: int
    vocab_size: int  # the target's: heads read tokens through its LM head

    def __post_init__(self):
        for name in ("num_heads", "hidden_size", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaConfig {name} must be an integer >= 1, got {value!r}")


@flax.struct.dataclass
class MedusaParams:
    w: jax.Array  # [M, D, D]
    b: jax.Array  # [M, D]


def init_medusa(config: MedusaConfig, key: jax.Array | None = None, scale: float = 0.0) -> MedusaParams:
    """Heads that start as the identity (w = 0, b = 0: every head predicts what the target's head
    does, Medusa's initialisation); `scale` > 0 adds Gaussian noise of that scale to w (tests)."""
    M, D = config.num_heads, config.hidden_size
    w = jnp.zeros((M, D, D), jnp.float32)
    if scale:
        w = scale * jax.random.normal(key, (M, D, D), jnp.float32) / jnp.sqrt(D)
    return MedusaParams(w=w, b=jnp.zeros((M, D), jnp.float32))


def medusa_hidden(params: MedusaParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] -> every head's features [..., M, D]."""
    pre = jnp.einsum("...d,mde->...me", hidden, params.w) + params.b
    return hidden[..., None, :] + jax.nn.silu(pre)


def medusa_logits(params: MedusaParams, target_params: LlamaParams, hidden: jax.Array) -> jax.Array:
    """hidden [..., D] (the target's final-normed states) -> logits [..., M, V] in float32."""
    return lm_head(target_params, medusa_hidden(params, hidden))


def target_signature(model: Model) -> dict:
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


@dataclasses.dataclass(frozen=True, eq=False)
class MedusaHead:
    """Trained (or freshly initialised) Medusa heads and the target they belong to.

    `target` is `target_signature` of that model; `meta` records how the heads were made
    (training data, steps, seed), for the checkpoint's metadata file.
    """

    config: MedusaConfig
    params: MedusaParams
    target: dict
    meta: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def init(
        cls, target: Model, num_heads: int, key: jax.Array | None = None, scale: float = 0.0, **meta: Any
    ) -> MedusaHead:
        """Fresh heads for `target` (identity heads, or noisy ones with scale > 0: tests)."""
        config = MedusaConfig(num_heads, target.config.hidden_size, target.config.vocab_size)
        return cls(config, init_medusa(config, key, scale), target_signature(target), dict(meta))

    def check_target(self, model: Model) -> None:
        """Refuse a model the heads were not trained for, naming both."""
        c = model.config
        if (c.hidden_size, c.vocab_size) != (self.config.hidden_size, self.config.vocab_size):
            raise ValueError(
                f"Medusa head is for hidden size {self.config.hidden_size} and vocab "
                f"{self.config.vocab_size}, the target {model.name!r} has {c.hidden_size} and {c.vocab_size}"
            )
        theirs = target_signature(model)
        same = {k: v for k, v in theirs.items() if k != "name"} == {
            k: v for k, v in self.target.items() if k != "name"
        }  # the name is for people: one model loaded from two paths has two names
        if not same:
            raise ValueError(
                f"Medusa head was trained for target {self.target}, not for {theirs}: train a head for "
                "this model (specjax.train.train_medusa)"
            )
