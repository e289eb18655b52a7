"""Proposers: cheap guesses of the next k tokens.

The user-facing objects (NGram, DraftModel, SelfDraft, Medusa, MLPSpeculator, Eagle, or a
researcher's own object with `spec(target, warp, mesh)` and `params(target)` methods) resolve, per
call, to a frozen, hashable *proposer spec* that the compiled loop holds as a static value, plus a
params pytree (or None) passed as an argument. A spec provides:

    k: int                         number of speculative tokens
    always_drafts: bool            True when every row drafts k tokens every step
    state_bytes(batch_size, capacity) -> int   device memory of its state (checked up front)
    init(target_params, params, prompt_tokens, prompt_lengths, capacity, target_hidden) -> state
    propose(target_params, params, state, tokens, lengths, keys, sampling, history)
        -> (Proposal, state)
    update(state, path_hidden, num_accepted) -> state

and optionally `observe(target_params, params, state, tokens, lengths) -> state`: keep the state
current on a step it is not asked to draft (a gated Hybrid's fallback; without it, Hybrid drafts
and discards); and `reads_target_cache = True`, for which `init` also takes `target_cache=`, the
target's KVCache after the prompt (SelfDraft and DraftModel(prompt_from_target=True) start
their own from it).
`Stateless` supplies state_bytes, init, update and observe for a proposer without state; a token
tree proposer has `tree` (a TokenTree: the Proposal then holds one token per tree node).
`target_hidden [B, T, D]` is the target's final-normed hidden states over the prompt, and
`path_hidden [B, K+1, D]` the target's hidden states at the last token and the accepted drafts
of a step: trained heads (Medusa, EAGLE) draft from them.

`propose` sees the committed sequence (`tokens[b, :lengths[b]]`), one PRNG key per row, the
per-row sampling values and the penalty history (None when no row has a penalty), and returns a
Proposal (its draft_probs None for a deterministic proposer, whose q is one-hot); the loop
verifies it, commits what was accepted, and calls `propose` again. A drafting proposer adjusts
and warps its logits with the same functions as the target (speculate/sampling.py).
"""

from __future__ import annotations

import dataclasses

from specjax.models.model import Model
from specjax.speculate.proposers.base import MAX_SPECULATIVE_TOKENS, Proposal, Stateless
from specjax.speculate.proposers.dflash import DFlash, DFlashSpec
from specjax.speculate.proposers.draft import DraftModel, DraftSpec, SelfDraft
from specjax.speculate.proposers.dynamic import Dynamic, DynamicSpec, GoodputSchedule, HeuristicSchedule
from specjax.speculate.proposers.eagle import Eagle, EagleSpec
from specjax.speculate.proposers.eagle3 import Eagle3, Eagle3Spec
from specjax.speculate.proposers.forced import ForcedAcceptance, ForcedSpec
from specjax.speculate.proposers.hybrid import Hybrid, HybridSpec
from specjax.speculate.proposers.medusa import Medusa, MedusaSpec
from specjax.speculate.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorSpec
from specjax.speculate.proposers.mtp import MTP, MTPSpec
from specjax.speculate.proposers.ngram import NGram, ngram_propose
from specjax.speculate.proposers.with_ngram import WithNGram, WithNGramSpec
from specjax.speculate.sampling import WarpSpec

PROPOSER_TYPES = (
    NGram,
    DraftModel,
    SelfDraft,
    Medusa,
    MLPSpeculator,
    Eagle,
    Eagle3,
    DFlash,
    MTP,
    WithNGram,
    Hybrid,
    Dynamic,
    ForcedAcceptance,
)


def resolve(proposer, target: Model, warp: WarpSpec, mesh=None):
    """(spec, params) for a user-facing proposer; (None, None) for plain decoding. With a jax Mesh,
    a model-based proposer's spec runs its forward on it."""
    if proposer is None:
        return None, None
    if isinstance(proposer, NGram):
        return proposer, None
    if isinstance(
        proposer,
        DraftModel
        | SelfDraft
        | Medusa
        | MLPSpeculator
        | Eagle
        | Eagle3
        | DFlash
        | MTP
        | WithNGram
        | Hybrid
        | Dynamic
        | ForcedAcceptance,
    ):
        return proposer.spec(target, warp, mesh), proposer.params(target)
    if callable(getattr(proposer, "spec", None)) and callable(getattr(proposer, "params", None)):
        return proposer.spec(target, warp, mesh), proposer.params(target)  # a custom proposer
    names = ", ".join(t.__name__ for t in PROPOSER_TYPES)
    raise ValueError(
        f"proposer must be None, one of specjax.{{{names}}} or an object with spec() and params() "
        f"methods (see specjax/speculate/proposers), got {type(proposer).__name__}"
    )


def with_k(proposer, k: int):
    """The same proposer drafting k tokens (at most k for Dynamic); ValueError for one whose draft
    length is fixed by a token tree (Medusa, an Eagle tree). DFlash drafts k through a block of
    k + 1; Hybrid changes both parts."""
    if isinstance(proposer, NGram | SelfDraft | DraftModel | MLPSpeculator):  # (at most n_predict)
        return dataclasses.replace(proposer, k=k)
    if isinstance(proposer, Eagle | Eagle3 | MTP) and proposer.tree is None:
        return dataclasses.replace(proposer, k=k)  # keeps its confidence threshold
    if isinstance(proposer, DFlash):
        return DFlash(proposer.head, block=k + 1)
    if isinstance(proposer, WithNGram):  # the model part keeps its k, the lookup takes the rest
        model_k = getattr(proposer.proposer, "k", None)
        if not isinstance(model_k, int) or k <= model_k:
            raise ValueError(
                f"k={k}: WithNGram's proposer drafts k={model_k}; k must exceed it (the lookup's share)"
            )
        return WithNGram(proposer.proposer, dataclasses.replace(proposer.ngram, k=k - model_k))
    if isinstance(proposer, Hybrid):
        return Hybrid(with_k(proposer.first, k), with_k(proposer.then, k), proposer.gate)
    if isinstance(proposer, Dynamic):
        return Dynamic(with_k(proposer.proposer, k), proposer.schedule)
    if isinstance(proposer, ForcedAcceptance):
        return proposer.with_k(k)
    raise ValueError(
        f"k={k}: cannot change k of {type(proposer).__name__}: its draft length is fixed (a Medusa "
        "head's count or a token tree's depth)"
    )


__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "DraftModel",
    "DraftSpec",
    "Dynamic",
    "DynamicSpec",
    "ForcedAcceptance",
    "ForcedSpec",
    "GoodputSchedule",
    "HeuristicSchedule",
    "Eagle",
    "Eagle3",
    "Eagle3Spec",
    "DFlash",
    "DFlashSpec",
    "Hybrid",
    "HybridSpec",
    "EagleSpec",
    "Medusa",
    "MedusaSpec",
    "MLPSpeculator",
    "MLPSpeculatorSpec",
    "MTP",
    "MTPSpec",
    "NGram",
    "Proposal",
    "SelfDraft",
    "Stateless",
    "WithNGram",
    "WithNGramSpec",
    "ngram_propose",
    "resolve",
    "with_k",
]
