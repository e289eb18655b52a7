"""Token trees (specjax/speculate/tree.py): the static tables and both tree verifiers.

- `TokenTree` tables: literal arrays on hand-made trees, the definitions on random trees, and a
  ValueError naming the problem for every malformed path list.
- `tree_greedy_verify`: hand-made rows, and a pure-Python walk over `tree.paths` on random rows.
- On a chain, both tree verifiers return bit for bit what the chain verifiers return (same keys).
- `parents_by_depth` on hand-made paths; `tree_expected_acceptance` against `tree_law`.
- `tree_rejection_sample` against its exact laws, computed by enumeration over the tree in float64
  numpy (`tree_law`). As in tests/test_verify.py, one fixed experiment is replicated over many rows
  with one key per row, and each law is checked with tests/laws.py: an outcome of probability
  exactly 0 never occurs, each count lies within 6 binomial standard deviations plus 3, and a
  G-test over all cells passes at false-alarm rate 1e-6 per law. At ROWS = 60,000 the laws over
  whole rows (the first token, the last accepted node, num_accepted: up to 10 cells; the joint
  laws of two outcomes: up to 36 cells after pooling) detect, with probability 0.9, any change
  that moves 1.3% to 1.8% of their mass; the law of the token after node c sees only the rows
  that accepted c (none to 75% of them here) and detects shifts of 1.6% to 16%.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from laws import assert_law

from specjax.speculate import MAX_SPECULATIVE_TOKENS, greedy_verify, rejection_sample
from specjax.speculate.tree import (
    MAX_TREE_NODES,
    TokenTree,
    parents_by_depth,
    tree_expected_acceptance,
    tree_greedy_verify,
    tree_rejection_sample,
)
from specjax.speculate.verify import expected_acceptance

ROWS = 60_000
VOCAB = 8

_tree_rejection_sample = jax.jit(tree_rejection_sample, static_argnums=1)
_tree_greedy_verify = jax.jit(tree_greedy_verify, static_argnums=0)

# Nodes 1..5: (0,) (1,) (0, 0) (0, 1) (1, 0); given shuffled on purpose.
SMALL = TokenTree([(1, 0), (0,), (0, 1), (1,), (0, 0)])
# Nodes 1..6: (0,) (1,) (2,) (0, 0) (0, 1) (1, 0).
WIDE = TokenTree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
# Nodes 1..9: (0,) (1,) (0, 0) (0, 1) (1, 0) (0, 0, 0) (0, 0, 1) (0, 1, 0) (1, 0, 0).
DEEP = TokenTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)])


# ---------------------------------------------------------------------------------------------
# Helpers and the exact law


def normalize(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / x.sum(-1, keepdims=True)


def peaky(rng: np.random.Generator, shape, zero_frac: float = 0.3) -> np.ndarray:
    """Random distributions over the last axis: uniform**3 with some exact zeros (float64)."""
    x = rng.uniform(size=shape) ** 3
    x[rng.uniform(size=shape) < zero_frac] = 0
    keep = rng.integers(shape[-1], size=shape[:-1])[..., None]  # at least one nonzero entry
    np.put_along_axis(x, keep, 0.5 + rng.uniform(size=keep.shape), axis=-1)
    return normalize(x)


def forbidding(rng: np.random.Generator, rows: int) -> np.ndarray:
    """[rows, VOCAB] peaky distributions that give token 0 probability 0."""
    p = np.concatenate([np.zeros((rows, 1)), peaky(rng, (rows, VOCAB - 1))], axis=1)
    return normalize(p.astype(np.float32))


def draw(rng: np.random.Generator, probs) -> np.ndarray:
    """One exact draw from each distribution probs[..., :] (a zero-mass token is never drawn)."""
    cdf = np.cumsum(np.asarray(probs, np.float64), -1)
    u = rng.uniform(size=cdf.shape[:-1]) * cdf[..., -1]
    return (u[..., None] >= cdf).sum(-1).astype(np.int32)


def tree_law(tree: TokenTree, p: np.ndarray, q: np.ndarray, valid=None):
    """The exact law of tree_rejection_sample for fixed p [N+1, V] (the target after each node),
    q [N, V] (the law each node's token is drawn from, independently; one-hot for a deterministic
    candidate) and valid [N].

    At a node, with residual r (p there at first), a valid child c drawn x ~ q_c is accepted with
    probability min(1, r(x)/q_c(x)): it is accepted *with token x* with probability
    P(its turn) * min(q_c(x), r(x)), and rejected with probability 1 - sum min(q_c, r) whatever x
    was, after which r = normalize(max(r - q_c, 0)), again whatever x was. So the stop token at a
    node whose valid children all failed follows the final r, whatever the children's tokens.

    Returns accepted [N+1, V] (P(node c is accepted with token x); row 0 is 0), final [N+1]
    (P(node i is the last accepted)), residual [N+1, V] (the stop token's law given that) and
    onward [N+1] (P(one of node i's children is accepted | the row is at node i)).
    """
    n, v = tree.num_nodes, p.shape[-1]
    valid = np.ones(n, bool) if valid is None else np.asarray(valid)
    accepted, residual = np.zeros((n + 1, v)), np.zeros((n + 1, v))
    final, onward, reach = np.zeros(n + 1), np.zeros(n + 1), np.zeros(n + 1)
    reach[0] = 1.0
    for node in range(n + 1):  # every node comes after its parent
        r, rejected = normalize(p[node]), 1.0
        for child in tree.children[node]:
            if child < 0 or not valid[child - 1]:
                continue
            accepted[child] = reach[node] * rejected * np.minimum(q[child - 1], r)
            reach[child] = accepted[child].sum()
            rejected *= 1 - np.minimum(q[child - 1], r).sum()
            left = np.maximum(r - q[child - 1], 0)
            r = normalize(left) if left.sum() > 0 else r
        final[node], residual[node], onward[node] = reach[node] * rejected, r, 1 - rejected
    return accepted, final, residual, onward


def run_tree(seed, tree, p, q, node_tokens, valid=None):
    """tree_rejection_sample with one key per row; p, q and valid are broadcast over the rows."""
    rows = len(node_tokens)
    p = jnp.asarray(np.broadcast_to(p, (rows, *p.shape[-2:])), jnp.float32)
    q = None if q is None else jnp.asarray(np.broadcast_to(q, (rows, *q.shape[-2:])), jnp.float32)
    valid = None if valid is None else jnp.asarray(np.broadcast_to(valid, node_tokens.shape))
    keys = jax.random.split(jax.random.key(seed), rows)
    out = _tree_rejection_sample(keys, tree, p, q, jnp.asarray(node_tokens, jnp.int32), valid)
    return tuple(np.asarray(x) for x in out)


def last_node(n: np.ndarray, path: np.ndarray) -> np.ndarray:
    return np.where(n > 0, path[np.arange(len(n)), np.maximum(n - 1, 0)], 0)


def assert_tree_layout(tree, tokens, n, path, node_tokens, valid=None, p=None) -> None:
    """path is the last node's path; tokens: the drafted tokens on it, then a token, then -1;
    nodes on the path are valid; with p [rows or 1, N+1, V], every emitted token has p > 0 at
    the node it follows."""
    rows, depth = len(n), tree.depth
    assert tokens.shape == (rows, depth + 1) and path.shape == (rows, depth) and n.shape == (rows,)
    assert tokens.dtype == np.int32 and n.dtype == np.int32 and path.dtype == np.int32
    last = last_node(n, path)
    np.testing.assert_array_equal(tree.depths[last], n)
    np.testing.assert_array_equal(path, tree.path_nodes[last])
    on_path = np.arange(depth) < n[:, None]
    drafted = np.take_along_axis(np.asarray(node_tokens), np.maximum(path - 1, 0), axis=1)
    assert (tokens[:, :depth][on_path] == drafted[on_path]).all(), "accepted tokens differ from the nodes'"
    if valid is not None:
        valid = np.broadcast_to(valid, (rows, tree.num_nodes))
        assert np.take_along_axis(valid, np.maximum(path - 1, 0), axis=1)[on_path].all()
    assert (tokens[np.arange(depth + 1) > n[:, None]] == -1).all(), "positions after n must be -1"
    stop = tokens[np.arange(rows), n]
    assert ((stop >= 0) & (stop < VOCAB)).all()
    if p is not None:
        follows = np.concatenate([np.zeros((rows, 1), np.int32), path], axis=1)  # node before position j
        emitted = np.arange(depth + 1) < n[:, None] + 1
        p = np.broadcast_to(p, (rows, *p.shape[-2:]))
        row_ids = np.broadcast_to(np.arange(rows)[:, None], emitted.shape)
        assert (p[row_ids[emitted], follows[emitted], tokens[emitted]] > 0).all(), "a p = 0 token was emitted"


# ---------------------------------------------------------------------------------------------
# TokenTree tables


def test_tables_of_a_hand_made_tree():
    t = SMALL
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert (t.num_nodes, t.depth, t.widths, t.is_chain) == (5, 2, (2, 2), False)
    np.testing.assert_array_equal(t.parents, [-1, 0, 0, 1, 1, 2])
    np.testing.assert_array_equal(t.depths, [0, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(t.path_nodes, [[-1, -1], [1, -1], [2, -1], [1, 3], [1, 4], [2, 5]])
    np.testing.assert_array_equal(t.children, [[1, 2], [3, 4], [5, -1], [-1, -1], [-1, -1], [-1, -1]])
    mask = [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]  # fmt: skip
    np.testing.assert_array_equal(t.attention_mask, np.array(mask, bool))
    assert t == TokenTree(sorted(t.paths)) and hash(t) == hash(TokenTree(sorted(t.paths)))
    # Ranks may skip and are ordered as numbers: (2,) before (10,).
    gaps = TokenTree([(10,), (0,), (2,)])
    assert gaps.paths == ((0,), (2,), (10,)) and gaps.widths == (11,)
    np.testing.assert_array_equal(gaps.children, [[1, 2, 3], [-1] * 3, [-1] * 3, [-1] * 3])


def test_chain_and_top_k():
    chain = TokenTree.chain(3)
    assert chain.paths == ((0,), (0, 0), (0, 0, 0)) and chain.is_chain and chain.widths == (1, 1, 1)
    np.testing.assert_array_equal(chain.parents, [-1, 0, 1, 2])
    np.testing.assert_array_equal(chain.children, [[1], [2], [3], [-1]])
    np.testing.assert_array_equal(chain.attention_mask, np.tril(np.ones((4, 4), bool)))
    assert TokenTree.top_k((1, 1, 1)) == chain and TokenTree([(0,)]).is_chain
    assert not TokenTree([(1,)]).is_chain and not SMALL.is_chain
    top = TokenTree.top_k((3, 2))
    assert (top.num_nodes, top.depth, top.widths, top.is_chain) == (9, 2, (3, 2), False)
    assert top.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1))
    np.testing.assert_array_equal(top.parents, [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    np.testing.assert_array_equal(top.children[:4], [[1, 2, 3], [4, 5, -1], [6, 7, -1], [8, 9, -1]])
    assert (top.children[4:] == -1).all()


@settings(max_examples=60, deadline=None)
@given(
    raw=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple), min_size=1, max_size=12),
    order=st.randoms(use_true_random=False),
)
def test_tables_match_their_definitions_on_random_trees(raw, order):
    paths = sorted({path[:d] for path in raw for d in range(1, len(path) + 1)}, key=lambda p: (len(p), p))
    shuffled = list(paths)
    order.shuffle(shuffled)
    t = TokenTree(shuffled)
    assert t.paths == tuple(paths)
    index = {(): 0} | {path: i + 1 for i, path in enumerate(paths)}
    every = [()] + paths
    n, depth = len(paths), max(map(len, paths))
    assert (t.num_nodes, t.depth) == (n, depth)
    np.testing.assert_array_equal(t.parents, [-1] + [index[p[:-1]] for p in paths])
    assert (t.parents[1:] < np.arange(1, n + 1)).all()  # each node after its parent
    np.testing.assert_array_equal(t.depths, [len(p) for p in every])
    want = [[index[p[: d + 1]] if d < len(p) else -1 for d in range(depth)] for p in every]
    np.testing.assert_array_equal(t.path_nodes, want)
    want = [[q == p[: len(q)] for q in every] for p in every]  # j is a prefix of i: root, i, ancestor
    np.testing.assert_array_equal(t.attention_mask, want)
    kids = [[index[c] for c in sorted((c for c in paths if c[:-1] == p), key=lambda c: c[-1])] for p in every]
    width = max(1, max(map(len, kids)))
    np.testing.assert_array_equal(t.children, [k + [-1] * (width - len(k)) for k in kids])
    assert t.widths == tuple(1 + max(p[d] for p in paths if len(p) > d) for d in range(depth))
    assert t.is_chain == (paths == [(0,) * d for d in range(1, depth + 1)])


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "at least one path"),
        (5, "sequence of sequences"),
        ([(0,), (0, 1, 0)], r"needs its parent \(0, 1\)"),
        ([(0,), (1,), (0,)], "more than once"),
        ([(0,), (0, -1)], "ranks >= 0"),
        ([(0,), (1.0,)], "ranks >= 0"),
        ([(True,)], "ranks >= 0"),
        ([(0,), ()], "non-empty"),
        ([(i,) for i in range(MAX_TREE_NODES + 1)], f"at most {MAX_TREE_NODES} nodes"),
        ([(0,) * d for d in range(1, MAX_SPECULATIVE_TOKENS + 2)], f"depth at most {MAX_SPECULATIVE_TOKENS}"),
    ],
)
def test_bad_paths_are_reported(paths, message):
    with pytest.raises(ValueError, match=message):
        TokenTree(paths)


def test_tree_limits_and_bad_widths():
    assert TokenTree([(i,) for i in range(MAX_TREE_NODES)]).num_nodes == MAX_TREE_NODES
    assert TokenTree.chain(MAX_SPECULATIVE_TOKENS).depth == MAX_SPECULATIVE_TOKENS
    for widths in [(), (2, 0), (1.5,), (True,)]:
        with pytest.raises(ValueError, match="widths"):
            TokenTree.top_k(widths)


# ---------------------------------------------------------------------------------------------
# Greedy verification


def test_tree_greedy_verify_hand_made_rows():
    # SMALL's nodes 1..5 are (0,) (1,) (0, 0) (0, 1) (1, 0); every row drafts the same tokens.
    drafted = np.array([[3, 4, 2, 5, 1]] * 6, np.int32)
    # The target's argmax after [root, 1, 2, 3, 4, 5], per row; rows 4 and 5 repeat rows 0 and 1.
    argmax = np.array([[3, 5, 1, 6, 7, 2], [4, 5, 1, 6, 7, 2], [6, 5, 1, 6, 7, 2], [3, 0, 1, 6, 7, 2]])
    argmax = np.concatenate([argmax, argmax[:2]])
    valid = np.ones((6, 5), bool)
    valid[4, 0] = False  # (0,) invalid: its matching child (0, 1) is unreachable
    valid[5, 4] = False  # (1, 0) invalid
    logits = np.random.default_rng(0).normal(size=(6, 6, VOCAB)).astype(np.float32)
    np.put_along_axis(logits, argmax[..., None], 10.0, axis=-1)
    tokens, n, path = _tree_greedy_verify(SMALL, logits, drafted, valid)
    want_tokens = [
        [3, 5, 7],  # (0,), then its second child (0, 1), then the argmax after (0, 1)
        [4, 1, 2],  # the second root candidate (1,), then (1, 0)
        [6, -1, -1],  # no root candidate matches: the target's token
        [3, 0, -1],  # (0,) matches, none of its children does
        [3, -1, -1],
        [4, 1, -1],  # the argmax after (1,) equals the invalid (1, 0)'s token; it is not accepted
    ]
    np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
    np.testing.assert_array_equal(np.asarray(n), [2, 2, 0, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(path), [[1, 4], [2, 5], [-1, -1], [1, -1], [-1, -1], [2, -1]])
    assert tokens.dtype == jnp.int32 and n.dtype == jnp.int32 and path.dtype == jnp.int32
    tokens_all, _, _ = _tree_greedy_verify(SMALL, logits[:4], drafted[:4])  # valid=None: all valid
    np.testing.assert_array_equal(np.asarray(tokens_all), want_tokens[:4])


def greedy_walks(tree, argmax, node_tokens, valid):
    """From tree.paths alone: (the ends of the deepest walks along matching children, the walk
    that always takes the first matching child by rank). A child matches when it is valid and its
    token is the argmax at its parent."""
    index = {(): 0} | {path: i + 1 for i, path in enumerate(tree.paths)}

    def matching(path):
        kids = sorted((c for c in tree.paths if c[:-1] == path), key=lambda c: c[-1])
        return [c for c in kids if valid[index[c] - 1] and node_tokens[index[c] - 1] == argmax[index[path]]]

    ends = frontier = [()]
    while frontier := [c for path in frontier for c in matching(path)]:
        ends = frontier
    first = ()
    while kids := matching(first):
        first = kids[0]
    return ends, first


def walk_output(tree, end, argmax, node_tokens):
    index = {(): 0} | {path: i + 1 for i, path in enumerate(tree.paths)}
    nodes = [index[end[: d + 1]] for d in range(len(end))]
    pad = [-1] * (tree.depth - len(end))
    return [node_tokens[i - 1] for i in nodes] + [argmax[index[end]]] + pad, len(end), nodes + pad


@functools.partial(jax.jit, static_argnums=0)
def greedy_and_one_hot(tree, keys, logits, one_hot, node_tokens, valid):
    return (
        tree_greedy_verify(tree, logits, node_tokens, valid),
        tree_rejection_sample(keys, tree, one_hot, None, node_tokens, valid),
    )


@pytest.mark.parametrize(
    "tree",
    [TokenTree.chain(3), SMALL, DEEP, TokenTree.top_k((3, 2))],
    ids=["chain3", "small", "deep", "top32"],
)
def test_tree_greedy_verify_matches_a_brute_force_walk(tree):
    """Greedy: a deepest matching walk (any, if siblings share a token). Rejection sampling with a
    one-hot target and deterministic candidates is the first-match walk, whatever the key."""
    b, v, n_nodes = 256, 4, tree.num_nodes
    rng = np.random.default_rng(n_nodes)
    logits = rng.normal(size=(b, n_nodes + 1, v)).astype(np.float32)
    argmax = logits.argmax(-1)
    match = argmax[:, tree.parents[1:]]
    node_tokens = np.where(rng.uniform(size=(b, n_nodes)) < 0.7, match, rng.integers(v, size=(b, n_nodes)))
    valid = rng.uniform(size=(b, n_nodes)) < 0.85
    keys = jax.random.split(jax.random.key(1), b)
    one_hot = np.eye(v, dtype=np.float32)[argmax]
    out = greedy_and_one_hot(tree, keys, logits, one_hot, node_tokens.astype(np.int32), valid)
    greedy, sampled = ([np.asarray(x) for x in o] for o in out)
    for row in range(b):
        ends, first = greedy_walks(tree, argmax[row], node_tokens[row], valid[row])
        final = greedy[2][row][greedy[1][row] - 1] if greedy[1][row] else 0
        end = tree.paths[final - 1] if final else ()
        assert end in ends, f"row {row}: greedy stopped at {end}, deepest walks end at {ends}"
        want = walk_output(tree, end, argmax[row], node_tokens[row])
        assert [greedy[0][row].tolist(), greedy[1][row], greedy[2][row].tolist()] == list(want), row
        want = walk_output(tree, first, argmax[row], node_tokens[row])
        assert [sampled[0][row].tolist(), sampled[1][row], sampled[2][row].tolist()] == list(want), row
    assert (greedy[1] == tree.depth).any() and (greedy[1] == 0).any()


# ---------------------------------------------------------------------------------------------
# A chain is the chain verifier, bit for bit


@functools.partial(jax.jit, static_argnums=0)
def chain_and_tree(tree, keys, p, q, one_hot, from_q, from_p, valid, logits, drafts, mask):
    """{case: (the chain verifier's output, the tree verifier's)}, all in one compilation."""
    cases = {  # (key(s), q for the chain, draft_probs for the tree, drafts, valid)
        "one-hot": (keys, one_hot, None, from_p, valid),
        "sampled": (keys, q, q, from_q, valid),
        "sampled, all valid": (keys, q, q, from_q, None),
        "sampled, one key for the batch": (keys[0], q, q, from_q, valid),
    }
    out = {
        case: (rejection_sample(key, p, q_chain, x, m), tree_rejection_sample(key, tree, p, q_tree, x, m))
        for case, (key, q_chain, q_tree, x, m) in cases.items()
    }
    for case, m in [("greedy", mask), ("greedy, all valid", None)]:
        out[case] = (greedy_verify(logits, drafts, m), tree_greedy_verify(tree, logits, drafts, m))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_chain_tree_matches_the_chain_verifiers(k):
    """Same keys, same inputs: the same tokens and num_accepted, and the path 1..n."""
    b, v = 2048, 6
    rng = np.random.default_rng(200 + k)
    tree = TokenTree.chain(k)
    p = peaky(rng, (b, k + 1, v)).astype(np.float32)
    q = peaky(rng, (b, k, v)).astype(np.float32)
    q[::8] = 2 * p[::8, :k]  # more mass than p: rejections leave a zero residual (the floor branch)
    from_q, from_p = draw(rng, q), draw(rng, p[:, :k])  # sampled drafts; likely one-hot candidates
    valid = np.arange(k) < rng.integers(0, k + 1, size=b)[:, None]  # prefix masks
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    drafts = np.where(rng.uniform(size=(b, k)) < 0.7, logits.argmax(-1)[:, :k], rng.integers(v, size=(b, k)))
    mask = rng.uniform(size=(b, k)) < 0.9  # not a prefix mask
    keys = jax.random.split(jax.random.key(k), b)
    one_hot = np.eye(v, dtype=np.float32)[from_p]
    out = chain_and_tree(tree, keys, p, q, one_hot, from_q, from_p, valid, logits, drafts, mask)
    for case, (want, got) in out.items():
        (want_tokens, want_n), (tokens, n, path) = ([np.asarray(x) for x in o] for o in (want, got))
        np.testing.assert_array_equal(tokens, want_tokens, err_msg=case)
        np.testing.assert_array_equal(n, want_n, err_msg=case)
        want_path = np.where(np.arange(k) < n[:, None], np.arange(1, k + 1), -1)
        np.testing.assert_array_equal(path, want_path, err_msg=case)
        assert len(np.unique(want_n)) == k + 1, case  # every outcome occurs: the comparison has teeth


# ---------------------------------------------------------------------------------------------
# Rejection sampling on a tree: exact laws


def assert_node_laws(tree, tokens, n, path, p, accepted, final, residual) -> None:
    """The law of the last accepted node, of num_accepted, of (last node, stop token), and given
    that node c was accepted, of the token that follows it: p at c (lossless at every node)."""
    last, stop = last_node(n, path), tokens[np.arange(len(n)), n]
    assert_law(last, final, "last accepted node")
    assert_law(n, np.bincount(tree.depths, weights=final, minlength=tree.depth + 1), "num_accepted")
    joint = assert_law(last * VOCAB + stop, (final[:, None] * residual).ravel(), "(last node, stop token)")
    first = assert_law(tokens[:, 0], p[0], "first token")
    assert first.detectable_shift < 0.015 and joint.detectable_shift < 0.019  # as the docstring says
    for c in range(1, tree.num_nodes + 1):
        d = tree.depths[c]
        given = path[:, d - 1] == c
        assert_law(tokens[given, d], p[c], f"token after accepted node {c}")


@pytest.mark.parametrize(
    "tree, hole",
    [(WIDE, None), (WIDE, (1,)), (DEEP, None), (DEEP, (0, 1))],
    ids=["wide", "wide-hole", "deep", "deep-hole"],
)
def test_tree_rejection_sample_law_with_deterministic_candidates(tree, hole):
    """draft_probs=None. Each parent's candidates are distinct (the top tokens of p there, in a
    shuffled rank order), but the last child of the last fork drafts token 0, which every p
    forbids. A distinct candidate x is then accepted with probability p(x) at its parent, and the
    emitted pair (token 0, token 1) has law p_root(x) * p_c(y) when x is the token of a valid root
    child c, else the row stops at once: (x, none) with probability p_root(x)."""
    rng = np.random.default_rng(tree.num_nodes + (hole is not None))
    n_nodes = tree.num_nodes
    p = forbidding(rng, n_nodes + 1)
    row = np.zeros(n_nodes, np.int32)
    for node in range(n_nodes + 1):
        kids = tree.children[node][tree.children[node] > 0]
        row[kids - 1] = rng.permutation(np.argsort(-p[node, 1:])[: len(kids)] + 1)
    forked = max(i for i in range(n_nodes + 1) if (tree.children[i] > 0).sum() >= 2)
    row[tree.children[forked][tree.children[forked] > 0][-1] - 1] = 0  # a forbidden candidate
    valid = np.array([path != hole for path in tree.paths])
    node_tokens = np.broadcast_to(row, (ROWS, n_nodes))
    tokens, n, path = run_tree(3, tree, p, None, node_tokens, valid)
    assert_tree_layout(tree, tokens, n, path, node_tokens, valid, p)

    accepted, final, residual, _ = tree_law(tree, p, np.eye(VOCAB)[row], valid)
    reach = np.append(1.0, accepted[1:].sum(-1))
    parents = tree.parents[1:]
    np.testing.assert_allclose(reach[1:], np.where(valid, reach[parents] * p[parents, row], 0))
    assert_node_laws(tree, tokens, n, path, p, accepted, final, residual)
    joint = np.zeros((VOCAB, VOCAB + 1))
    joint[:, VOCAB] = p[0]
    root_kids = tree.children[0][tree.children[0] > 0]
    for c in root_kids[valid[root_kids - 1]]:
        joint[row[c - 1]] = np.append(p[0, row[c - 1]] * p[c], 0)
    second = np.where(n >= 1, tokens[:, 1], VOCAB)
    assert_law(tokens[:, 0] * (VOCAB + 1) + second, joint.ravel(), "(first token, second token or none)")
    assert not (tokens == 0).any()


@pytest.mark.parametrize("tree, per_parent", [(WIDE, True), (DEEP, False)], ids=["wide-iid", "deep-per-node"])
def test_tree_rejection_sample_law_with_sampled_candidates(tree, per_parent):
    """Every node's token is drawn per row from its own q (per_parent: siblings are independent
    draws from one q). q drafts token 0, which p forbids, and misses tokens p allows. Marginally
    over the drafts, the first token follows p_root exactly, and (first accepted node, first token)
    follows tree_law, whose marginal is p_root."""
    rng = np.random.default_rng(50 + tree.num_nodes)
    n_nodes = tree.num_nodes
    p = forbidding(rng, n_nodes + 1)
    q = peaky(rng, (n_nodes + 1, VOCAB))[tree.parents[1:]] if per_parent else peaky(rng, (n_nodes, VOCAB))
    q[:, 0] = 0.15
    q = normalize(normalize(q).astype(np.float32))
    node_tokens = draw(rng, np.broadcast_to(q, (ROWS, n_nodes, VOCAB)))
    tokens, n, path = run_tree(4, tree, p, q, node_tokens)
    assert_tree_layout(tree, tokens, n, path, node_tokens, None, p)

    accepted, final, residual, _ = tree_law(tree, p, q)
    assert_node_laws(tree, tokens, n, path, p, accepted, final, residual)
    first = np.where((tree.depths == 1)[:, None], accepted, 0)
    first[0] = final[0] * residual[0]  # nothing accepted: the correction at the root
    np.testing.assert_allclose(first.sum(0), p[0], atol=1e-12)  # the derivation is lossless
    first_node = np.maximum(path[:, 0], 0)
    assert_law(first_node * VOCAB + tokens[:, 0], first.ravel(), "(first accepted node, first token)")
    assert (node_tokens == 0).mean() > 0.05 and not (tokens == 0).any()


def test_tree_rejection_sample_is_lossless_with_a_context_dependent_target():
    """As with a real model: the target after a depth-1 node depends on its token x (p1[x]), and
    so does the law its children are drafted from (q1[x]). Given the first token x and that it was
    a draft (n >= 1), the second token must follow p1[x]."""
    tree, rng = WIDE, np.random.default_rng(70)
    p0, p1, p2 = forbidding(rng, 1)[0], forbidding(rng, VOCAB), forbidding(rng, VOCAB)
    q0, q1 = peaky(rng, (VOCAB,)), peaky(rng, (VOCAB, VOCAB))
    depth1 = tree.depths[1:] == 1
    parent_slot = np.maximum(tree.parents[1:] - 1, 0)
    node_tokens = np.zeros((ROWS, tree.num_nodes), np.int32)
    node_tokens[:, depth1] = draw(rng, np.broadcast_to(q0, (ROWS, depth1.sum(), VOCAB)))
    node_tokens[:, ~depth1] = draw(rng, q1[node_tokens[:, parent_slot[~depth1]]])
    p = np.where(depth1[:, None], p1[node_tokens], p2[node_tokens])
    p = np.concatenate([np.broadcast_to(p0, (ROWS, 1, VOCAB)), p], axis=1)
    q = np.where(depth1[:, None], q0, q1[node_tokens[:, parent_slot]])
    tokens, n, path = run_tree(5, tree, p, q, node_tokens)
    assert_tree_layout(tree, tokens, n, path, node_tokens, None, p)
    assert_law(tokens[:, 0], p0, "first token")
    for x in np.flatnonzero(p0):
        assert_law(tokens[(tokens[:, 0] == x) & (n >= 1), 1], p1[x], f"second token after {x}")
    assert not (tokens == 0).any()


# ---------------------------------------------------------------------------------------------
# Analytic acceptance


def test_parents_by_depth():
    """The accepted path, then each node's first child; -1 past a leaf."""
    tree = TokenTree([(0,), (1,), (0, 0), (0, 0, 0)])  # nodes 1 (0,), 2 (1,), 3 (0, 0), 4 (0, 0, 0)
    path = jnp.array([[-1, -1, -1], [1, -1, -1], [2, -1, -1], [1, 3, -1], [1, 3, 4]])
    got = parents_by_depth(tree, path, jnp.array([0, 1, 1, 2, 3]))
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 3], [0, 1, 3], [0, 2, -1], [0, 1, 3], [0, 1, 3]])
    chain = parents_by_depth(TokenTree.chain(3), jnp.array([[-1, -1, -1], [1, 2, -1]]), jnp.array([0, 2]))
    np.testing.assert_array_equal(np.asarray(chain), [[0, 1, 2], [0, 1, 2]])


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "sampled"])
def test_tree_expected_acceptance_matches_the_exact_law(sampled):
    """Row i asks about node i at every depth (row N+1: parent -1): the probability that one of its
    valid children is accepted, as tree_law gives it; candidates may repeat a token."""
    tree, rng = DEEP, np.random.default_rng(90 + sampled)
    n_nodes, depth = tree.num_nodes, tree.depth
    p = forbidding(rng, n_nodes + 1).astype(np.float32)
    q = peaky(rng, (n_nodes, VOCAB)).astype(np.float32)
    row = draw(rng, q if sampled else p[tree.parents[1:]])  # deterministic: tokens that p allows
    valid = rng.uniform(size=n_nodes) < 0.8
    row[1], valid[:2] = row[0], True  # the root's two candidates repeat one token
    _, _, _, onward = tree_law(tree, p, normalize(q) if sampled else np.eye(VOCAB)[row], valid)
    rows = n_nodes + 2
    parents = np.repeat(np.append(np.arange(n_nodes + 1), -1)[:, None], depth, axis=1)
    p_rows, q_rows, tokens, valid_rows = (np.broadcast_to(x, (rows, *x.shape)) for x in (p, q, row, valid))
    q_rows = q_rows if sampled else None
    expected, drafted = tree_expected_acceptance(
        tree, p_rows, q_rows, tokens, valid_rows, jnp.asarray(parents)
    )
    has_child = [any(c > 0 and valid[c - 1] for c in tree.children[i]) for i in range(n_nodes + 1)]
    np.testing.assert_array_equal(np.asarray(drafted), np.repeat([has_child + [False]], depth, 0).T)
    np.testing.assert_allclose(np.asarray(expected), np.repeat([list(onward) + [0]], depth, 0).T, atol=1e-5)
    # On a chain, with every draft valid, it is the chain's sum_v min(p, q).
    chain, pk, qk = TokenTree.chain(3), p[None, :4], q[None, :3]
    want = expected_acceptance(jnp.asarray(pk), jnp.asarray(qk))
    parents = parents_by_depth(chain, jnp.array([[-1, -1, -1]]), jnp.array([0]))
    got, _ = tree_expected_acceptance(
        chain, pk, qk, jnp.asarray(row[None, :3]), jnp.ones((1, 3), bool), parents
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Shape checks


def test_shape_mismatches_are_reported():
    key, t = jax.random.key(0), SMALL  # N = 5
    p, tokens = jnp.ones((2, 6, VOCAB)) / VOCAB, jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="node_tokens"):
        tree_rejection_sample(key, t, p, None, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="node_tokens"):
        tree_greedy_verify(t, p, jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="target_probs"):
        tree_rejection_sample(key, t, p[:, :5], None, tokens)
    with pytest.raises(ValueError, match="target_logits"):
        tree_greedy_verify(t, p[:1], tokens)
    with pytest.raises(ValueError, match="valid"):
        tree_greedy_verify(t, p, tokens, jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="valid"):
        tree_rejection_sample(key, t, p, None, tokens, jnp.ones((1, 5), bool))
    with pytest.raises(ValueError, match="draft_probs"):
        tree_rejection_sample(key, t, p, jnp.ones((2, 5, VOCAB + 1)), tokens)
    with pytest.raises(ValueError, match="key"):
        tree_rejection_sample(jax.random.split(key, 3), t, p, None, tokens)
