"""Medusa heads (Cai et al. 2024) as pure functions over a params pytree.

Head i is one residual SiLU block on the target's last hidden state h (final-normed, the input of
the LM head): `h_i = h + silu(h @ w[i] + b[i])`, read through the target's own (frozen) LM head.
Given the hidden state at position t, the target's head predicts the token at t + 1 and head i
the token at t + 2 + i.

Einsum letters: M heads, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.models.draft_vocab import check_draft_vocab
from specjax.models.model import Model
from specjax.models.signature import check_signature, target_signature


@dataclasses.dataclass(frozen=True)
class MedusaConfig:
    """Static shape of a set of Medusa heads."""

    num_heads: int
    hidden_size: int
    vocab_size: int  # the target's: heads read tokens through its LM head
    draft_vocab_size: int | None = None  # tokens the heads draft from (models/draft_vocab.py); None: all
    # Medusa's released heads: residual blocks per head, and an LM head of each head's own (trained
    # from a copy of the target's) rather than the target's frozen one.
    num_layers: int = 1
    own_lm_heads: bool = False

    def __post_init__(self):
        for name in ("num_heads", "hidden_size", "vocab_size"):
            check_int(f"MedusaConfig {name}", getattr(self, name), 1)
        if self.draft_vocab_size is None:
            object.__setattr__(self, "draft_vocab_size", self.vocab_size)
        W = self.draft_vocab_size
        check_int("MedusaConfig draft_vocab_size", W, 1, self.vocab_size)


@flax.struct.dataclass
class MedusaParams:
    w: jax.Array  # [M, D, D]
    b: jax.Array  # [M, D]
    more_w: jax.Array | None = None  # [M, L-1, D, D]: residual blocks after the first (num_layers > 1)
    more_b: jax.Array | None = None  # [M, L-1, D]
    lm_heads: jax.Array | None = None  # [M, D, V]: each head's own LM head (own_lm_heads)


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
    features = hidden[..., None, :] + jax.nn.silu(pre)
    if params.more_w is not None:
        for layer in range(params.more_w.shape[1]):
            pre = jnp.einsum("...md,mde->...me", features, params.more_w[:, layer]) + params.more_b[:, layer]
            features = features + jax.nn.silu(pre)
    return features


def medusa_logits(params: MedusaParams, features: jax.Array) -> jax.Array:
    """features [..., M, D] -> each head's logits through its own LM head [..., M, V], float32."""
    return jnp.einsum("...md,mdv->...mv", features, params.lm_heads, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class MedusaHead:
    """Trained (or freshly initialised) Medusa heads and the target they belong to.

    `target` is `target_signature` of that model; `meta` records how the heads were made
    (training data, steps, seed), for the checkpoint's metadata file; `vocab [W]` the token ids
    the heads draft from (None: all of them, in order; see models/draft_vocab.py).
    """

    config: MedusaConfig
    params: MedusaParams
    target: dict
    meta: dict = dataclasses.field(default_factory=dict)
    vocab: np.ndarray | None = None

    def __post_init__(self):
        if self.vocab is None:
            object.__setattr__(self, "vocab", np.arange(self.config.draft_vocab_size, dtype=np.int32))
        vocab = check_draft_vocab("Medusa", self.vocab, self.config.vocab_size, self.config.draft_vocab_size)
        object.__setattr__(self, "vocab", vocab)

    @classmethod
    def init(
        cls,
        target: Model,
        num_heads: int,
        key: jax.Array | None = None,
        scale: float = 0.0,
        vocab=None,
        **meta: Any,
    ) -> MedusaHead:
        """Fresh heads for `target` (identity heads, or noisy ones with scale > 0: tests), drafting
        from `vocab` (token ids; default: all)."""
        V = target.config.vocab_size
        vocab = np.arange(V, dtype=np.int32) if vocab is None else check_draft_vocab("Medusa", vocab, V)
        config = MedusaConfig(num_heads, target.config.hidden_size, V, len(vocab))
        return cls(config, init_medusa(config, key, scale), target_signature(target), dict(meta), vocab)

    def check_target(self, model: Model) -> None:
        """Refuse a model the heads were not trained for, naming both."""
        c = model.config
        if (c.hidden_size, c.vocab_size) != (self.config.hidden_size, self.config.vocab_size):
            raise ValueError(
                f"Medusa head is for hidden size {self.config.hidden_size} and vocab "
                f"{self.config.vocab_size}, the target {model.name!r} has {c.hidden_size} and {c.vocab_size}"
            )
        if self.target:  # heads trained here; published ones ({}) are checked by their shapes only
            check_signature("Medusa", self.target, model, "specjax.train.train_medusa")
