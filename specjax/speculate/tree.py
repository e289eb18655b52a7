"""Token trees: static draft topologies, and their verification.

A tree drafts several alternatives per position and the target scores every node in one forward
pass. The topology is static (hashable, part of the compiled program); only the tokens at its
nodes change from step to step.

Nodes are numbered in the order the target is fed: node 0 is the root (the last committed
token, which every step feeds anyway), then the drafted nodes 1..N sorted by depth, each after
its parent. A node is named by its *path*: the ranks of the candidates chosen at each depth, as
in Medusa's choice lists. `(0,)` is the best candidate for the first draft position, `(1,)` the
second best, `(0, 2)` the third-best continuation of `(0,)`. A chain of k tokens is the tree
`(0,), (0, 0), ..., (0,) * k`.

What the loop needs from a tree, all numpy and computed once:
- `attention_mask [N+1, N+1]`: node i attends to node j iff j is i or an ancestor of i (the
  `fresh_mask` of the forward);
- `depths [N+1]`: position offsets (node i sits at position `last + depth[i]`);
- `children [N+1, C]`: each node's children by rank, padded with -1;
- `path_nodes [N+1, D]`: the nodes on the path to i at depths 1..D, padded with -1.

Verification (pure jax.numpy, no model code) returns what the chain verifiers return, plus the
accepted path's node indices, so the caller can move those nodes' KV entries into place:
- `tree_greedy_verify` (temperature 0): follow the child whose token is the target's argmax.
- `tree_rejection_sample` (lossless at any temperature): recursive rejection sampling over
  siblings (SpecInfer, Miao et al. 2024; EAGLE): at the current node, try its children in rank
  order, accepting child x drawn from q with probability min(1, r(x) / q(x)) where r starts as
  the target's p at the node and becomes normalize(max(r - q, 0)) after each rejection; when
  every child is rejected, draw the correction from the last r. The emitted tokens follow p
  exactly when the siblings are independent draws from their q, or deterministic candidates
  (q one-hot on the token, which Medusa and EAGLE's top-k trees use: then a rejection just
  removes the candidate from r).

Einsum letters: B batch, N drafted nodes, C children per node, D depth, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int
from specjax.speculate.sampling import greedy_argmax
from specjax.speculate.verify import keys_per_row, residual_floor

# Draft positions (k, a chain's length or a tree's depth): more buys nothing measurable and bloats
# the verify pass.
MAX_SPECULATIVE_TOKENS = 16
MAX_TREE_NODES = 128  # drafted nodes; a verify pass over more costs more than it can win back


def _check_paths(paths) -> tuple[tuple[int, ...], ...]:
    try:
        paths = tuple(tuple(path) for path in paths)
    except TypeError:
        raise ValueError(f"tree paths must be a sequence of sequences of ranks, got {paths!r}") from None
    if not paths:
        raise ValueError("tree paths must hold at least one path, got none")
    for path in paths:
        ok = len(path) >= 1 and all(is_int(r) and r >= 0 for r in path)
        if not ok:
            raise ValueError(f"tree paths: each path must be a non-empty tuple of ranks >= 0, got {path!r}")
    paths = tuple(tuple(int(r) for r in path) for path in paths)  # numpy integers welcome
    if len(set(paths)) != len(paths):
        raise ValueError("tree paths: a path appears more than once")
    known = set(paths)
    for path in paths:
        if len(path) > 1 and path[:-1] not in known:
            raise ValueError(f"tree paths: {path!r} needs its parent {path[:-1]!r} in the list too")
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"tree paths: at most {MAX_TREE_NODES} nodes, got {len(paths)}")
    depth = max(len(p) for p in paths)
    if depth > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"tree paths: depth at most {MAX_SPECULATIVE_TOKENS}, got {depth}")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """A static draft tree, given by the paths of its nodes (see the module docstring)."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "paths", _check_paths(self.paths))

    @classmethod
    def chain(cls, k: int) -> TokenTree:
        """The one-branch tree: k tokens in a row."""
        return cls(tuple((0,) * d for d in range(1, k + 1)))

    @classmethod
    def top_k(cls, widths) -> TokenTree:
        """The full tree with widths[d] candidates per node at depth d + 1, e.g. (3, 2): the 3 best
        first tokens, each with its 2 best continuations (3 + 6 nodes)."""
        widths = tuple(widths)
        if not widths or not all(is_int(w) and w >= 1 for w in widths):
            raise ValueError(f"tree widths must be a non-empty sequence of integers >= 1, got {widths!r}")
        level, paths = [()], []
        for width in widths:
            level = [p + (r,) for p in level for r in range(width)]
            paths += level
        return cls(tuple(paths))

    # Derived tables. Node 0 is the root; drafted node i (1..N) has path paths[i - 1].

    @property
    def num_nodes(self) -> int:
        """N: drafted nodes (the root is not counted)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        """D: the longest path, i.e. the most tokens one step can accept."""
        return max(len(p) for p in self.paths)

    @property
    def is_chain(self) -> bool:
        return self.paths == TokenTree.chain(self.depth).paths

    @functools.cached_property
    def _index(self) -> dict[tuple[int, ...], int]:
        return {(): 0} | {path: i + 1 for i, path in enumerate(self.paths)}

    @functools.cached_property
    def parents(self) -> np.ndarray:
        """[N+1] int32: each node's parent, -1 for the root."""
        return np.array([-1] + [self._index[p[:-1]] for p in self.paths], np.int32)

    @functools.cached_property
    def depths(self) -> np.ndarray:
        """[N+1] int32: 0 for the root, the path length for the others."""
        return np.array([0] + [len(p) for p in self.paths], np.int32)

    @functools.cached_property
    def ranks(self) -> np.ndarray:
        """[N+1] int32: a node's candidate rank among its siblings' (the path's last entry)."""
        return np.array([0] + [p[-1] for p in self.paths], np.int32)

    @functools.cached_property
    def path_nodes(self) -> np.ndarray:
        """[N+1, D] int32: the nodes on the path from the root to node i at depths 1..D, -1 past i."""
        table = np.full((self.num_nodes + 1, self.depth), -1, np.int32)
        for path, i in self._index.items():
            for d in range(len(path)):
                table[i, d] = self._index[path[: d + 1]]
        return table

    @functools.cached_property
    def attention_mask(self) -> np.ndarray:
        """[N+1, N+1] bool: node i sees node j iff j is the root, i itself or an ancestor of i."""
        mask = np.zeros((self.num_nodes + 1, self.num_nodes + 1), bool)
        mask[:, 0] = True
        for i in range(self.num_nodes + 1):
            mask[i, i] = True
            ancestors = self.path_nodes[i]
            mask[i, ancestors[ancestors >= 0]] = True
        return mask

    @functools.cached_property
    def children(self) -> np.ndarray:
        """[N+1, C] int32: each node's children in rank order, padded with -1 (C >= 1)."""
        lists = [[] for _ in range(self.num_nodes + 1)]
        for i in np.argsort(self.ranks, kind="stable"):
            if i > 0:
                lists[self.parents[i]].append(int(i))
        width = max(1, max(len(c) for c in lists))
        return np.array([c + [-1] * (width - len(c)) for c in lists], np.int32)

    @functools.cached_property
    def widths(self) -> tuple[int, ...]:
        """Candidates needed per depth: 1 + the largest rank used at depth d + 1."""
        return tuple(1 + max(p[d] for p in self.paths if len(p) > d) for d in range(self.depth))

    @functools.cached_property
    def first_ranked_path(self) -> np.ndarray:
        """[D0] int32: the nodes reached by taking the rank-0 child from the root while there is
        one (synthetic acceptance forces this path)."""
        path, node = [], 0
        while self.children[node, 0] >= 0 and self.ranks[self.children[node, 0]] == 0:
            node = int(self.children[node, 0])
            path.append(node)
        return np.array(path, np.int32)

    def __repr__(self) -> str:
        return f"TokenTree(num_nodes={self.num_nodes}, depth={self.depth})"


