"""Prompt lookup (n-gram) drafting, on device, over the prompt and the tokens generated so far.

The rule: find the longest n-gram, n from n_max down to n_min, that ends at the last token and
also occurs earlier in the sequence; propose the (up to k) tokens that followed that earlier
occurrence. When the n-gram occurs several times, the most recent occurrence wins: recent
context predicts the continuation best, and that is what vLLM and llama.cpp's lookup decoding
favour too. A row with no match drafts nothing this step (all of its valid mask is False).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.checks import check_int
from specjax.speculate.proposers.base import Proposal, Stateless, check_k
from specjax.speculate.proposers.protocol import Capabilities, ProposeContext, Proposer


@dataclasses.dataclass(frozen=True)
class NGram(Stateless, Proposer):
    """Prompt-lookup proposer: `k` draft tokens from the longest n_max..n_min-gram match. It is
    its own spec: it has no params and nothing that depends on the target."""

    k: int = 5
    n_max: int = 4
    n_min: int = 1

    def __post_init__(self):
        check_k("NGram", self.k)
        check_int("NGram n_min", self.n_min, 1)
        check_int("NGram n_max", self.n_max, 1)
        if self.n_min > self.n_max:
            raise ValueError(f"NGram n_min ({self.n_min}) must not exceed n_max ({self.n_max})")

    # The proposer protocol (protocol.py): no state, no params; a row with no match drafts nothing.
    capabilities = Capabilities(always_drafts=False, narrows=True, stateless=True)

    def spec(self, target=None, warp=None, mesh=None) -> NGram:
        return self

    def with_k(self, k: int) -> NGram:
        return dataclasses.replace(self, k=k)

    def narrowed(self, k: int) -> NGram:
        return dataclasses.replace(self, k=k)

    def propose(self, ctx: ProposeContext, state):
        return ngram_propose(ctx.tokens, ctx.lengths, self.k, self.n_max, self.n_min), state


def ngram_propose(tokens: jax.Array, lengths: jax.Array, k: int, n_max: int, n_min: int) -> Proposal:
    """tokens [B, S] (row b's sequence is tokens[b, :lengths[b]]), lengths [B] -> Proposal."""
    B, S = tokens.shape
    rows = jnp.arange(B)[:, None]
    ends = jnp.arange(S)[None, :]  # candidate end j of an earlier occurrence
    last = lengths[:, None] - 1
    # matches[i][b, j]: tokens[b, j - i] == tokens[b, last - i]; AND-ed over i < n it says that the
    # n-gram ending at j equals the one ending at the last token.
    match = (ends < last) & (ends >= 0)
    best_end = jnp.full((B,), -1, jnp.int32)
    for i in range(n_max):
        # tokens[b, j - i] at column j (-1 where j < i): a shift, not a gather
        shifted = jnp.pad(tokens[:, : max(S - i, 0)], ((0, 0), (min(i, S), 0)), constant_values=-1)
        suffix_token = tokens[rows, jnp.maximum(last - i, 0)]
        match = match & (shifted == suffix_token) & (last - i >= 0) & (ends - i >= 0)
        n = i + 1
        if n >= n_min:
            latest = jnp.max(jnp.where(match, ends, -1), axis=1).astype(jnp.int32)  # most recent
            best_end = jnp.where(latest >= 0, latest, best_end)  # a longer n overrides shorter ones
    start = best_end[:, None] + 1 + jnp.arange(k)[None, :]  # [B, K] positions of the continuation
    valid = (best_end[:, None] >= 0) & (start < lengths[:, None])
    draft = jnp.where(valid, tokens[rows, jnp.minimum(start, S - 1)], 0)
    return Proposal(draft_tokens=draft.astype(jnp.int32), valid=valid)
