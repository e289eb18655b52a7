"""An oracle tree proposer for tests: it knows each row's reference continuation and puts the
right token at a rank that changes irregularly with the position, filling the other ranks with
wrong tokens. Accepted paths then run through later siblings, whose keys and values the loop must
move into place."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.speculate.proposers import Capabilities, Proposal, Proposer, Stateless
from specjax.speculate.tree import TokenTree


@dataclasses.dataclass(frozen=True)
class OracleSpec(Stateless):
    tree: TokenTree
    vocab_size: int

    @property
    def k(self):
        return self.tree.depth

    @property
    def capabilities(self):
        return Capabilities(tree=self.tree, stateless=True)

    def propose(self, ctx, state):
        tree, reference, lengths = self.tree, ctx.params, ctx.lengths
        B, R = reference.shape
        depth, rank = jnp.asarray(tree.depths[1:]), jnp.asarray(tree.ranks[1:])
        position = lengths[:, None] + depth[None, :] - 1  # [B, N]: where the node's token goes
        right = reference[jnp.arange(B)[:, None], jnp.minimum(position, R - 1)]
        right_rank = (position * 5 // 3) % jnp.asarray(tree.widths)[depth - 1][None, :]  # irregular
        wrong = (right + 1 + rank[None, :]) % self.vocab_size
        draft = jnp.where(rank[None, :] == right_rank, right, wrong).astype(jnp.int32)
        return Proposal(draft_tokens=draft, valid=jnp.ones(draft.shape, bool)), state


@dataclasses.dataclass(frozen=True, eq=False)
class Oracle(Proposer):
    tree: TokenTree
    reference: np.ndarray  # [B, R] each row's prompt and reference continuation

    def spec(self, target, warp, mesh):
        return OracleSpec(self.tree, target.config.vocab_size)

    def params(self, target):
        return jnp.asarray(self.reference, jnp.int32)


def references(prompts, continuations, width=160):
    out = np.zeros((len(prompts), width), np.int32)
    for b, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        out[b, : len(p) + len(c)] = p + c
    return out
