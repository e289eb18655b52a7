"""EAGLE-3 heads (Li et al. 2025) as pure functions over a params pytree.

An EAGLE-3 head drafts from a fusion of the target's features at several depths: the residual
streams entering a few of its layers (low, middle and high: `aux_layer_ids`, the convention of
vLLM and the speculators format, where id i is the stream entering layer i and id L the last
layer's output) are concatenated and projected by `fc` to the head's width D. Its first decoder
layer reads the token embedding and a feature side by side: attention's input is
[input_norm(embedding of x_{t+1}), hidden_norm(g_t)] (2D wide), the residual is g_t. The head's
own final norm and LM head read a token over its draft vocabulary (`vocab`: draft index ->
target token id, the format's `d2t` as absolute ids). Later draft steps feed the layer's own
output back as the feature (normed first with `norm_output`, EAGLE 3.1).

Pair t of the head is (g_t, x_{t+1}) at position t + 1 (speculators' training convention; rotary
attention only sees differences of positions, so vLLM's t gives the same drafts).

Einsum letters: B batch, T positions, D the head's width, A the fused features' width (n * D_t).
"""

from __future__ import annotations

import dataclasses
import functools
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
from specjax.models.draft_vocab import check_draft_vocab, draft_logits
from specjax.models.llama import attention_keys_values, decoder_layers
from specjax.models.model import Model
from specjax.models.norms import rms_norm
from specjax.models.params import LayerParams, checkpoint_layer_shapes, layer_from_checkpoint
from specjax.models.products import project
from specjax.models.signature import check_signature

_SIZES = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
# Fields of the head's decoder layers, as a LlamaConfig names them.
_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "num_layers",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "qkv_bias",
    "qk_norm",
    "hidden_act",
)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Static shape of an EAGLE-3 head."""

    hidden_size: int  # D: the head's width
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # tokens the head drafts over (its LM head's width)
    aux_layer_ids: tuple[int, ...]  # target layers whose input streams are fused (see above)
    target_hidden_size: int | None = None  # the target's hidden size; None: hidden_size
    num_layers: int = 1
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False  # a Qwen3 decoder layer
    hidden_act: str = "silu"
    norm_before_residual: bool = False  # the residual is hidden_norm(g_t), not g_t
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    fc_norm: bool = False  # one RMSNorm per target layer's feature before fc
    norm_output: bool = False  # feed back the normed output (EAGLE 3.1)

    def __post_init__(self):
        for name in (*_SIZES, "num_layers"):
            check_int(f"Eagle3Config {name}", getattr(self, name), 1)
        W = self.draft_vocab_size
        check_int("Eagle3Config draft_vocab_size", W, 1, self.vocab_size)
        ids = tuple(int(i) for i in self.aux_layer_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                f"Eagle3Config aux_layer_ids must be distinct layer ids >= 0, got {self.aux_layer_ids!r}"
            )
        object.__setattr__(self, "aux_layer_ids", ids)
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("Eagle3Config: norm_before_fc and fc_norm exclude each other")

    @property
    def feature_size(self) -> int:
        """A: the width of the target features the head fuses."""
        return len(self.aux_layer_ids) * self.target_hidden_size

    @property
    def layer_config(self) -> LlamaConfig:
        """The head's decoder layers as a LlamaConfig (what the layer code runs on)."""
        return LlamaConfig(**{name: getattr(self, name) for name in _LAYER_FIELDS})

    @classmethod
    def for_target(cls, config: LlamaConfig, draft_vocab_size: int | None = None, **options) -> Eagle3Config:
        """A head shaped like `config`'s layers, fusing the published default layers (2, L/2, L-3)."""
        L = config.num_layers
        options.setdefault("aux_layer_ids", default_aux_layer_ids(L))
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            draft_vocab_size=config.vocab_size if draft_vocab_size is None else draft_vocab_size,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            rms_norm_eps=config.rms_norm_eps,
            **options,
        )


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The layers EAGLE-3's authors, vLLM and speculators fuse when a head names none: the
    streams entering layers 2, L // 2 and L - 3 (distinct ones, for a shallow target)."""
    ids = [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]
    return tuple(sorted(dict.fromkeys(ids)))


@flax.struct.dataclass
class Eagle3Params:
    fc: jax.Array  # [A, D]
    layers: tuple[LayerParams, ...]  # the first one's q, k, v read 2D
    hidden_norm: jax.Array  # [D]: the first layer's norm of the feature
    norm: jax.Array  # [D]: before the LM head
    lm_head: jax.Array  # [D, W]
    input_norm: jax.Array | None = None  # [A] with norm_before_fc
    fc_norms: jax.Array | None = None  # [n, D_t] with fc_norm


