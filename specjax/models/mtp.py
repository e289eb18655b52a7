"""A checkpoint's own multi-token-prediction (MTP) layers (DeepSeek-V3, GLM-4.5), as pure functions.

DeepSeek-V3 and GLM-4.5 ship `num_nextn_predict_layers` MTP layers after the decoder's L layers,
as `model.layers.{L + i}.{enorm, hnorm, eh_proj, <decoder block>, shared_head.norm}`. Layer i's
input at position t is a hidden state h_t fused with the embedding of the token x_{t+1} that
followed:

    x = eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])     # [2D] -> [D], embedding first
    g_t = shared_head.norm(block(x))                      # a decoder block like the target's (MLA, MoE)

and the target's LM head reads x_{t+2} from g_t. This is transformers' `MtpLayer` (with its
`post_norm`, the checkpoint's `shared_head.norm`); h_t is the target's final-normed hidden state
for the first step (transformers' MTPCandidateGenerator feeds `hidden_states[-1]`; vLLM the
target model's normed output), and the previous step's post-norm g_t for the next. The
checkpoint's per-layer copies of the embedding and the head (`embed_tokens`,
`shared_head.head`) are the target's and are ignored, as transformers' MtpModel does.

A target without MTP layers of its own drafts with layers trained here (`specjax.train.train_mtp`,
an `MTPLayers`): `target.with_mtp(layers)` is the target with them attached, for `specjax.MTP`.

Einsum letters: B batch, T positions, D hidden.
"""

from __future__ import annotations

import dataclasses
import re

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.cache import KVCache
from specjax.models.checkpoint import HostWeights
from specjax.models.config import LlamaConfig
from specjax.models.llama import decoder_layers
from specjax.models.norms import rms_norm
from specjax.models.params import LayerParams, init_params
from specjax.models.products import project
from specjax.models.signature import Target, check_signature
from specjax.models.tensors import LazyTensor

# Our name -> the name under model.layers.{L + i}. (besides the decoder block's own)
MTP_TENSORS = {
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "eh_proj": "eh_proj.weight",
    "head_norm": "shared_head.norm.weight",
}
# Released beside them, the target's own weights again: not read (see the module docstring).
MTP_IGNORED = ("embed_tokens.weight", "shared_head.head.weight")
# Families whose MTP layers are stored under other names, which specjax does not read yet.
OTHER_MTP_LAYOUTS = {"qwen3_next": "mtp.*", "qwen3_5": "mtp.*", "mimo": "model.mtp_layers.*"}
_MTP_NAME = re.compile(r"mtp\.(\d+)\.(.+)")


@flax.struct.dataclass
class MTPLayerParams:
    enorm: jax.Array  # [D]: on the next token's embedding
    hnorm: jax.Array  # [D]: on the hidden state
    eh_proj: jax.Array  # [2D, D]: (embedding, hidden state) -> the block's input
    block: LayerParams  # one decoder layer shaped like the target's MTP block (MoE where it has experts)
    head_norm: jax.Array  # [D]: shared_head.norm, before the target's LM head


def mtp_layer_config(config: LlamaConfig) -> LlamaConfig:
    """A one-layer config for an MTP block of a target of `config`: an MoE target's MTP blocks
    are MoE (transformers sets first_k_dense_replace to 0 for them)."""
    types = None if config.layer_types is None else config.layer_types[-1:]
    return dataclasses.replace(config, num_layers=1, dense_layers=(), num_mtp_layers=0, layer_types=types)


def mtp_features(
    params: MTPLayerParams,
    config: LlamaConfig,
    embed: jax.Array,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    **options,
) -> tuple[jax.Array, KVCache]:
    """The layer's post-norm outputs g [B, T, D] for inputs (hidden [B, T, D], next_tokens [B, T])
    at positions [B, T] (the next tokens'), and its one-layer cache with their keys and values at
    slots `cache.lengths + t`. `config` is `mtp_layer_config(target)`; `embed` the target's
    embedding [V, D]; `options` as `decoder_layers` takes them."""
    eps, form = config.rms_norm_eps, config.norm
    fused = jnp.concatenate(
        [rms_norm(embed[next_tokens], params.enorm, eps, form), rms_norm(hidden, params.hnorm, eps, form)],
        axis=-1,
    )
    x, cache = decoder_layers(
        (params.block,), config, project(fused, params.eh_proj), positions, cache, **options
    )
    return rms_norm(x, params.head_norm, eps, form), cache


def mtp_tensor_names(config: LlamaConfig, j: int) -> dict[str, str]:
    """MTP layer j's own tensors (not its block's): our flat name -> its HF name."""
    prefix = f"model.layers.{config.num_layers + j}."
    return {f"mtp.{j}.{ours}": prefix + theirs for ours, theirs in MTP_TENSORS.items()}