# ---------------------------------------------------------------------------------------------
# Verification


def _check_tree_shapes(tree: TokenTree, target: jax.Array, node_tokens: jax.Array, valid, what: str):
    N = tree.num_nodes
    if node_tokens.ndim != 2 or node_tokens.shape[1] != N:
        raise ValueError(f"node_tokens must be [B, N] = [B, {N}], got shape {node_tokens.shape}")
    B = node_tokens.shape[0]
    if target.ndim != 3 or target.shape[:2] != (B, N + 1):
        raise ValueError(f"{what} must be [B, N+1, V] = [{B}, {N + 1}, V], got shape {target.shape}")
    if valid is not None and valid.shape != (B, N):
        raise ValueError(f"valid must be [B, N] = [{B}, {N}], got shape {valid.shape}")


def _with_root(x: jax.Array, root_value) -> jax.Array:
    """[B, N, ...] -> [B, N+1, ...] with root_value in front, so that node i indexes x[:, i]."""
    root = jnp.full((x.shape[0], 1, *x.shape[2:]), root_value, x.dtype)
    return jnp.concatenate([root, x], axis=1)


def _finish(tree: TokenTree, node_tokens: jax.Array, final_node: jax.Array, stop_token: jax.Array):
    """From each row's last accepted node [B] and its stop token [B]: (tokens [B, D+1], num_accepted
    [B], path [B, D]) with tokens laid out as the chain verifiers do (see verify.py)."""
    B, D = node_tokens.shape[0], tree.depth
    rows = jnp.arange(B)[:, None]
    path = jnp.asarray(tree.path_nodes)[final_node]  # [B, D]
    num_accepted = jnp.asarray(tree.depths)[final_node]  # [B]
    tokens_on_path = _with_root(node_tokens, 0)[rows, jnp.maximum(path, 0)]  # [B, D]
    position = jnp.arange(D + 1)[None, :]
    prefix = jnp.concatenate([tokens_on_path, jnp.zeros((B, 1), node_tokens.dtype)], axis=1)
    n = num_accepted[:, None]
    tokens = jnp.where(position < n, prefix, jnp.where(position == n, stop_token[:, None], -1))
    return tokens.astype(jnp.int32), num_accepted.astype(jnp.int32), path


