"""The compiled decoding loop, proposers, sampling, verification and metrics."""

from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.proposers import (
    MAX_SPECULATIVE_TOKENS,
    MTP,
    DFlash,
    DraftModel,
    Dynamic,
    Eagle,
    Eagle3,
    ForcedAcceptance,
    GoodputSchedule,
    GrammarDraft,
    HeuristicSchedule,
    Hybrid,
    Medusa,
    MLPSpeculator,
    NGram,
    SelfDraft,
    WithNGram,
)
from specjax.speculate.sampling import Sampling, warp_logits
from specjax.speculate.tree import TokenTree, tree_greedy_verify, tree_rejection_sample
from specjax.speculate.verify import expected_acceptance, greedy_verify, rejection_sample

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "DraftModel",
    "Dynamic",
    "ForcedAcceptance",
    "GoodputSchedule",
    "HeuristicSchedule",
    "Eagle",
    "Eagle3",
    "Hybrid",
    "DFlash",
    "MTP",
    "WithNGram",
    "Medusa",
    "MLPSpeculator",
    "GrammarDraft",
    "NGram",
    "Sampling",
    "SelfDraft",
    "SpecMetrics",
    "TokenTree",
    "expected_acceptance",
    "greedy_verify",
    "rejection_sample",
    "tree_greedy_verify",
    "tree_rejection_sample",
    "warp_logits",
]
