"""MTP: draft with the target's own multi-token-prediction layer (models/mtp.py).

An MTP layer is an EAGLE head that shipped with the target: its input at position t is a hidden
state fused with the embedding of the token that followed, its output (post-norm) is read by the
target's LM head and fed back as the next step's hidden state. So it drafts with EAGLE's
machinery (proposers/eagle.py): its own one-layer KV cache, caught up inside the loop on the
target's final-normed hidden states at the accepted positions, chains and token trees from the
top candidates, deterministic drafts (q one-hot: lossless at any temperature). Only the layer
and the logits differ (`MTPSpec`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp

from specjax.models.llama import LlamaParams, lm_head
from specjax.models.model import Model
from specjax.models.mtp import MTPConfig, MTPLayerParams, missing_mtp_error, mtp_features, mtp_layer_config
from specjax.speculate.proposers.base import HeadInputs, kept_inputs
from specjax.speculate.proposers.eagle import EagleSpec, settle_drafting
from specjax.speculate.tree import TokenTree


@flax.struct.dataclass
class MTPHead:
    layer: MTPLayerParams
    target: (
        LlamaParams  # the target's embedding, final norm and LM head (no layers): its head reads the drafts
    )


@dataclasses.dataclass(frozen=True)
class MTPSpec(EagleSpec):
    config: MTPConfig

    def with_panel_weights(self, params: HeadInputs) -> HeadInputs:
        return params  # XLA's products (the target's head reads the drafts as it is)

    def _feed_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache, **options):
        return mtp_features(
            params.head.layer,
            self.config.layer_config,
            embed,
            target_features,
            tokens,
            positions,
            cache,
            **options,
        )

    def _write_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache):
        return self._feed_target(params, embed, target_features, tokens, positions, cache)[1]

    _feed_own = _feed_target  # fed its own post-norm outputs, as transformers' MtpModel chains them

    def _logits(self, params: HeadInputs, outputs):
        return lm_head(params.head.target, outputs, self.config.layer_config)


@dataclasses.dataclass(frozen=True, eq=False)
class MTP:
    """Draft with the target's own MTP layer (DeepSeek-V3, GLM-4.5: `model.mtp`, read at load): a
    chain of k tokens (default 3), or a token tree (`tree`, whose depth is then k) from the top
    candidates. `layers` picks the checkpoint's MTP layer that drafts (default: its only one).
    `confidence_threshold` as for Eagle (chains only)."""

    k: int | None = None
    layers: tuple[int, ...] | None = None
    tree: TokenTree | None = None
    confidence_threshold: float = 0.0

    def __post_init__(self):
        if self.k is None and self.tree is None:
            object.__setattr__(self, "k", 3)
        settle_drafting(self, "MTP")
        layers = self.layers
        if layers is not None:
            if isinstance(layers, int) and not isinstance(layers, bool):
                layers = (layers,)
            if not isinstance(layers, tuple | list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
            ):
                raise ValueError(
                    f"MTP layers must be None or a tuple of MTP layer indices >= 0, got {self.layers!r}"
                )
            object.__setattr__(self, "layers", tuple(layers))

    def _layer(self, target: Model) -> int:
        """The MTP layer that drafts for `target`, checked against what it has."""
        if target.mtp is None:
            raise missing_mtp_error(target)
        n = len(target.mtp)
        layers = tuple(range(n)) if self.layers is None else self.layers
        if any(i >= n for i in layers):
            raise ValueError(f"MTP layers={layers!r}: model {target.name!r} has {n} MTP layer(s), 0..{n - 1}")
        if len(layers) != 1:
            raise ValueError(
                f"MTP layers={layers!r}: drafting with several MTP layers (step i with layer i mod n) is not "
                "supported yet; choose one, e.g. layers=(0,)"
            )
        return layers[0]

    def spec(self, target: Model, warp=None, mesh=None) -> MTPSpec:
        layer = self._layer(target)
        return MTPSpec(
            config=MTPConfig(mtp_layer_config(target.config), layer),
            k=self.k,
            tree=self.tree,
            dtype=target.mtp[layer].eh_proj.dtype.name,
            confidence_threshold=self.confidence_threshold,
        )

    def params(self, target: Model) -> HeadInputs:
        def build(target):
            head = MTPHead(layer=target.mtp[self._layer(target)], target=target.params.replace(layers=()))
            vocab = jnp.arange(target.config.vocab_size, dtype=jnp.int32)
            return HeadInputs(head=head, head_matrix=None, vocab=vocab)

        return kept_inputs(self, target, build)


__all__ = ["MTP", "MTPSpec", "MTPHead"]
