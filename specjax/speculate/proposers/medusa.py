"""Medusa: draft a token tree from the target's own last hidden state with trained heads.

The proposer's state is one hidden state per row: the target's, at the token before the last
committed one (the state the last token was predicted from). Head i reads it and ranks its
candidates for the token i + 1 places after the last committed one; a tree node at depth d with
rank r drafts head d - 1's r-th best token. The drafts are deterministic candidates (q one-hot),
so the tree's recursive rejection sampling keeps the output lossless at any temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.medusa import MedusaHead, medusa_hidden, medusa_logits
from specjax.models.model import Model
from specjax.speculate.grammar import mask_draft_logits
from specjax.speculate.proposers.base import (
    FromLastHidden,
    HeadInputs,
    LastHiddenState,
    Proposal,
    kept_inputs,
)
from specjax.speculate.proposers.protocol import Capabilities, ProposeContext, Proposer
from specjax.speculate.tree import TokenTree

MedusaState = LastHiddenState  # the name the tests and notebooks know


@dataclasses.dataclass(frozen=True)
class MedusaSpec(FromLastHidden):
    """The static part of a Medusa proposer: its tree."""

    tree: TokenTree
    hidden_size: int
    max_accepted: int | None = None  # (a tree proposer is never a part beside a longer drafter)

    @property
    def k(self) -> int:
        return self.tree.depth

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, tree=self.tree)

    def propose(self, ctx: ProposeContext, state: LastHiddenState):
        params, tree = ctx.params, self.tree
        features = medusa_hidden(params.head, state.hidden)[:, : tree.depth]  # [B, D, hidden]
        if params.head.lm_heads is None:  # the target's head, over the draft vocabulary
            logits = draft_logits(params.head_matrix, features)
        else:  # each head's own (a released Medusa head): its whole vocabulary
            logits = medusa_logits(params.head.replace(lm_heads=params.head.lm_heads[: tree.depth]), features)
        if ctx.grammar_states is not None:
            draft, valid = self._constrained_nodes(ctx, params.vocab, logits)
        else:
            _, candidates = jax.lax.top_k(logits, max(tree.widths))
            depth, rank = tree.depths[1:] - 1, tree.ranks[1:]  # per drafted node
            draft = params.vocab[candidates[:, depth, rank]]  # [B, N] token ids
            valid = jnp.ones(draft.shape, bool)
        return Proposal(draft_tokens=draft, valid=valid), state

    def _constrained_nodes(self, ctx: ProposeContext, vocab, logits):
        """([B, N] the nodes' tokens, [B, N] valid) where rows are constrained: node i is the rank-r
        candidate of its depth's head among the tokens the automaton allows at its parent (siblings
        ranked under their parent's state, each node's state following its own path); a node
        ranked past what its parent allows, or under such a node, drafts nothing."""
        tree, grammar = self.tree, ctx.sampling.grammar
        vocab_size = ctx.target_params.embed.shape[0]  # what the automaton's edge keys are built with
        B = logits.shape[0]
        states, valid = [ctx.grammar_states], [jnp.ones((B,), bool)]  # per node, the root's first
        ranked_under = {}  # parent node -> its children's candidates: (logits, token ids) [B, width]
        drafts = []
        for i in range(1, tree.num_nodes + 1):  # N small and static; parents come first
            parent, depth, rank = int(tree.parents[i]), int(tree.depths[i]) - 1, int(tree.ranks[i])
            if parent not in ranked_under:
                width = int(np.sum(tree.children[parent] >= 0))  # its children, ranks 0 .. width - 1
                masked = mask_draft_logits(grammar, logits[:, depth], states[parent], vocab)
                top, index = jax.lax.top_k(masked, width)
                ranked_under[parent] = top, vocab[index]
            top, tokens = ranked_under[parent]
            states.append(grammar.step(states[parent], tokens[:, rank], vocab_size))
            valid.append(valid[parent] & (top[:, rank] > -jnp.inf))
            drafts.append(tokens[:, rank])
        return jnp.stack(drafts, axis=1).astype(jnp.int32), jnp.stack(valid[1:], axis=1)


@dataclasses.dataclass(frozen=True, eq=False)
class Medusa(Proposer):
    """Medusa heads drafting a token tree (default: a chain, one token per head).

    `tree` is a TokenTree, a list of paths (Medusa's choice lists: `[(0,), (1,), (0, 0), ...]`,
    rank r at depth d being head d's r-th best token), or None for the chain over every head.
    """

    head: MedusaHead
    tree: TokenTree | None = None

    def __post_init__(self):
        if not isinstance(self.head, MedusaHead):
            raise ValueError(
                f"Medusa head must be a specjax.models.MedusaHead (see specjax.load_head), "
                f"got {type(self.head).__name__}"
            )
        tree = self.tree
        if tree is None:
            tree = TokenTree.chain(self.head.config.num_heads)
        elif not isinstance(tree, TokenTree):
            tree = TokenTree(tree)
        if tree.depth > self.head.config.num_heads:
            raise ValueError(
                f"Medusa tree has depth {tree.depth}, more than the head's {self.head.config.num_heads} "
                "heads (one head per depth)"
            )
        object.__setattr__(self, "tree", tree)

    @property
    def draft_positions(self) -> int:
        return self.tree.depth

    def trained_heads(self) -> tuple:
        return (self.head,)

    def spec(self, target: Model, warp=None, mesh=None) -> MedusaSpec:
        self.head.check_target(target)
        return MedusaSpec(tree=self.tree, hidden_size=target.config.hidden_size)

    def params(self, target: Model) -> HeadInputs:
        def build(target):
            vocab = jnp.asarray(self.head.vocab)
            if self.head.config.own_lm_heads:  # reads its own LM heads, not the target's
                return HeadInputs(self.head.params, None, vocab)
            return HeadInputs(self.head.params, draft_head_matrix(target.params, vocab), vocab)

        return kept_inputs(self, target, build)
