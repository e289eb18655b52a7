"""EAGLE: draft in the target's feature space with a trained one-layer head (models/eagle.py).

State per row: the head's own one-layer KV cache, and the target hidden states it has not fed
yet ("pending"). Pair p of the head is (f_p, x_{p+1}): the target's hidden state at position p
and the token that followed. With L tokens committed, the target has computed f_0 .. f_{L-2};
the head's cache holds pairs 0 .. L-2-c, and the last c hidden states wait in `pending`:

- after the prefill, c = 1 (f_{T-1} of the prompt: the first generated token x_T is its partner);
- after a step that accepted n drafts, c = n + 1: the target's hidden states at the last token
  and the accepted drafts, partnered with the accepted drafts and the bonus token.

`propose` feeds the pending pairs as one block (padded to `accepts` + 1, each row its own count), whose
last output predicts f_{L-1}; the head's LM-head read of it ranks the first draft tokens. Later
depths feed the head its own predictions. Drafting follows a token tree (a chain is the
one-branch tree): pass d feeds every node at once under the tree's ancestor mask and reads the
nodes at depth d, whose children take their ranked candidates. Deeper nodes ride along in every
pass with placeholder inputs; the mask keeps them from touching shallower ones, and the head is
small enough that feeding all nodes costs the same as feeding one on this hardware.

Drafts are deterministic (each node is its parent's rank-r candidate, q one-hot): verification
keeps the output lossless at any temperature.

With a `confidence_threshold` (chains only), a row verifies its drafts only while the head's
probability of the path up to them (the product of each draft's probability under the head's own
softmax) stays at least the threshold, as EAGLE-2 ranks draft paths by that product: a draft's
chance of acceptance is worth a verify position only when it beats what the position costs. A step
whose rows drafted fewer tokens verifies only as wide as they need (`verify_widths`), a one-token
pass where none drafted. Dropping drafts never changes the output, only the speed.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_number
from specjax.kernels.layouts import pack_panels
from specjax.models.cache import KVCache, cache_bytes, init_cache
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.eagle import EagleConfig, EagleHead, eagle_entries, eagle_features, eagle_panel_weights
from specjax.models.model import Model
from specjax.speculate.grammar import mask_draft_logits
from specjax.speculate.proposers.base import HeadInputs, Proposal, check_k, kept_inputs
from specjax.speculate.proposers.protocol import (
    FINAL_HIDDEN,
    Capabilities,
    InitContext,
    ProposeContext,
    Proposer,
    ProposerSpec,
    UpdateContext,
)
from specjax.speculate.tree import TokenTree


@flax.struct.dataclass
class EagleState:
    cache: KVCache  # the head's, one layer
    pending: jax.Array  # [B, accepts+1, D] target hidden states not yet fed to the head
    num_pending: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class _Levels:
    """Static tables for drafting a tree level by level (all numpy, from the TokenTree)."""

    nodes_at: tuple[np.ndarray, ...]  # per depth d = 1..D: the drafted nodes (0-based) there
    parent_slot: tuple[np.ndarray, ...]  # per depth d: each node's parent, as an index into depth d-1's nodes
    ranks_at: tuple[np.ndarray, ...]  # per depth d: each node's rank among its siblings
    widths: tuple[int, ...]  # per depth d: candidates needed per parent (max rank + 1)


@functools.lru_cache(maxsize=64)
def _levels(tree: TokenTree) -> _Levels:
    depths, parents, ranks = tree.depths[1:], tree.parents[1:] - 1, tree.ranks[1:]  # parent -1: root
    nodes_at, parent_slot, ranks_at, widths = [], [], [], []
    for d in range(1, tree.depth + 1):
        nodes = np.nonzero(depths == d)[0]
        previous = nodes_at[-1] if nodes_at else np.array([-1])
        slot_of = {int(n): i for i, n in enumerate(previous)}
        nodes_at.append(nodes)
        parent_slot.append(np.array([slot_of[int(parents[n])] for n in nodes], np.int32))
        ranks_at.append(ranks[nodes])
        widths.append(int(ranks[nodes].max()) + 1)
    return _Levels(tuple(nodes_at), tuple(parent_slot), tuple(ranks_at), tuple(widths))


@dataclasses.dataclass(frozen=True)
class EagleSpec(ProposerSpec):
    """The static part of an EAGLE proposer: the head's config, k, and the draft tree (None: a
    chain of k, verified by the chain code)."""

    config: EagleConfig
    k: int
    tree: TokenTree | None = None
    dtype: str = "float32"  # the head's weights, which its KV cache follows
    max_accepted: int | None = None  # more than k when paired with a longer drafter (`accepting`)
    confidence_threshold: float = 0.0  # verify a chain's drafts while their path probability >= this

    @property
    def capabilities(self) -> Capabilities:
        # With a confidence threshold a row drafts only its confident prefix, and a step verifies
        # the smallest chain length covering every running row's (verify_widths). The pending
        # features hold `accepts` + 1 of the target's: more than k beside a longer drafter.
        thresholded = self.confidence_threshold > 0.0
        return Capabilities(
            tree=self.tree,
            always_drafts=not thresholded,
            target_features=self._target_features,
            verify_widths=tuple(range(1, self.k + 1)) if thresholded else None,
            catches_up=True,
            accepts=self.max_accepted,
        )

    def accepting(self, K: int) -> EagleSpec:
        """This spec, catching up on up to K accepted drafts a step (K >= k)."""
        return self if K <= self.accepts else dataclasses.replace(self, max_accepted=K)

    @property
    def drafting_tree(self) -> TokenTree:
        return TokenTree.chain(self.k) if self.tree is None else self.tree

    # What the loop hands `init` and `update` as the target's features: its final-normed hidden
    # states (EAGLE-1); EAGLE-3 asks for the streams entering some of its layers.
    _target_features = FINAL_HIDDEN

    def state_bytes(self, batch_size: int, capacity: int) -> int:
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        pending = batch_size * (self.accepts + 1) * self._pending_width * 4
        return cache_bytes(self.config.layer_config, batch_size, capacity, itemsize) + pending

    def with_panel_weights(self, params: HeadInputs) -> HeadInputs:
        """The params for drafting on the CPU: the head's weights and its draft vocabulary's head
        columns as panels, read by the CPU kernel (specjax.kernels, which computes in float32: a
        head of another dtype keeps XLA's products)."""
        if self.dtype != "float32":
            return params
        head_matrix = pack_panels(params.head_matrix)  # (a quantized target head's: quantized panels)
        return params.replace(head=eagle_panel_weights(params.head), head_matrix=head_matrix)

    # The things a kind of head does; Eagle3Spec (proposers/eagle3.py) overrides them.
    @property
    def _pending_width(self) -> int:
        return self.config.hidden_size

    def _feed_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache, **options):
        """The head's outputs [B, T, D] for pairs (the target's features, the next tokens)."""
        return eagle_features(
            params.head, self.config, embed, target_features, tokens, positions, cache, **options
        )

    def _write_target(self, params: HeadInputs, embed, target_features, tokens, positions, cache):
        """The cache with the keys and values `_feed_target` writes, without the head's outputs."""
        return eagle_entries(params.head, self.config, embed, target_features, tokens, positions, cache)

    def _feed_own(self, params: HeadInputs, embed, own_features, tokens, positions, cache, **options):
        """The head's outputs for pairs (its own outputs one step back, the drafted tokens)."""
        return eagle_features(
            params.head, self.config, embed, own_features, tokens, positions, cache, **options
        )

    def _logits(self, params: HeadInputs, outputs):
        """Logits [..., W] over the head's draft vocabulary (params.vocab maps them to token ids)."""
        return draft_logits(params.head_matrix, outputs)

    def init(self, ctx: InitContext) -> EagleState:
        """Feed the prompt's pairs (f_p, x_{p+1}), p < T - 1; f_{T-1} waits for the first token."""
        params, prompt_tokens, prompt_lengths = ctx.params, ctx.prompt_tokens, ctx.prompt_lengths
        target_params, capacity, target_hidden = ctx.target_params, ctx.capacity, ctx.target_features
        B, T = prompt_tokens.shape
        rows = jnp.arange(B)
        cache = init_cache(self.config.layer_config, B, capacity, self.dtype)
        next_tokens = jnp.concatenate([prompt_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        _, cache = self._feed_target(
            params, target_params.embed, target_hidden, next_tokens, positions, cache, empty_cache=True
        )  # pair T-1 (padding as its token) sits past the length: stale, overwritten by the first step
        pending = jnp.zeros((B, self.accepts + 1, target_hidden.shape[-1]), target_hidden.dtype)
        pending = pending.at[:, 0].set(target_hidden[rows, prompt_lengths - 1])
        return EagleState(
            cache=cache.replace(lengths=prompt_lengths - 1),
            pending=pending,
            num_pending=jnp.ones((B,), jnp.int32),
        )

    def update(self, ctx: UpdateContext, state: EagleState) -> EagleState:
        pending = ctx.path_features.astype(state.pending.dtype)
        return state.replace(pending=pending, num_pending=ctx.num_accepted + 1)

    def _pending_pairs(self, state: EagleState, tokens, lengths):
        """The pending pairs as one block, padded to accepts + 1: their tokens [B, P] (at L-c .. L-1
        for hidden states at L-1-c .. L-2), positions [B, P], and the head's cache rolled back to
        where they go."""
        B, S = tokens.shape
        start = lengths - 1 - state.num_pending
        offsets = jnp.arange(self.accepts + 1)[None, :]
        block_tokens = tokens[jnp.arange(B)[:, None], jnp.minimum(start[:, None] + 1 + offsets, S - 1)]
        return block_tokens, start[:, None] + offsets, state.cache.replace(lengths=start)

    def _catch_up(self, target_params, params: HeadInputs, state: EagleState, tokens, lengths):
        """Feed the pending pairs as one block: (the head's outputs [B, accepts+1, D], its cache
        holding pairs 0 .. L-2)."""
        block_tokens, positions, cache = self._pending_pairs(state, tokens, lengths)
        features, cache = self._feed_target(
            params, target_params.embed, state.pending, block_tokens, positions, cache
        )
        return features, cache.advance(state.num_pending)  # lengths - 1: pairs 0 .. L-2 are in

    def observe(self, ctx: ProposeContext, state: EagleState) -> EagleState:
        """A step it does not draft (Hybrid's gate held it back): only the pending pairs' keys and
        values into the head's cache (no outputs, no LM head), so that the cache stays whole for
        the steps it drafts again."""
        block_tokens, positions, cache = self._pending_pairs(state, ctx.tokens, ctx.lengths)
        embed = ctx.target_params.embed
        cache = self._write_target(ctx.params, embed, state.pending, block_tokens, positions, cache)
        return state.replace(cache=cache.advance(state.num_pending))

    def propose(self, ctx: ProposeContext, state: EagleState):
        target_params, params, tokens, lengths = ctx.target_params, ctx.params, ctx.tokens, ctx.lengths
        B = tokens.shape[0]
        rows = jnp.arange(B)
        embed = target_params.embed
        tree, levels = self.drafting_tree, _levels(self.drafting_tree)
        N = tree.num_nodes

        features, cache = self._catch_up(target_params, params, state, tokens, lengths)
        root = features[rows, state.num_pending - 1]  # [B, D] predicts f_{L-1}

        # (the target's vocabulary size: what the automaton's edge keys are built with)
        grammar = None if ctx.grammar_states is None else ctx.sampling.grammar
        vocab_size = ctx.target_params.embed.shape[0]

        def candidates(parent_features, parent_states, width):
            """[B, n, D] -> (token ids [B, n, width], their log-probabilities under the head), the
            head's logits masked by the parents' automaton states [B, n] (None: no constraint)."""
            logits = self._logits(params, parent_features).astype(jnp.float32)
            logits = mask_draft_logits(grammar, logits, parent_states, params.vocab)
            top, index = jax.lax.top_k(logits, width)
            return params.vocab[index], top - jax.nn.logsumexp(logits, axis=-1, keepdims=True)

        node_tokens = jnp.zeros((B, N), jnp.int32)
        node_logprobs = jnp.zeros((B, N), jnp.float32)  # each node's path log-probability
        parent_logprobs = jnp.zeros((B, 1), jnp.float32)
        node_inputs = jnp.zeros((B, N, root.shape[-1]), root.dtype)  # each node's parent's features
        parent_features = root[:, None]  # [B, 1, D]: the level above depth 1
        parent_states = None if ctx.grammar_states is None else ctx.grammar_states[:, None]
        node_positions = (lengths - 2)[:, None] + jnp.asarray(tree.depths[1:])[None, :]
        node_mask = tree.attention_mask[1:, 1:]
        for d in range(tree.depth):  # fill depth d + 1 from the features of depth d
            nodes, parent_slot, ranks = levels.nodes_at[d], levels.parent_slot[d], levels.ranks_at[d]
            ranked, logprobs = candidates(parent_features, parent_states, levels.widths[d])  # [B, n_d, W_d]
            node_tokens = node_tokens.at[:, nodes].set(ranked[:, parent_slot, ranks])
            if parent_states is not None:  # the states at depth d + 1's nodes, their parents' next
                parent_states = grammar.step(
                    parent_states[:, parent_slot], ranked[:, parent_slot, ranks], vocab_size
                )
            parent_logprobs = parent_logprobs[:, parent_slot] + logprobs[:, parent_slot, ranks]
            node_logprobs = node_logprobs.at[:, nodes].set(parent_logprobs)
            node_inputs = node_inputs.at[:, nodes].set(parent_features[:, parent_slot])
            if d + 1 < tree.depth:  # the last level's features are not needed
                features, cache = self._feed_own(
                    params, embed, node_inputs, node_tokens, node_positions, cache, fresh_mask=node_mask
                )  # written past the length: scratch, never committed
                parent_features = features[:, nodes]
        valid = jnp.ones((B, N), bool)
        if parent_states is not None:  # a node ranked past what its parent's state allows: no draft
            valid = node_logprobs > -jnp.inf
        if self.confidence_threshold > 0.0:  # a chain: path probabilities fall with depth, a prefix stays
            valid = node_logprobs >= np.log(self.confidence_threshold)
        proposal = Proposal(draft_tokens=node_tokens, valid=valid)
        return proposal, state.replace(cache=cache)


def chain_or_tree(owner: str, k: int | None, tree) -> tuple[int, TokenTree | None]:
    """(k, tree) of a head proposer: a chain of k (default 4), or a TokenTree (or list of paths)
    whose depth is k; a one-branch tree becomes a chain, verified by the chain code."""
    if tree is not None and not isinstance(tree, TokenTree):
        tree = TokenTree(tree)
    if tree is None:
        k = 4 if k is None else k
        check_k(owner, k)
        return k, None
    if k is not None and k != tree.depth:
        raise ValueError(f"{owner} k={k!r} disagrees with the tree's depth {tree.depth}: give one of them")
    return tree.depth, None if tree.is_chain else tree


def _check_confidence_threshold(owner: str, threshold, tree) -> float:
    """The threshold as a float in [0, 1); a tree with one is an error: a tree's verify pass scores
    every node of its fixed shape, so leaving nodes out would save nothing."""
    if not is_number(threshold) or not 0 <= threshold < 1:
        raise ValueError(f"{owner} confidence_threshold must be a number in [0, 1), got {threshold!r}")
    if threshold > 0 and tree is not None:
        raise ValueError(
            f"{owner} confidence_threshold={threshold!r} applies to chains, not to a tree (its verify pass "
            "scores every node of the tree's fixed shape): give k instead of tree, or no threshold"
        )
    return float(threshold)


def settle_drafting(proposer, owner: str) -> None:
    """Check and normalise a head proposer's drafting fields (Eagle, Eagle3; frozen, so set in
    place): k and tree as `chain_or_tree` gives them, the confidence threshold as a float."""
    k, tree = chain_or_tree(owner, proposer.k, proposer.tree)
    threshold = _check_confidence_threshold(owner, proposer.confidence_threshold, tree)
    for name, value in (("k", k), ("tree", tree), ("confidence_threshold", threshold)):
        object.__setattr__(proposer, name, value)


def head_spec(spec_class, proposer, target: Model):
    """The spec of a head proposer (Eagle, Eagle3) for `target`: the head checked against it, its
    drafting fields, and its weights' dtype (which its KV cache follows)."""
    proposer.head.check_target(target)
    return spec_class(
        config=proposer.head.config,
        k=proposer.k,
        tree=proposer.tree,
        dtype=proposer.head.params.fc.dtype.name,
        confidence_threshold=proposer.confidence_threshold,
    )


class HeadProposer(Proposer):
    """What the head proposers (Eagle, Eagle3, MTP) share: a chain of k or a token tree (whose
    depth is k), a k changed only for a chain, and the trained head they draft with (`head`; MTP
    drafts with the target's own layers)."""

    def with_k(self, k: int):
        if self.tree is not None:
            return super().with_k(k)
        return dataclasses.replace(self, k=k)  # keeps its confidence threshold

    def trained_heads(self) -> tuple:
        return (self.head,)


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle(HeadProposer):
    """An EAGLE head drafting a chain of k tokens, or a token tree (`tree`: a TokenTree or a list
    of paths, e.g. `TokenTree.top_k((4, 2, 2))`; k is then the tree's depth and must not be given
    otherwise). Each node drafts its parent's rank-r candidate, from the head's own prediction at
    the parent. `confidence_threshold` (chains only, default 0: every draft): a row verifies its
    drafts only while the product of their probabilities under the head is at least this."""

    head: EagleHead
    k: int | None = None
    tree: TokenTree | None = None
    confidence_threshold: float = 0.0

    def __post_init__(self):
        if not isinstance(self.head, EagleHead):
            raise ValueError(
                f"Eagle head must be a specjax.models.EagleHead (see specjax.load_head), "
                f"got {type(self.head).__name__}"
            )
        settle_drafting(self, "Eagle")

    def spec(self, target: Model, warp=None, mesh=None) -> EagleSpec:
        return head_spec(EagleSpec, self, target)

    def params(self, target: Model) -> HeadInputs:
        def build(target):
            vocab = jnp.asarray(self.head.vocab)
            matrix = draft_head_matrix(target.params, vocab)
            return HeadInputs(head=self.head.params, head_matrix=matrix, vocab=vocab)

        return kept_inputs(self, target, build)
