"""Token trees inside the compiled loop, on tiny random models: Medusa heads (chain and trees,
trained on the target's continuations, so that their drafts are accepted part of the time), an
oracle tree proposer whose right answers sit at varying ranks (so accepted paths run through
later siblings and their keys and values must be moved into place), and a chain driven through
the tree code, which must give the chain code's tokens bit for bit."""

import dataclasses
import functools

import by_hand
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, layered_target, trained_medusa
from oracle import Oracle, references
from tiny import tiny_model

import specjax
from specjax.models import MedusaHead
from specjax.speculate.proposers import Capabilities, Proposal, Proposer, Stateless, ngram_propose
from specjax.speculate.tree import TokenTree

# A target whose second layer adds small updates (tests/drafters.py), so that heads trained on its
# continuations draft it part of the time; seed 15 hardly repeats a token, so fresh heads, which
# draft the target's last prediction again, accept 4% at most.
TARGET = layered_target(seed=15, late_scale=0.3)
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]
HEAD = MedusaHead.init(TARGET, num_heads=3, key=jax.random.key(0), scale=0.5)
# Heads drafting from a 40-token subset of the vocabulary, in a shuffled order.
SUBSET_HEAD = MedusaHead.init(
    TARGET, num_heads=3, key=jax.random.key(0), scale=0.5, vocab=np.random.default_rng(1).permutation(97)[:40]
)
TREES = {
    "chain": None,
    "top_k": TokenTree.top_k((3, 2)),
    "sparse": [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1)],
}


@functools.cache
def trained_heads(subset: bool) -> MedusaHead:
    """Three Medusa heads trained on the target's continuations (once, a few seconds), drafting
    from the whole vocabulary or from SUBSET_HEAD's (then missing the tokens outside it)."""
    heads = trained_medusa(TARGET, num_heads=3)
    if not subset:
        return heads
    vocab = SUBSET_HEAD.vocab
    return dataclasses.replace(
        heads, config=dataclasses.replace(heads.config, draft_vocab_size=len(vocab)), vocab=vocab
    )


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


@pytest.mark.parametrize(
    "tree, subset",
    # By default the top-k tree (a chain and a sparse tree: `make test-all`; a chain through the tree
    # code is checked below).
    [pytest.param(name, False, marks=() if name == "top_k" else pytest.mark.slow) for name in TREES]
    + [pytest.param("top_k", True, marks=pytest.mark.slow)],
    ids=[*TREES, "top_k-subset"],
)
def test_medusa_greedy_equals_plain(plain_greedy, tree, subset):
    proposer = specjax.Medusa(trained_heads(subset), tree=TREES[tree])
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    one = specjax.generate(TARGET, PROMPTS[2:3], proposer=proposer, max_new_tokens=24)
    assert one.tokens == plain_greedy[2:3]
    m = result.metrics
    assert (m.accept_hist.sum(1) == m.steps).all()
    assert (m.accepted_at.sum(1) == m.accepted).all()
    assert (m.reached_at >= m.accepted_at).all()
    assert m.drafted.sum() == m.steps.sum() * proposer.tree.num_nodes
    check_acceptance(m, 0.1, 0.9)  # 0.17 (the subset) to 0.35 here


def test_oracle_full_tree_accepts_later_siblings_and_stays_exact(plain_greedy):
    """Every step accepts a whole path, mostly through siblings of rank > 0: their keys and values
    were written elsewhere and had to be moved, or the tokens after them would be wrong."""
    tree = TokenTree.top_k((3, 2, 2))
    oracle = Oracle(tree, references(PROMPTS, plain_greedy))
    result = specjax.generate(TARGET, PROMPTS, proposer=oracle, max_new_tokens=24)
    assert result.tokens == plain_greedy
    summary = result.metrics.summary()
    assert summary["conditional_acceptance_per_position"] == [1.0] * tree.depth
    # Up to the rows' last steps (cut by max_new_tokens), every step accepts the full depth.
    assert summary["mean_acceptance_length"] > tree.depth + 0.5
    assert summary["expected_acceptance_per_position"] == pytest.approx([1.0] * tree.depth)


def test_oracle_sparse_tree_stays_exact(plain_greedy):
    """A sparse tree: the right token is often missing, so paths end at every depth."""
    tree = TokenTree([(0,), (1,), (1, 0), (1, 1), (1, 1, 0)])
    oracle = Oracle(tree, references(PROMPTS, plain_greedy))
    result = specjax.generate(TARGET, PROMPTS, proposer=oracle, max_new_tokens=24)
    assert result.tokens == plain_greedy
    histogram = result.metrics.summary()["acceptance_length_histogram"]
    assert all(count > 0 for count in histogram[1:]), histogram


