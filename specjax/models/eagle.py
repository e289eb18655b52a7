"""EAGLE heads (Li et al. 2024, version 1) as pure functions over a params pytree.

An EAGLE head drafts in the target's feature space. Its input at position t is the target's
final-normed hidden state f_t fused with the embedding of the token x_{t+1} that followed
(`fc`: [2D] -> [D]); one decoder layer, shaped like the target's and run with the target's
rotary settings over the head's own KV cache, turns it into a prediction of f_{t+1}, and the
target's frozen LM head reads the token x_{t+2} from that. Drafting continues from its own
predictions: (f^_{t+1}, x^_{t+2}) -> f^_{t+2}, and so on.

A head may draft from a subset of the vocabulary (models/draft_vocab.py): a small target's LM
head costs more to read than the head's own layer.

Einsum letters: B batch, T positions, D hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int
from specjax.kernels import pack
from specjax.kernels.layouts import panel_layer
from specjax.models.cache import KVCache
from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.draft_vocab import check_draft_vocab
from specjax.models.llama import attention_keys_values, decoder_layers
from specjax.models.model import Model
from specjax.models.params import LayerParams, checkpoint_layer_shapes, layer_from_checkpoint
from specjax.models.products import project
from specjax.models.signature import check_signature, target_signature

# The fields an EAGLE head shares with its target's LlamaConfig: its layer's shapes, rotary
# settings and the vocabulary it reads tokens from.
_SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
_LAYER_FIELDS = (
    *_SIZE_FIELDS,
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "qkv_bias",
)


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Static shape of an EAGLE head: the target's layer shape and rotary settings, its vocabulary
    size, and how many tokens the head drafts from."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # tokens the head can draft (<= vocab_size)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    # Whether the layer norms its input (EAGLE-1's released heads do not: their layer 0 has no
    # input_layernorm, and the fused input goes to attention as it is).
    input_norm: bool = True

    def __post_init__(self):
        for name in _SIZE_FIELDS:
            check_int(f"EagleConfig {name}", getattr(self, name), 1)
        W = self.draft_vocab_size
        check_int("EagleConfig draft_vocab_size", W, 1, self.vocab_size)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @classmethod
    def for_target(cls, config: LlamaConfig, draft_vocab_size: int | None = None) -> EagleConfig:
        draft = config.vocab_size if draft_vocab_size is None else draft_vocab_size
        return cls(draft_vocab_size=draft, **{name: getattr(config, name) for name in _LAYER_FIELDS})

    @property
    def layer_config(self) -> LlamaConfig:
        """A one-layer LlamaConfig with the head's shapes: what the decoder layer code runs on."""
        return LlamaConfig(num_layers=1, **{name: getattr(self, name) for name in _LAYER_FIELDS})

    def matches(self, config: LlamaConfig) -> bool:
        """Whether a target of `config` has the shapes and rotary settings this head was built for.
        Floats compare to float32 precision: a GGUF stores them as float32 (1e-5 reads back as
        9.99999975e-06 or as 1e-5, depending on the reader), and a head saved with one form
        belongs to the target read with the other."""
        theirs = EagleConfig.for_target(config)
        for field in dataclasses.fields(self):
            mine, other = getattr(self, field.name), getattr(theirs, field.name)
            if field.name in ("draft_vocab_size", "input_norm"):  # the head's own choices
                continue
            if isinstance(mine, float) and isinstance(other, float):
                if not math.isclose(mine, other, rel_tol=1e-6):
                    return False
            elif mine != other:
                return False
        return True


@flax.struct.dataclass
class EagleParams:
    fc: jax.Array  # [2D, D]: (hidden state, next token's embedding) -> the layer's input
    fc_bias: jax.Array  # [D]
    layer: LayerParams  # one decoder layer shaped like the target's


def init_eagle(config: EagleConfig, key: jax.Array, scale: float = 1.0) -> EagleParams:
    """A fresh head. `fc` starts as the identity on the hidden state plus a little noise, and the
    layer's output projections (o, down) small, so an untrained head predicts f_{t+1} ~ f_t and
    training starts from a stable point. `scale` multiplies every random part (tests use larger
    ones to make heads that draft something other than the target's own guess)."""
    D = config.hidden_size
    fc_key, layer_key = jax.random.split(key)
    fc = jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))], axis=0)
    fc = fc + scale * 0.02 * jax.random.normal(fc_key, (2 * D, D), jnp.float32)
    shapes = checkpoint_layer_shapes(config.layer_config)  # drawn with q, k, v apart, then fused
    fields = {}
    for leaf_key, (name, shape) in zip(jax.random.split(layer_key, len(shapes)), shapes.items(), strict=True):
        if "norm" in name:
            fields[name] = jnp.ones(shape, jnp.float32)
        elif "bias" in name:
            fields[name] = jnp.zeros(shape, jnp.float32)
        else:
            small = 0.1 if name in ("o", "down") else 1.0
            fields[name] = (
                scale * small * jax.random.normal(leaf_key, shape, jnp.float32) / math.sqrt(shape[0])
            )
    layer = layer_from_checkpoint(fields, config.layer_config)
    return EagleParams(fc=fc, fc_bias=jnp.zeros((D,), jnp.float32), layer=layer)


