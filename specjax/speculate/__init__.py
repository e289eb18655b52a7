"""The compiled decoding loop, proposers, sampling, verification and metrics."""

from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.proposers import MAX_SPECULATIVE_TOKENS, DraftModel, NGram, SelfDraft
from specjax.speculate.sampling import Sampling, warp_logits
from specjax.speculate.verify import expected_acceptance, greedy_verify, rejection_sample

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "DraftModel",
    "NGram",
    "Sampling",
    "SelfDraft",
    "SpecMetrics",
    "expected_acceptance",
    "greedy_verify",
    "rejection_sample",
    "warp_logits",
]