def tree_greedy_verify(tree: TokenTree, target_logits: jax.Array, node_tokens: jax.Array, valid=None):
    """Temperature 0 on a tree: from the root, move to the child whose token is the target's
    argmax at the current node, while there is one.

    Args:
      tree: the static topology.
      target_logits: [B, N+1, V]; entry i scores the token that follows node i.
      node_tokens: [B, N] int, the token of drafted node i + 1.
      valid: [B, N] bool, or None for all valid; an invalid node is never accepted.

    Returns:
      tokens [B, D+1] int32 (accepted path, then the target's token, then -1), num_accepted [B]
      int32 and path [B, D] int32 (the accepted nodes by depth, -1 past num_accepted).
    """
    _check_tree_shapes(tree, target_logits, node_tokens, valid, "target_logits")
    B, N = node_tokens.shape
    valid = jnp.ones((B, N), bool) if valid is None else valid.astype(bool)
    target_next = greedy_argmax(target_logits)  # [B, N+1]
    parents = jnp.asarray(tree.parents[1:])
    # A node matches when it is valid and its token is the argmax at its parent; it is on an
    # accepted path when it and all its ancestors match.
    matches = _with_root(valid & (node_tokens == target_next[:, parents]), True)  # [B, N+1]
    ancestors = jnp.asarray(tree.attention_mask)  # [N+1, N+1]: j is i or an ancestor of i
    on_path = jnp.all(matches[:, None, :] | ~ancestors[None], axis=-1)  # [B, N+1]
    # The deepest matching node; argmax picks the first among equals (siblings with one token).
    score = jnp.where(on_path, jnp.asarray(tree.depths)[None, :], -1)
    final_node = jnp.argmax(score, axis=1)
    stop_token = target_next[jnp.arange(B), final_node]
    return _finish(tree, node_tokens, final_node, stop_token)