def eagle_features(
    params: EagleParams,
    config: EagleConfig,
    embed: jax.Array,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    fresh_mask=None,
    empty_cache: bool = False,
    visible=None,
) -> tuple[jax.Array, KVCache]:
    """Predicted features [B, T, D] for inputs (hidden [B, T, D], next_tokens [B, T]) at positions
    [B, T]; the head's one-layer cache gets their keys and values at slots `cache.lengths + t`
    (advancing is the caller's). `embed` is the target's embedding table [V, D]; `visible`
    [B, T, S] overrides which cache slots each input attends to (see `decoder_layers`)."""
    return decoder_layers(
        (params.layer,),
        config.layer_config,
        _layer_input(params, embed, hidden, next_tokens),
        positions,
        cache,
        fresh_mask,
        empty_cache,
        visible=visible,
        first_attention_input=None if config.input_norm else _unnormed,
    )


def eagle_entries(
    params: EagleParams,
    config: EagleConfig,
    embed: jax.Array,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
) -> KVCache:
    """The head's cache with the keys and values of inputs (hidden [B, T, D], next_tokens [B, T])
    at positions [B, T] written at slots `cache.lengths + t`, as `eagle_features` writes them,
    without computing its outputs: a catch-up on a step whose drafts come from elsewhere costs
    the fc and the key and value projections only."""
    k, v = attention_keys_values(
        config.layer_config,
        params.layer,
        _layer_input(params, embed, hidden, next_tokens),
        positions,
        attention_input=None if config.input_norm else _unnormed,
    )
    return cache.replace(k=(cache.write_keys(cache.k[0], k),), v=(cache.write_values(cache.v[0], v),))


def _layer_input(params: EagleParams, embed, hidden, next_tokens) -> jax.Array:
    """fc over (the feature, the next token's embedding): the layer's input [B, T, D]."""
    return project(jnp.concatenate([hidden, embed[next_tokens]], axis=-1), params.fc) + params.fc_bias


def eagle_panel_weights(params: EagleParams) -> EagleParams:
    """The head with fc and its layer's projections as panels, for drafting on the CPU (as
    `layouts.with_panel_weights` for a target: no gradient, float32)."""
    return params.replace(fc=pack(params.fc), layer=panel_layer(params.layer))


def _unnormed(x, lp):  # EAGLE-1's release: no norm before the layer's attention
    return x, x


@dataclasses.dataclass(frozen=True, eq=False)
class EagleHead:
    """A trained (or freshly initialised) EAGLE head, its draft vocabulary and its target.

    `vocab [W]` holds the token ids the head drafts from (all of them, in order, by default);
    `target` is `target_signature` of the model it belongs to; `meta` records how it was made.
    """

    config: EagleConfig
    params: EagleParams
    vocab: np.ndarray
    target: dict
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        vocab = check_draft_vocab("EAGLE", self.vocab, self.config.vocab_size, self.config.draft_vocab_size)
        object.__setattr__(self, "vocab", vocab)

    @classmethod
    def init(cls, target: Model, key: jax.Array, vocab=None, scale: float = 1.0, **meta: Any) -> EagleHead:
        """A fresh head for `target`, drafting from `vocab` (token ids; default: all)."""
        V = target.config.vocab_size
        vocab = np.arange(V, dtype=np.int32) if vocab is None else check_draft_vocab("EAGLE", vocab, V)
        config = EagleConfig.for_target(target.config, len(vocab))
        return cls(config, init_eagle(config, key, scale), vocab, target_signature(target), dict(meta))

    def check_target(self, model: Model) -> None:
        """Refuse a model the head was not trained for, naming both. A published head (no target
        signature) brings its own layer; only the widths it shares with the target must agree."""
        c, t = self.config, model.config
        fits = c.matches(t) if self.target else (c.hidden_size, c.vocab_size) == (t.hidden_size, t.vocab_size)
        if not fits:
            raise ValueError(
                f"EAGLE head has hidden size {self.config.hidden_size}, vocab {self.config.vocab_size} "
                f"and a layer of {self.config.num_heads}/{self.config.num_kv_heads} heads; the target "
                f"{model.name!r} has {model.config.hidden_size}, {model.config.vocab_size} and "
                f"{model.config.num_heads}/{model.config.num_kv_heads}"
            )
        if self.target:  # a head trained here; a published one ({}) is checked by its shapes only
            check_signature("EAGLE", self.target, model, "specjax.train.train_eagle")