def test_wrong_tree_tokens_are_never_accepted(plain_greedy):
    """The oracle with a shifted reference is always wrong: nothing accepted, output unchanged."""
    shifted = references(PROMPTS, [[(t + 1) % 97 for t in row] for row in plain_greedy])
    oracle = Oracle(TokenTree.top_k((2, 2)), shifted)
    result = specjax.generate(TARGET, PROMPTS, proposer=oracle, max_new_tokens=24)
    assert result.tokens == plain_greedy
    assert result.metrics.accepted.sum() == 0


# ---------------------------------------------------------------------------------------------
# A chain through the tree code against the chain code, at temperature > 0 (same keys).


@dataclasses.dataclass(frozen=True)
class LookupSpec(Stateless):
    k: int
    as_tree: bool

    @property
    def capabilities(self):
        return Capabilities(tree=TokenTree.chain(self.k) if self.as_tree else None, stateless=True)

    def propose(self, ctx, state):
        proposal = ngram_propose(ctx.tokens, ctx.lengths, self.k, 3, 1)
        return Proposal(proposal.draft_tokens, jnp.ones_like(proposal.valid)), state


@dataclasses.dataclass(frozen=True)
class Lookup(Proposer):
    k: int
    as_tree: bool

    def spec(self, target, warp, mesh):
        return LookupSpec(self.k, self.as_tree)

    def params(self, target):
        return None


def test_chain_through_the_tree_code_equals_the_chain_code():
    sampling = [specjax.Sampling(temperature=0.9, top_k=6, repetition_penalty=1.3), specjax.Sampling()] * 2
    runs = [
        specjax.generate(
            TARGET,
            PROMPTS,
            proposer=Lookup(3, as_tree),
            sampling=sampling,
            key=jax.random.key(3),
            max_new_tokens=30,
        )
        for as_tree in (False, True)
    ]
    assert runs[0].tokens == runs[1].tokens
    a, b = runs[0].metrics.summary(), runs[1].metrics.summary()
    for name in ("num_accepted_tokens", "acceptance_length_histogram", "conditional_acceptance_per_position"):
        assert a[name] == b[name], name
    assert a["expected_acceptance_per_position"] == pytest.approx(b["expected_acceptance_per_position"])
    assert a["num_accepted_tokens"] > 0


def test_bad_medusa_arguments():
    with pytest.raises(ValueError, match="Medusa head must be"):
        specjax.Medusa("heads")
    with pytest.raises(ValueError, match="depth 4, more than the head's 3"):
        specjax.Medusa(HEAD, tree=TokenTree.chain(4))
    with pytest.raises(ValueError, match="needs its parent"):
        specjax.Medusa(HEAD, tree=[(0,), (1, 0)])
    other = tiny_model(seed=12)
    with pytest.raises(ValueError, match="Medusa head was trained for target"):
        specjax.generate(other, PROMPTS[:1], proposer=specjax.Medusa(HEAD), max_new_tokens=2)
    smaller = tiny_model(seed=11, hidden_size=32)
    with pytest.raises(ValueError, match="Medusa head is for hidden size 64"):
        specjax.generate(smaller, PROMPTS[:1], proposer=specjax.Medusa(HEAD), max_new_tokens=2)


def test_subset_heads_draft_only_their_vocabulary():
    """A Medusa head with a draft vocabulary proposes nothing outside it, and ranks its tokens by
    the target's head columns for them."""
    proposer = specjax.Medusa(SUBSET_HEAD, tree=TokenTree.top_k((3, 2)))
    spec, params = proposer.spec(TARGET), proposer.params(TARGET)
    hidden = jax.random.normal(jax.random.key(2), (3, TARGET.config.hidden_size))
    state = specjax.speculate.proposers.medusa.MedusaState(hidden=hidden)
    proposal, _ = by_hand.propose(spec, TARGET.params, params, state, None, None, None, None, None)
    drafted = np.asarray(proposal.draft_tokens)
    assert set(drafted.ravel().tolist()) <= set(SUBSET_HEAD.vocab.tolist())
    features = specjax.models.medusa.medusa_hidden(SUBSET_HEAD.params, hidden)  # [3, M, D]
    full = np.asarray(specjax.models.lm_head(TARGET.params, features))[:, :, SUBSET_HEAD.vocab]
    best = SUBSET_HEAD.vocab[np.argmax(full, axis=-1)]  # [3, M]: each head's best subset token
    assert (drafted[:, 0] == best[:, 0]).all()  # node (0,): head 0's best
    assert (drafted[:, 3] == best[:, 1]).all()  # node (0, 0): head 1's best