def mtp_layers_from_tensors(
    config: LlamaConfig, tensors: dict[str, LazyTensor], source: str, dtype: np.dtype
) -> tuple[MTPLayerParams, ...] | None:
    """The MTP layers from their flat tensors (`mtp.{j}.{name}`, as hf_loader maps them), in
    `dtype`; None where the checkpoint has none (transformers' save_pretrained drops them).
    A checkpoint with only some of them is a ValueError naming what is missing."""
    if not tensors:
        return None
    block_config = mtp_layer_config(config)
    layers = []
    for j in range(config.num_mtp_layers):
        ours = {m[2]: t for name, t in tensors.items() if (m := _MTP_NAME.fullmatch(name)) and int(m[1]) == j}
        renamed = {(name if name in MTP_TENSORS else f"layers.0.{name}"): t for name, t in ours.items()}
        weights = HostWeights(block_config, renamed, dtype, None, None)
        try:
            block = {name: jax.device_put(x) for name, x in weights.layer(0).items()}
            own = {name: jax.device_put(weights.read(name)) for name in MTP_TENSORS}
        except KeyError as error:
            raise ValueError(
                f"checkpoint {source}: MTP layer {j} (model.layers.{config.num_layers + j}) lacks "
                f"{error.args[0]!r}; its config has num_nextn_predict_layers={config.num_mtp_layers}"
            ) from None
        layers.append(MTPLayerParams(block=LayerParams(**({"qkv": None} | block)), **own))
    return tuple(layers)


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Static shape of MTP layers drafting for a target: their blocks' one-layer config
    (`mtp_layer_config`) and which of the checkpoint's MTP layers draft, in drafting order (step i
    with `layers[i % len(layers)]`)."""

    layer_config: LlamaConfig
    layers: tuple[int, ...] = (0,)

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size


def missing_mtp_error(model) -> ValueError:
    """The error for drafting with MTP layers a model does not have, naming why."""
    c = model.config
    if c.model_type in OTHER_MTP_LAYOUTS:
        why = (
            f"its family {c.model_type!r} stores them as {OTHER_MTP_LAYOUTS[c.model_type]}, which specjax "
            "does not read yet"
        )
    elif c.num_mtp_layers:
        why = (
            f"its config has num_nextn_predict_layers={c.num_mtp_layers} but its checkpoint holds no "
            f"model.layers.{c.num_layers}.* weights (transformers' save_pretrained drops them)"
        )
    else:
        why = (
            f"its {c.model_type!r} config has no num_nextn_predict_layers (DeepSeek-V3 and GLM-4.5 have them)"
        )
    return ValueError(f"MTP: model {model.name!r} has no MTP layers: {why}")


def init_mtp_layer(config: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> MTPLayerParams:
    """A random MTP layer for a target of `config` (unit norms, eh_proj drawn at 1/sqrt(2D)): for
    tests and programs that need the shapes, and as training's starting point."""
    D = config.hidden_size
    block_key, proj_key = jax.random.split(key)
    block = init_params(mtp_layer_config(config), block_key, dtype).layers[0]
    eh_proj = (jax.random.normal(proj_key, (2 * D, D), jnp.float32) / np.sqrt(2 * D)).astype(dtype)
    ones = jnp.ones((D,), dtype)
    return MTPLayerParams(enorm=ones, hnorm=ones, eh_proj=eh_proj, block=block, head_norm=ones)


TRAINER = "specjax.train.train_mtp"


@dataclasses.dataclass(frozen=True, eq=False)
class MTPLayers:
    """MTP layers trained for a target that has none of its own (`specjax.train.train_mtp`), in
    drafting order: `target.with_mtp(layers)` drafts with them through `specjax.MTP`. `target` is
    `target_signature` of that model; `meta` records how they were made. Saved and read like the
    other heads (`save_head`, `load_head(path, target)`: their shapes are the target's)."""

    config: LlamaConfig  # the blocks' one-layer config, `mtp_layer_config(target)`
    layers: tuple[MTPLayerParams, ...]
    target: dict = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        ok = isinstance(self.layers, tuple) and self.layers
        if not ok or not all(isinstance(layer, MTPLayerParams) for layer in self.layers):
            raise ValueError(
                f"MTPLayers layers must be a non-empty tuple of MTPLayerParams, got {self.layers!r}"
            )

    def check_target(self, model: Target) -> None:
        """Refuse a model the layers were not trained for, naming both."""
        check_signature("MTP", self.target, model, TRAINER)
