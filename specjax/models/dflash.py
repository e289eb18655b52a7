"""DFlash heads (block drafting conditioned on the target's features) as pure functions.

A DFlash head drafts a whole block in one forward pass. Its decoder layers (Qwen3-style: q/k
norms) run over a block of `block_size` tokens, [the last committed token, then mask tokens],
at that token's position and the following ones, all seeing each other (no causal mask within
the block). What they attend to besides the block is the context: the target's features at every
earlier position, fused like EAGLE-3's (the streams entering `aux_layer_ids` side by side, `fc`,
then `hidden_norm`) and injected as each layer's keys and values (its k and v projections, k
norm and rotation at the context's positions). The head has no embedding of its own (the
target's rows are read) and, unless it drafts over a vocabulary of its own, no LM head either
(its final norm, then the target's head). Slot i > 0 of the block predicts the token at the
anchor's position + i: a block of B drafts B - 1 tokens.

The context's keys and values live in the head's KV cache, one per layer: each committed
position's fused feature is projected once, when it arrives (`dflash_context`); a draft pass
reads them and computes the block's own keys and values on the fly (`dflash_block`).

Einsum letters: B batch, T positions, D the head's width, A the fused features' width.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import check_int, is_int
from specjax.kernels import pack
from specjax.kernels.layouts import panel_layer
from specjax.models.cache import KVCache
from specjax.models.config import LlamaConfig, RopeScaling
from specjax.models.draft_vocab import check_draft_vocab, draft_logits
from specjax.models.llama import attention_keys_values, decoder_layers, lm_head
from specjax.models.model import Model
from specjax.models.norms import rms_norm
from specjax.models.params import LayerParams, LlamaParams, checkpoint_layer_shapes, layer_from_checkpoint
from specjax.models.products import project

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
)


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    num_layers: int
    aux_layer_ids: tuple[int, ...]  # as EAGLE-3's: id i is the stream entering target layer i
    block_size: int  # tokens per draft pass: the anchor and block_size - 1 drafts
    mask_token_id: int  # the token the block's drafted slots are fed as
    draft_vocab_size: int | None = None  # an LM head of its own over this many tokens; None: the target's
    target_hidden_size: int | None = None  # None: hidden_size
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False

    def __post_init__(self):
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "num_layers",
        ):
            check_int(f"DFlashConfig {name}", getattr(self, name), 1)
        check_int("DFlashConfig block_size", self.block_size, 2, 17)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DFlashConfig mask_token_id must be a token id in 0..{self.vocab_size - 1}, "
                f"got {self.mask_token_id}"
            )
        ids = tuple(int(i) for i in self.aux_layer_ids)
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(
                f"DFlashConfig aux_layer_ids must be distinct layer ids >= 0, got {self.aux_layer_ids!r}"
            )
        object.__setattr__(self, "aux_layer_ids", ids)
        W = self.draft_vocab_size
        if W is not None and (not is_int(W) or not 1 <= W <= self.vocab_size):
            raise ValueError(
                f"DFlashConfig draft_vocab_size must be None or an integer in 1..{self.vocab_size}, got {W!r}"
            )
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def feature_size(self) -> int:
        return len(self.aux_layer_ids) * self.target_hidden_size

    @property
    def own_head(self) -> bool:
        """Whether the head reads tokens with an LM head of its own (a draft vocabulary)."""
        return self.draft_vocab_size is not None

    @property
    def num_draft_tokens(self) -> int:
        """W: the tokens it can draft."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(qk_norm=True, **{name: getattr(self, name) for name in _LAYER_FIELDS})


@flax.struct.dataclass
class DFlashParams:
    fc: jax.Array  # [A, D]
    hidden_norm: jax.Array  # [D]
    layers: tuple[LayerParams, ...]
    norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, W], only with a draft vocabulary of its own


def param_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    D = config.hidden_size
    shapes = {"fc": (config.feature_size, D), "hidden_norm": (D,), "norm": (D,)}
    if config.own_head:
        shapes["lm_head"] = (D, config.draft_vocab_size)
    for i in range(config.num_layers):
        shapes |= {
            f"layers.{i}.{name}": s for name, s in checkpoint_layer_shapes(config.layer_config, i).items()
        }
    return shapes


def params_from_flat(config: DFlashConfig, flat: dict) -> DFlashParams:
    names = checkpoint_layer_shapes(config.layer_config)
    layers = tuple(
        layer_from_checkpoint({name: flat[f"layers.{i}.{name}"] for name in names}, config.layer_config)
        for i in range(config.num_layers)
    )
    return DFlashParams(flat["fc"], flat["hidden_norm"], layers, flat["norm"], flat.get("lm_head"))


def init_dflash(config: DFlashConfig, key: jax.Array, scale: float = 1.0, dtype=jnp.float32) -> DFlashParams:
    """A random head (norms near 1, projections at unit-variance scale times `scale`)."""
    shapes = param_shapes(config)
    flat = {}
    for leaf_key, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items(), strict=True):
        noise = jax.random.normal(leaf_key, shape, jnp.float32)
        if "norm" in name:
            flat[name] = 1.0 + 0.1 * noise
        elif "bias" in name:
            flat[name] = jnp.zeros(shape)
        else:
            flat[name] = scale * noise / math.sqrt(shape[-2])
    return params_from_flat(config, {name: value.astype(dtype) for name, value in flat.items()})


