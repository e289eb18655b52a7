"""EAGLE-3: drafting with a head that fuses the target's features at several depths
(models/eagle3.py). The drafting is EAGLE's (proposers/eagle.py: the head's own KV cache, pending
target features, chains and token trees drafted level by level); what differs is what the head
is fed and how it reads tokens:

- the target's features are the residual streams entering the head's `aux_layer_ids` layers,
  side by side ([B, T, n * D]): the loop asks the target's score pass for exactly those
  (`feature_layers`), inside the one compiled program, and the head fuses them with `fc`;
- later draft steps feed the head's own output back;
- the head reads tokens with its own norm and LM head over its draft vocabulary, mapped to
  target ids by its `d2t` table (HeadInputs.vocab).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax.models.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    eagle3_entries,
    eagle3_features,
    eagle3_logits,
    eagle3_panel_weights,
    fuse_features,
)
from specjax.models.model import Model
from specjax.speculate.proposers.base import HeadInputs, kept_inputs
from specjax.speculate.proposers.eagle import EagleSpec, HeadProposer, head_spec, settle_drafting
from specjax.speculate.tree import TokenTree


@dataclasses.dataclass(frozen=True)
class Eagle3Spec(EagleSpec):
    config: Eagle3Config

    @property
    def _target_features(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    @property
    def _pending_width(self) -> int:
        return self.config.feature_size

    def _feed_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache, **options):
        features = fuse_features(params.head, self.config, target_features)
        return eagle3_features(params.head, self.config, embed, features, tokens, positions, cache, **options)

    def with_panel_weights(self, params: HeadInputs) -> HeadInputs:
        if self.dtype != "float32":
            return params
        return params.replace(head=eagle3_panel_weights(params.head))  # it reads its own LM head

    def _write_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache):
        features = fuse_features(params.head, self.config, target_features)
        return eagle3_entries(params.head, self.config, embed, features, tokens, positions, cache)

    def _feed_own(self, params: HeadInputs, embed, own_features, tokens, positions, cache, **options):
        return eagle3_features(
            params.head, self.config, embed, own_features, tokens, positions, cache, **options
        )

    def _logits(self, params: HeadInputs, outputs):
        return eagle3_logits(params.head, self.config, outputs)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3(HeadProposer):
    """An EAGLE-3 head (specjax.models.Eagle3Head: trained here, or read from a published
    checkpoint by specjax.load_head) drafting a chain of k tokens, or a token tree (`tree`: a
    TokenTree or a list of paths; k is then its depth). Lossless at any temperature: its drafts
    are deterministic (each node its parent's rank-r candidate) and verified as every
    proposer's are. `confidence_threshold` as for Eagle: a chain's drafts are verified only while
    the product of their probabilities under the head is at least this (default 0: all k)."""

    head: Eagle3Head
    k: int | None = None
    tree: TokenTree | None = None
    confidence_threshold: float = 0.0

    def __post_init__(self):
        if not isinstance(self.head, Eagle3Head):
            raise ValueError(
                f"Eagle3 head must be a specjax.models.Eagle3Head (see specjax.load_head), got "
                f"{type(self.head).__name__}"
            )
        settle_drafting(self, "Eagle3")

    def spec(self, target: Model, warp=None, mesh=None) -> Eagle3Spec:
        return head_spec(Eagle3Spec, self, target)

    def params(self, target: Model) -> HeadInputs:
        def build(target):
            return HeadInputs(head=self.head.params, head_matrix=None, vocab=jnp.asarray(self.head.vocab))

        return kept_inputs(self, target, build)
