"""Proposers: cheap guesses of the next k tokens.

What a proposer is, and what the loop may ask of one, is declared in one place: protocol.py
(`Proposer`, the user-facing config; `ProposerSpec`, what it resolves to for one call, with its
functions over context objects and its `Capabilities` record). Each proposer is one file here,
and one entry in registry.py, which the proposers' names (specjax/named.py), the server's
`--speculative-config` methods and the docs read.

Wrappers compose other proposers: `Dynamic` (a per-row k chosen by a schedule), `Hybrid` (per row,
one of two proposers' drafts), `ForcedAcceptance` (a measurement tool that forces acceptance) and
`WithNGram` (a model's drafts extended by prompt lookup).
"""

from __future__ import annotations

from specjax.speculate.proposers.base import (
    MAX_SPECULATIVE_TOKENS,
    FromLastHidden,
    HeadInputs,
    LastHiddenState,
    Proposal,
    Stateless,
    check_k,
    choose_draft,
    draft_distribution,
    draft_keys,
)
from specjax.speculate.proposers.dflash import DFlash, DFlashSpec
from specjax.speculate.proposers.draft import DraftModel, DraftSpec, SelfDraft
from specjax.speculate.proposers.dynamic import Dynamic, DynamicSpec, GoodputSchedule, HeuristicSchedule
from specjax.speculate.proposers.eagle import Eagle, EagleSpec
from specjax.speculate.proposers.eagle3 import Eagle3, Eagle3Spec
from specjax.speculate.proposers.forced import ForcedAcceptance, ForcedSpec
from specjax.speculate.proposers.grammar_draft import GrammarDraft
from specjax.speculate.proposers.hybrid import Hybrid, HybridSpec
from specjax.speculate.proposers.medusa import Medusa, MedusaSpec
from specjax.speculate.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorSpec
from specjax.speculate.proposers.mtp import MTP, MTPSpec
from specjax.speculate.proposers.ngram import NGram, ngram_propose
from specjax.speculate.proposers.protocol import (
    FINAL_HIDDEN,
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
    Wrapper,
    resolve,
)
from specjax.speculate.proposers.with_ngram import WithNGram, WithNGramSpec


def with_k(proposer: Proposer, k: int) -> Proposer:
    """The same proposer drafting k tokens (at most k for Dynamic): `proposer.with_k(k)`; a
    ValueError for one whose draft length is fixed by a token tree (Medusa, an Eagle tree). DFlash
    drafts k through a block of k + 1; Hybrid changes both parts."""
    if not isinstance(proposer, Proposer):
        raise ValueError(f"with_k: proposer must be a specjax proposer, got {type(proposer).__name__}")
    return proposer.with_k(k)


__all__ = [
    "FINAL_HIDDEN",
    "MAX_SPECULATIVE_TOKENS",
    "Capabilities",
    "DFlash",
    "DFlashSpec",
    "DraftModel",
    "DraftSpec",
    "Dynamic",
    "DynamicSpec",
    "Eagle",
    "Eagle3",
    "Eagle3Spec",
    "EagleSpec",
    "ForcedAcceptance",
    "ForcedSpec",
    "FromLastHidden",
    "GoodputSchedule",
    "HeadInputs",
    "HeuristicSchedule",
    "Hybrid",
    "HybridSpec",
    "InitContext",
    "LastHiddenState",
    "MLPSpeculator",
    "MLPSpeculatorSpec",
    "MTP",
    "MTPSpec",
    "Medusa",
    "MedusaSpec",
    "GrammarDraft",
    "NGram",
    "Proposal",
    "ProposeContext",
    "Proposer",
    "ProposerSpec",
    "SelfDraft",
    "Stateless",
    "UpdateContext",
    "WithNGram",
    "WithNGramSpec",
    "Wrapper",
    "check_k",
    "choose_draft",
    "draft_distribution",
    "draft_keys",
    "ngram_propose",
    "resolve",
    "with_k",
]