def fused_context(params: DFlashParams, config: DFlashConfig, aux: jax.Array) -> jax.Array:
    """The target's features aux [..., A] as the head's context [..., D]: hidden_norm(fc(aux))."""
    return rms_norm(project(aux, params.fc), params.hidden_norm, config.rms_norm_eps)


def dflash_context(
    params: DFlashParams, config: DFlashConfig, aux: jax.Array, positions, cache: KVCache
) -> KVCache:
    """Write the context's keys and values for the target's features aux [B, T, A] at positions
    [B, T] into every layer's cache at slots `cache.lengths + t` (advancing is the caller's)."""
    c = config.layer_config
    context = fused_context(params, config, aux)
    keys, values = [], []
    for i, layer in enumerate(params.layers):  # every layer reads the same context
        k, v = attention_keys_values(c, layer, context, positions, i, attention_input=_as_is)
        keys.append(cache.write_keys(cache.k[i], k))
        values.append(cache.write_values(cache.v[i], v))
    return cache.replace(k=tuple(keys), v=tuple(values))


def _as_is(x, lp):  # the context enters each layer's key and value projections unnormed
    return x, x


def dflash_block(
    params: DFlashParams, config: DFlashConfig, embed: jax.Array, tokens: jax.Array, positions, cache: KVCache
) -> jax.Array:
    """The head's final-normed outputs [B, N, D] for a block of tokens [B, N] at positions [B, N]:
    the block's slots see each other and the context in the cache's committed slots; the cache
    is only read."""
    x = embed[tokens]
    block_mask = np.ones((tokens.shape[1],) * 2, bool)  # no causal order within the block
    out, _ = decoder_layers(params.layers, config.layer_config, x, positions, cache, block_mask, write=False)
    return rms_norm(out, params.norm, config.rms_norm_eps)


def dflash_logits(
    params: DFlashParams, config: DFlashConfig, target_params: LlamaParams, outputs, target_config=None
):
    """Logits [..., W] float32 over the head's draft vocabulary (its own head), or over the
    target's vocabulary through the target's head."""
    if params.lm_head is None:
        return lm_head(target_params, outputs, target_config)
    return draft_logits(params.lm_head, outputs)


def dflash_panel_weights(params: DFlashParams) -> DFlashParams:
    """The head with fc, its layers' projections and its own LM head (if any) as panels, for
    drafting on the CPU (as `layouts.with_panel_weights` for a target: no gradient, float32)."""
    lm = None if params.lm_head is None else pack(params.lm_head)
    layers = tuple(panel_layer(layer) for layer in params.layers)
    return params.replace(fc=pack(params.fc), layers=layers, lm_head=lm)


@dataclasses.dataclass(frozen=True, eq=False)
class DFlashHead:
    """A DFlash head and what it belongs to. `vocab [W]`: the target id of each draft index (all
    ids in order when it drafts over the target's vocabulary)."""

    config: DFlashConfig
    params: DFlashParams
    vocab: np.ndarray
    target: dict = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        vocab = check_draft_vocab("DFlash", self.vocab, self.config.vocab_size, self.config.num_draft_tokens)
        object.__setattr__(self, "vocab", vocab)

    @classmethod
    def init(
        cls,
        target: Model,
        key: jax.Array,
        block_size: int = 8,
        num_layers: int = 2,
        mask_token_id: int | None = None,
        aux_layer_ids=None,
        scale: float = 1.0,
    ) -> DFlashHead:
        """A random head for `target`: layers shaped like the target's, fusing the published
        default layers; the mask token defaults to the last id of the vocabulary."""
        from specjax.models.eagle3 import default_aux_layer_ids
        from specjax.models.signature import target_signature

        t = target.config
        config = DFlashConfig(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.head_dim,
            vocab_size=t.vocab_size,
            num_layers=num_layers,
            aux_layer_ids=default_aux_layer_ids(t.num_layers) if aux_layer_ids is None else aux_layer_ids,
            block_size=block_size,
            mask_token_id=t.vocab_size - 1 if mask_token_id is None else mask_token_id,
            rope_theta=t.rope_theta,
            rope_scaling=t.rope_scaling,
            rms_norm_eps=t.rms_norm_eps,
        )
        params = init_dflash(config, key, scale, dtype=target.params.dtype)
        return cls(config, params, np.arange(t.vocab_size, dtype=np.int32), target_signature(target))

    def check_target(self, model: Model) -> None:
        c, t = self.config, model.config
        problems = []
        if c.target_hidden_size != t.hidden_size:
            problems.append(
                f"the head fuses features of width {c.target_hidden_size}, the target's are {t.hidden_size}"
            )
        if c.hidden_size != t.hidden_size:
            problems.append(
                f"the head reads embeddings of width {c.hidden_size}, the target's are {t.hidden_size}"
            )
        if c.vocab_size != t.vocab_size:
            problems.append(f"the head maps to a vocabulary of {c.vocab_size}, the target has {t.vocab_size}")
        if max(c.aux_layer_ids) > t.num_layers:
            problems.append(
                f"the head fuses target layers {list(c.aux_layer_ids)}, the target's ids go 0..{t.num_layers}"
            )
        if problems:
            raise ValueError(f"DFlash head does not fit the target {model.name!r}: " + "; ".join(problems))
        if self.target:
            from specjax.models.signature import check_signature

            check_signature("DFlash", self.target, model, "specjax.train.train_dflash")
