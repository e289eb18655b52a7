"""Verifiers: what a verify pass decides, from the target's logits at the last token and the drafts.

The loop scores the last token and every draft in one target pass, hands the adjusted logits to
a verifier, and commits what it decided (loop.py). A verifier has one method per draft shape:

    chain(warp, logits [B, K+1, V], proposal, sampling, keys [B])
        -> candidates [B, K+1], num_accepted [B], expected [B, K]
    tree(warp, tree, logits [B, N+1, V], proposal, sampling, keys [B])
        -> candidates [B, D+1], num_accepted [B], path [B, D], expected [B, D], drafted_at [B, D]

candidates are the accepted drafts, then the target's own token (the correction or the bonus
token), then -1; path the accepted nodes of a tree (-1 past num_accepted); expected the analytic
acceptance per position (sum_v min(p, q), for the metrics); drafted_at, per depth of a tree,
whether a valid draft was tried there.

`LOSSLESS` is the algorithm (DESIGN.md section 5), row by row: greedy rows keep the drafts that
match the argmax (`greedy_verify`, `tree_greedy_verify`), sampled rows rejection-sample
(`rejection_sample`, `tree_rejection_sample`). The loop uses it for every proposer but one
measurement tool, ForcedAcceptance, whose verifier wraps this one (proposers/forced.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.speculate.sampling import greedy_argmax, is_greedy, warp_logits
from specjax.speculate.tree import (
    parents_by_depth,
    tree_expected_acceptance,
    tree_greedy_verify,
    tree_rejection_sample,
)
from specjax.speculate.verify import expected_acceptance, greedy_verify, rejection_sample


class Lossless:
    """Greedy rows by argmax matching, sampled rows by rejection sampling: the output follows the
    target's distribution whatever the drafts."""

    def chain(self, warp, logits, proposal, sampling, keys):
        draft, valid = proposal.draft_tokens, proposal.valid
        K = draft.shape[1]
        candidates, num_accepted = greedy_verify(logits, draft, valid)
        # The same argmax greedy_verify takes (XLA computes it once), sliced to the drafted positions.
        expected = (draft == greedy_argmax(logits)[:, :K]).astype(jnp.float32)
        if warp.greedy:
            return candidates, num_accepted, expected
        target_probs = jnp.exp(warp_logits(logits, sampling, warp))  # [B, K+1, V]
        draft_probs = proposal.draft_probs
        if draft_probs is None:  # a deterministic proposer: q is one-hot on the draft token
            draft_probs = jax.nn.one_hot(draft, logits.shape[-1], dtype=jnp.float32)
        sampled, sampled_accepted = rejection_sample(keys, target_probs, draft_probs, draft, valid)
        return _mixed_rows(
            sampling,
            (candidates, num_accepted, expected),
            (sampled, sampled_accepted, expected_acceptance(target_probs, draft_probs)),
            num_accepted,
        )

    def tree(self, warp, tree, logits, proposal, sampling, keys):
        nodes, valid = proposal.draft_tokens, proposal.valid  # [B, N]
        candidates, num_accepted, path = tree_greedy_verify(tree, logits, nodes, valid)
        argmax_probs = jax.nn.one_hot(greedy_argmax(logits), logits.shape[-1], dtype=jnp.float32)
        expected, drafted_at = tree_expected_acceptance(
            tree, argmax_probs, None, nodes, valid, parents_by_depth(tree, path, num_accepted)
        )
        if warp.greedy:
            return candidates, num_accepted, path, expected, drafted_at
        target_probs = jnp.exp(warp_logits(logits, sampling, warp))  # [B, N+1, V]
        draft_probs = proposal.draft_probs
        sampled, sampled_accepted, sampled_path = tree_rejection_sample(
            keys, tree, target_probs, draft_probs, nodes, valid
        )
        parents = parents_by_depth(tree, sampled_path, sampled_accepted)
        sampled_expected, sampled_drafted = tree_expected_acceptance(
            tree, target_probs, draft_probs, nodes, valid, parents
        )
        return _mixed_rows(
            sampling,
            (candidates, num_accepted, path, expected, drafted_at),
            (sampled, sampled_accepted, sampled_path, sampled_expected, sampled_drafted),
            num_accepted,
        )


LOSSLESS = Lossless()


def _mixed_rows(sampling, greedy_result, sampled_result, num_accepted_greedy):
    """Per row, the greedy verifier's result or the sampled one's (tuples of [B, ...] arrays)."""
    greedy = is_greedy(sampling, num_accepted_greedy)  # [B]
    return tuple(
        jnp.where(greedy.reshape((-1,) + (1,) * (g.ndim - 1)), g, r)
        for g, r in zip(greedy_result, sampled_result, strict=True)
    )