def tree_rejection_sample(
    key: jax.Array,
    tree: TokenTree,
    target_probs: jax.Array,
    draft_probs: jax.Array | None,
    node_tokens: jax.Array,
    valid: jax.Array | None = None,
):
    """Lossless verification of a token tree by recursive rejection sampling over siblings.

    Args:
      key: a PRNG key, or one per row ([B]), consumed as `rejection_sample` consumes it, so a
        chain tree gives the chain verifier's tokens bit for bit.
      tree: the static topology.
      target_probs: [B, N+1, V] the target's warped distribution after each node (root first).
      draft_probs: [B, N, V] the distribution each node's token was drawn from, or None for
        deterministic candidates (one-hot q).
      node_tokens: [B, N] int.
      valid: [B, N] bool, or None for all valid; an invalid node is skipped.

    Returns:
      (tokens [B, D+1], num_accepted [B], path [B, D]) as in `tree_greedy_verify`.
    """
    _check_tree_shapes(tree, target_probs, node_tokens, valid, "target_probs")
    B, N = node_tokens.shape
    V = target_probs.shape[2]
    if draft_probs is not None and draft_probs.shape != (B, N, V):
        raise ValueError(f"draft_probs must be [B, N, V] = {(B, N, V)}, got shape {draft_probs.shape}")
    dtype = jnp.promote_types(target_probs.dtype, jnp.float32)
    p = target_probs.astype(dtype)
    node_tokens = node_tokens.astype(jnp.int32)
    valid = jnp.ones((B, N), bool) if valid is None else valid.astype(bool)
    # Keys are used as rejection_sample uses them, so a chain gives its tokens bit for bit.
    keys = jax.vmap(jax.random.split)(keys_per_row(key, B))
    accept_keys, stop_keys = keys[:, 0], keys[:, 1]
    u = jax.vmap(lambda k: jax.random.uniform(k, (N,), dtype))(accept_keys)  # [B, N]: one per node
    rows = jnp.arange(B)
    children = jnp.asarray(tree.children)  # [N+1, C]
    floor = residual_floor(dtype)

    def q_of(node):  # [B] node index (>= 1) -> [B, V], the distribution its token was drawn from
        if draft_probs is None:
            return jax.nn.one_hot(node_tokens[rows, node - 1], V, dtype=dtype)
        return draft_probs[rows, node - 1].astype(dtype)

    current = jnp.zeros((B,), jnp.int32)  # the last accepted node
    stopped = jnp.zeros((B,), bool)
    stop_probs = p[:, 0]  # what a stopped row draws its token from (unnormalised is fine)
    for _ in range(tree.depth):
        r = p[rows, current]  # r at the current node, normalised; it shrinks as siblings fail
        r_left = r  # the same before normalising: drawn from when the row stops here
        moved = jnp.zeros((B,), bool)
        for c in range(children.shape[1]):
            child = children[current, c]  # [B], -1 where the node has fewer children
            index = jnp.maximum(child, 1)
            tried = ~stopped & ~moved & (child > 0) & valid[rows, index - 1]
            token = node_tokens[rows, index - 1]
            q = q_of(index)
            # Accept iff u * q(x) < r(x): probability min(1, r / q) with no division (verify.py).
            accept = tried & (u[rows, index - 1] * q[rows, token] < r[rows, token])
            left = jnp.maximum(r - q, 0)
            total = jnp.sum(left, axis=-1, keepdims=True)
            # As in rejection_sample: a residual of a few ulps is rounding noise, keep r instead.
            update = (tried & ~accept)[:, None] & (total > floor)
            r_left = jnp.where(update, left, r_left)
            r = jnp.where(update, left / jnp.where(update, total, 1), r)
            current = jnp.where(accept, index, current)
            moved |= accept
        stop_here = ~stopped & ~moved  # every child failed, or the node has none
        stop_probs = jnp.where(stop_here[:, None], r_left, stop_probs)
        stopped |= stop_here
    # Rows that accepted down to depth D draw the bonus token from p at their last node.
    stop_probs = jnp.where(stopped[:, None], stop_probs, p[rows, current])
    # Gumbel-max over log-probabilities, as rejection_sample draws: zero mass is never drawn.
    stop_token = jax.vmap(jax.random.categorical)(stop_keys, jnp.log(stop_probs))
    return _finish(tree, node_tokens, current, stop_token)