def layer_shapes(config: Eagle3Config, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s weights by checkpoint name: the first layer's q, k and v take 2D inputs."""
    shapes = checkpoint_layer_shapes(config.layer_config, layer)
    if layer == 0:
        for name in ("q", "k", "v"):
            shapes[name] = (2 * config.hidden_size, shapes[name][1])
    return shapes


def param_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every weight by flat name -> shape (the layers' in the checkpoint layout, q, k, v apart)."""
    D = config.hidden_size
    shapes = {"fc": (config.feature_size, D), "hidden_norm": (D,), "norm": (D,)}
    shapes["lm_head"] = (D, config.draft_vocab_size)
    if config.norm_before_fc:
        shapes["input_norm"] = (config.feature_size,)
    if config.fc_norm:
        shapes["fc_norms"] = (len(config.aux_layer_ids), config.target_hidden_size)
    for i in range(config.num_layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in layer_shapes(config, i).items()}
    return shapes


def params_from_flat(config: Eagle3Config, flat: dict[str, Any]) -> Eagle3Params:
    """Params from weights by flat name (`param_shapes`' names), q, k and v fused per layer."""
    layers = tuple(
        layer_from_checkpoint(
            {name: flat[f"layers.{i}.{name}"] for name in layer_shapes(config, i)}, config.layer_config
        )
        for i in range(config.num_layers)
    )
    return Eagle3Params(
        fc=flat["fc"],
        layers=layers,
        hidden_norm=flat["hidden_norm"],
        norm=flat["norm"],
        lm_head=flat["lm_head"],
        input_norm=flat.get("input_norm"),
        fc_norms=flat.get("fc_norms"),
    )


def init_eagle3(config: Eagle3Config, key: jax.Array, scale: float = 1.0, dtype=jnp.float32) -> Eagle3Params:
    """A random head: norms near 1, projections at unit-variance scale (times `scale`; the
    layers' output projections small, so that a fresh head's features stay near its input)."""
    shapes = param_shapes(config)
    flat = {}
    for leaf_key, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items(), strict=True):
        noise = jax.random.normal(leaf_key, shape, jnp.float32)
        if "norm" in name:
            flat[name] = 1.0 + 0.1 * noise
        elif "bias" in name:
            flat[name] = jnp.zeros(shape)
        else:
            small = 0.1 if name.endswith((".o", ".down")) else 1.0
            flat[name] = scale * small * noise / math.sqrt(shape[-2])
    return params_from_flat(config, {name: value.astype(dtype) for name, value in flat.items()})


def fuse_features(params: Eagle3Params, config: Eagle3Config, aux: jax.Array) -> jax.Array:
    """The target's features at several layers, aux [..., A] (their streams side by side, in
    `aux_layer_ids` order), fused into the head's input feature [..., D]."""
    eps = config.rms_norm_eps
    if config.norm_before_fc:
        aux = rms_norm(aux, params.input_norm, eps)
    if config.fc_norm:
        parts = jnp.split(aux, len(config.aux_layer_ids), axis=-1)
        aux = jnp.concatenate([rms_norm(p, w, eps) for p, w in zip(parts, params.fc_norms, strict=True)], -1)
    return project(aux, params.fc)


def eagle3_features(
    params: Eagle3Params,
    config: Eagle3Config,
    embed: jax.Array,
    features: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    fresh_mask=None,
    empty_cache: bool = False,
    visible=None,
) -> tuple[jax.Array, KVCache]:
    """The head's outputs [B, T, D] for inputs (features [B, T, D], the next tokens [B, T]) at
    positions [B, T]: what the next step feeds back as its feature (normed with norm_output).
    `embed` is the target's embedding table [V, D]; the head's cache gets the inputs' keys and
    values at slots `cache.lengths + t` (advancing is the caller's). `visible` [B, T, S] overrides
    which cache slots each input sees (training-time test, train/eagle3.py)."""
    out, cache = decoder_layers(
        params.layers,
        config.layer_config,
        _side_by_side(embed, features, tokens),
        positions,
        cache,
        fresh_mask,
        empty_cache,
        visible=visible,
        first_attention_input=functools.partial(_first_attention_input, params, config),
    )
    if config.norm_output:
        out = rms_norm(out, params.norm, config.rms_norm_eps)
    return out, cache


def eagle3_entries(
    params: Eagle3Params,
    config: Eagle3Config,
    embed: jax.Array,
    features: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
) -> KVCache:
    """The head's cache with the keys and values of inputs (features [B, T, D], the next tokens
    [B, T]) at positions [B, T] written at slots `cache.lengths + t`, as `eagle3_features` writes
    them. A one-layer head (the published form) computes its first layer's key and value
    projections only: a catch-up on a step whose drafts come from elsewhere costs little. Deeper
    heads run every layer (a later layer's keys come from the layer before)."""
    if len(params.layers) > 1:
        return eagle3_features(params, config, embed, features, tokens, positions, cache)[1]
    k, v = attention_keys_values(
        config.layer_config,
        params.layers[0],
        _side_by_side(embed, features, tokens),
        positions,
        attention_input=functools.partial(_first_attention_input, params, config),
    )
    return cache.replace(k=(cache.write_keys(cache.k[0], k),), v=(cache.write_values(cache.v[0], v),))


def _side_by_side(embed, features, tokens) -> jax.Array:
    """The tokens' embeddings and the features side by side: [B, T, 2D], the first layer's input."""
    return jnp.concatenate([embed[tokens].astype(features.dtype), features], axis=-1)


def _first_attention_input(params: Eagle3Params, config: Eagle3Config, x, lp):
    """The first layer's attention input (the token's and the feature's norms side by side) and
    its residual, from x [B, T, 2D] (`_side_by_side`)."""
    D, eps = config.hidden_size, config.rms_norm_eps
    token, feature = x[..., :D], x[..., D:]
    normed = rms_norm(feature, params.hidden_norm, eps)
    both = jnp.concatenate([rms_norm(token, lp.attn_norm, eps), normed], axis=-1)
    return both, normed if config.norm_before_residual else feature


def eagle3_logits(params: Eagle3Params, config: Eagle3Config, outputs: jax.Array) -> jax.Array:
    """Logits [..., W] over the draft vocabulary, float32, from the head's outputs [..., D]."""
    normed = outputs if config.norm_output else rms_norm(outputs, params.norm, config.rms_norm_eps)
    return draft_logits(params.lm_head, normed)


def eagle3_panel_weights(params: Eagle3Params) -> Eagle3Params:
    """The head with fc, its layers' projections and its LM head as panels, for drafting on the
    CPU (as `layouts.with_panel_weights` for a target: no gradient, float32)."""
    layers = tuple(panel_layer(layer) for layer in params.layers)
    return params.replace(fc=pack(params.fc), layers=layers, lm_head=pack(params.lm_head))


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Head:
    """An EAGLE-3 head, its draft vocabulary and what it belongs to.

    `vocab [W]`: the target token id of each draft index (the format's d2t, as absolute ids).
    `target`: `target_signature` of the model a head trained here belongs to, or {} for a head
    read from a published checkpoint (then only its shapes can be checked); `meta` records how it
    was made or where it came from.
    """

    config: Eagle3Config
    params: Eagle3Params
    vocab: np.ndarray
    target: dict = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        vocab = check_draft_vocab("EAGLE-3", self.vocab, self.config.vocab_size, self.config.draft_vocab_size)
        object.__setattr__(self, "vocab", vocab)

    @classmethod
    def init(
        cls, target: Model, key: jax.Array, vocab=None, scale: float = 1.0, aux_layer_ids=None, **options
    ) -> Eagle3Head:
        """A random head for `target`, drafting over `vocab` (token ids; default: all)."""
        from specjax.models.signature import target_signature

        V = target.config.vocab_size
        vocab = np.arange(V, dtype=np.int32) if vocab is None else check_draft_vocab("EAGLE-3", vocab, V)
        if aux_layer_ids is not None:
            options["aux_layer_ids"] = aux_layer_ids
        config = Eagle3Config.for_target(target.config, len(vocab), **options)
        params = init_eagle3(config, key, scale, dtype=target.params.dtype)
        return cls(config, params, vocab, target_signature(target))

    def check_target(self, model: Model) -> None:
        """Refuse a target whose shapes the head does not fit (and, for a head trained here, any
        model but the one it was trained on), naming what differs."""
        c, t = self.config, model.config
        problems = []
        if c.target_hidden_size != t.hidden_size:
            problems.append(
                f"the head fuses features of width {c.target_hidden_size}, the target's are {t.hidden_size}"
            )
        if c.vocab_size != t.vocab_size:
            problems.append(f"the head maps to a vocabulary of {c.vocab_size}, the target has {t.vocab_size}")
        if c.hidden_size != t.hidden_size:
            problems.append(
                f"the head reads token embeddings of width {c.hidden_size}, the target's are {t.hidden_size}"
            )
        if max(c.aux_layer_ids) > t.num_layers:
            problems.append(
                f"the head fuses target layers {list(c.aux_layer_ids)}, the target's ids go 0..{t.num_layers}"
            )
        if problems:
            raise ValueError(f"EAGLE-3 head does not fit the target {model.name!r}: " + "; ".join(problems))
        if self.target:
            check_signature("EAGLE-3", self.target, model, "specjax.train.train_eagle3")