def parents_by_depth(tree: TokenTree, path: jax.Array, num_accepted: jax.Array) -> jax.Array:
    """[B, D] int32: the node whose children were (or would have been) tried at each depth: the
    accepted path, continued past num_accepted by each node's first-ranked child (-1 where the
    tree ends). On a chain it is the chain itself, so per-depth metrics read as the chain's."""
    children = jnp.asarray(tree.children)
    node = jnp.zeros(path.shape[:1], jnp.int32)  # the root
    parents = []
    for d in range(tree.depth):
        parents.append(node)
        below = jnp.where(node >= 0, children[jnp.maximum(node, 0), 0], -1)
        node = jnp.where(d < num_accepted, path[:, d], below)
    return jnp.stack(parents, axis=1)


def tree_expected_acceptance(
    tree: TokenTree,
    target_probs: jax.Array,
    draft_probs: jax.Array | None,
    node_tokens: jax.Array,
    valid: jax.Array,
    parents: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The analytic acceptance probability at each depth, the tree's `sum_v min(p, q)`.

    At a node whose valid children are tried in rank order, child j is accepted with probability
    a_j = sum_v min(r_{j-1}, q_j) given the earlier ones were rejected (r_0 = p, then the
    normalised residuals, which do not depend on the drawn tokens), so one of them is accepted
    with probability 1 - prod_j (1 - a_j). With one child that is sum_v min(p, q); with distinct
    deterministic candidates it is the target's mass on them.

    Args: as `tree_rejection_sample`, plus parents [B, D] from `parents_by_depth`.
    Returns: (expected [B, D] float32, drafted [B, D] bool: the depth had a valid child to try).
    """
    B, N = node_tokens.shape
    V = target_probs.shape[2]
    rows = jnp.arange(B)
    children = jnp.asarray(tree.children)
    floor = residual_floor(jnp.float32)
    expected, drafted = [], []
    for d in range(tree.depth):
        parent = parents[:, d]
        r = target_probs[rows, jnp.maximum(parent, 0)].astype(jnp.float32)
        none_accepted = jnp.ones((B,), jnp.float32)
        any_child = jnp.zeros((B,), bool)
        for c in range(children.shape[1]):
            child = jnp.where(parent >= 0, children[jnp.maximum(parent, 0), c], -1)
            index = jnp.maximum(child, 1)
            tried = (child > 0) & valid[rows, index - 1]
            if draft_probs is None:
                q = jax.nn.one_hot(node_tokens[rows, index - 1], V, dtype=jnp.float32)
            else:
                q = draft_probs[rows, index - 1].astype(jnp.float32)
            accept = jnp.where(tried, jnp.sum(jnp.minimum(r, q), axis=-1), 0.0)
            none_accepted = none_accepted * (1 - accept)
            left = jnp.maximum(r - q, 0)
            total = jnp.sum(left, axis=-1, keepdims=True)
            r = jnp.where(tried[:, None] & (total > floor), left / jnp.maximum(total, floor), r)
            any_child |= tried
        expected.append(jnp.where(any_child, 1 - none_accepted, 0.0))
        drafted.append(any_child)
    return jnp.stack(expected, axis=1), jnp.stack(drafted, axis=1)
