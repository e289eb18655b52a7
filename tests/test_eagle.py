"""EAGLE heads on tiny random models: the proposer's cached, block-fed drafting equals a from-scratch
reference at every step (pending hidden states, ragged acceptance, chain and tree), greedy EAGLE
decoding equals plain decoding (chain and trees, batch 1 and 4) with heads built from the target's
first layer whose drafts are accepted part of the time, and bad arguments are refused."""

import dataclasses
import functools

import by_hand
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, check_drafted_acceptance, first_layer_eagle, layered_target
from tiny import tiny_model

import specjax
from specjax.models import EagleHead, init_cache
from specjax.models.draft_vocab import draft_head_matrix, draft_logits
from specjax.models.eagle import eagle_features
from specjax.models.llama import forward_hidden
from specjax.speculate.proposers import with_k
from specjax.speculate.tree import TokenTree

TARGET = tiny_model(seed=11)
HEAD = EagleHead.init(TARGET, jax.random.key(0), scale=1.0)
# A head drafting from a 40-token subset of the vocabulary, in a shuffled order.
SUBSET = np.random.default_rng(1).permutation(TARGET.config.vocab_size)[:40]
SUBSET_HEAD = EagleHead.init(TARGET, jax.random.key(1), vocab=SUBSET, scale=1.0)
# EAGLE-1's released form: no norm before the layer's attention (its fc scaled so that the layer's
# input is far from unit RMS, where a norm would change it).
RELEASE_HEAD = dataclasses.replace(
    HEAD,
    config=dataclasses.replace(HEAD.config, input_norm=False),
    params=HEAD.params.replace(fc=3.0 * HEAD.params.fc),
)
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]
TREES = {
    "chain1": dict(k=1),
    "chain4": dict(k=4),
    "top_k": dict(tree=TokenTree.top_k((3, 2))),
    "sparse": dict(tree=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1)]),
}


# -- The drafting bookkeeping against a from-scratch reference ---------------------------------


@functools.partial(jax.jit, static_argnames="config")
def _scratch_features(head_params, config, embed, hidden, next_tokens):
    """The head over pairs (hidden[t], next_tokens[t]), t = 0..T-1, from an empty cache: [1, T, D]."""
    T = next_tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    cache = init_cache(config.layer_config, 1, T)
    features, _ = eagle_features(
        head_params, config, embed, hidden, next_tokens, positions, cache, empty_cache=True
    )
    return features


def reference_drafts(head, tree, hidden, sequence, length):
    """Every node's token for a row whose committed sequence is sequence[:length], recomputing the
    head from scratch for each path: pairs (f_p, x_{p+1}) for p < length - 1 from the target, then
    the head's own predicted features along the path."""
    return reference_tree(head, tree, hidden, sequence, length)[0]


def reference_tree(head, tree, hidden, sequence, length):
    """(every node's token, every node's path probability: the product of the head's float64
    softmax probabilities of the tokens from the root to it), as `reference_drafts`."""
    matrix = draft_head_matrix(TARGET.params, jnp.asarray(head.vocab))
    base_h = hidden[: length - 1]
    base_x = sequence[1:length]

    def features_along(extra_h, extra_x):
        h = jnp.concatenate([base_h] + extra_h)[None]
        x = jnp.asarray(np.concatenate([base_x, np.asarray(extra_x, np.int32)]), jnp.int32)[None]
        return _scratch_features(head.params, head.config, TARGET.params.embed, h, x)[0, -1]

    tokens, probs = {}, {}

    def expand(path, feature, extra_h, extra_x):
        logits = np.asarray(draft_logits(matrix, feature), np.float64)
        softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        order = np.argsort(-logits, kind="stable")
        for child in [p for p in tree.paths if len(p) == len(path) + 1 and p[:-1] == path]:
            token = int(head.vocab[order[child[-1]]])
            tokens[child] = token
            probs[child] = probs.get(path, 1.0) * softmax[order[child[-1]]]
            if any(len(p) > len(child) and p[: len(child)] == child for p in tree.paths):
                h, x = extra_h + [feature[None]], extra_x + [token]
                expand(child, features_along(h, x), h, x)

    expand((), features_along([], []), [], [])
    return [tokens[p] for p in tree.paths], [probs[p] for p in tree.paths]


def committed_rows(prompts, S=64):
    """Two rows' committed sequences (each prompt and its 30 plain greedy tokens) padded to S
    [2, S], and the target's final-normed hidden states over them [2, S, D]."""
    plain = specjax.generate(TARGET, prompts, max_new_tokens=30).tokens
    tokens = np.zeros((len(prompts), S), np.int32)
    for b, (prompt, answer) in enumerate(zip(prompts, plain, strict=True)):
        tokens[b, : len(prompt) + len(answer)] = prompt + answer
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), tokens.shape)
    cache = init_cache(TARGET.config, len(prompts), S)
    hidden, _ = forward_hidden(TARGET.params, TARGET.config, tokens, positions, cache, empty_cache=True)
    return tokens, hidden


# The fast set keeps the subset head's chain and tree (the full-vocabulary head's, 22-32 s each, run with
# `make test-all`): each shape meets the reference by default, each head in make test-all.
@pytest.mark.parametrize(
    "head, shape",
    [
        pytest.param(HEAD, "chain3", id="chain3-full_vocab", marks=pytest.mark.slow),
        pytest.param(HEAD, "tree", id="tree-full_vocab", marks=pytest.mark.slow),  # 22 s: make test-all
        pytest.param(SUBSET_HEAD, "chain3", id="chain3-subset"),
        pytest.param(SUBSET_HEAD, "tree", id="tree-subset"),
        pytest.param(RELEASE_HEAD, "chain1-accepting3", id="chain1-accepting3-no_input_norm"),
    ],
)
def test_drafts_equal_a_from_scratch_reference(head, shape):
    """Drive the proposer's init / propose / update by hand over a few steps with ragged acceptance
    (0, some, all) and compare every drafted node with the reference. A chain of 1 that accepts 3
    (a Hybrid part beside a drafter of 3) catches up on up to 3 drafts; on steps 1 and 3 it only
    `observe`s (a gated Hybrid's steps that another part drafts), and drafts after them must still
    equal the reference's."""
    if shape == "tree":
        proposer = specjax.Eagle(head, tree=TokenTree.top_k((2, 2, 1)))
    else:
        proposer = specjax.Eagle(head, k=3 if shape == "chain3" else 1)
    spec, params = proposer.spec(TARGET), proposer.params(TARGET)
    observed = ()
    if shape == "chain1-accepting3":
        spec, observed = spec.accepting(3), (1, 3)
    tree = spec.drafting_tree
    prompts = [PROMPTS[0], PROMPTS[1]]
    S = 64
    tokens, hidden = committed_rows(prompts, S)
    bucket = 12
    prompt_lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = by_hand.init(
        spec, TARGET.params, params, tokens[:, :bucket], prompt_lengths, S, hidden[:, :bucket]
    )
    lengths = prompt_lengths + 1  # the first token came from the prefill
    propose, observe = by_hand.propose_fn(spec), by_hand.observe_fn(spec)
    schedule = [(0, 2), (3, 1), (1, 0), (2, 3), (0, 0)]  # accepted drafts per row and step
    for step, accepted in enumerate(schedule):
        if step in observed:
            state = observe(TARGET.params, params, state, tokens, lengths)
        else:
            proposal, state = propose(TARGET.params, params, state, tokens, lengths, None, None, None)
        for b in range(0 if step in observed else 2):
            expected = reference_drafts(head, tree, hidden[b], np.asarray(tokens[b]), int(lengths[b]))
            assert np.asarray(proposal.draft_tokens[b]).tolist() == expected, (accepted, b)
        n = jnp.asarray(accepted, jnp.int32)
        rows = jnp.arange(2)[:, None]
        path_hidden = hidden[rows, (lengths - 1)[:, None] + jnp.arange(spec.accepts + 1)[None, :]]
        state = by_hand.update(spec, state, path_hidden, n)
        lengths = lengths + n + 1


@pytest.mark.parametrize(
    "proposer",
    [
        specjax.Eagle(HEAD, k=2),
        specjax.Eagle(RELEASE_HEAD, k=2),
        specjax.Eagle3(
            specjax.models.Eagle3Head.init(TARGET, jax.random.key(3), aux_layer_ids=(0, 1, 2), scale=1.0), k=2
        ),
    ],
    ids=["eagle", "eagle-no_input_norm", "eagle3"],
)
def test_observe_writes_what_a_catch_up_writes(proposer):
    """`observe` computes only the pending pairs' keys and values; the head's cache after it must
    hold exactly what the full catch-up (the head's layer over the pairs) writes there."""
    spec, params = proposer.spec(TARGET), proposer.params(TARGET)
    spec = spec.accepting(4)
    B, S, width = 2, 40, spec._pending_width
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, TARGET.config.vocab_size, (B, S)), jnp.int32)
    features = jnp.asarray(3.0 * rng.standard_normal((B, 12, width)), jnp.float32)  # far from unit RMS
    prompt_lengths = jnp.asarray([12, 7], jnp.int32)
    state = by_hand.init(spec, TARGET.params, params, tokens[:, :12], prompt_lengths, S, features)
    pending = jnp.asarray(3.0 * rng.standard_normal((B, 5, width)), jnp.float32)
    state = by_hand.update(spec, state, pending, jnp.asarray([4, 1], jnp.int32))  # 5 and 2 pending pairs
    lengths = prompt_lengths + jnp.asarray([6, 3], jnp.int32)
    observed = by_hand.observe(spec, TARGET.params, params, state, tokens, lengths)
    _, caught_up = spec._catch_up(TARGET.params, params, state, tokens, lengths)
    np.testing.assert_array_equal(observed.cache.lengths, caught_up.lengths)
    for b in range(B):  # keys [B*K, E, S], values [B*K, S, E]: the committed slots of row b
        n, K = int(caught_up.lengths[b]), TARGET.config.num_kv_heads
        rows = slice(b * K, (b + 1) * K)
        for got, want in zip(observed.cache.k, caught_up.k, strict=True):
            np.testing.assert_allclose(got[rows, :, :n], want[rows, :, :n], rtol=1e-5, atol=1e-5)
        for got, want in zip(observed.cache.v, caught_up.v, strict=True):
            np.testing.assert_allclose(got[rows, :n], want[rows, :n], rtol=1e-5, atol=1e-5)


# -- In the loop --------------------------------------------------------------------------------


# The loop's drafters: a target whose second layer adds small updates and EAGLE heads built from
# its first layer (tests/drafters.py), whose drafts are accepted part of the time (the reference
# tests above drive random heads, every weight in use). Seed 15 hardly repeats a token, so fresh
# heads, which draft the target's last prediction again, accept 4% at most.
LAYERED = layered_target(seed=15, late_scale=0.3)
BUILT = first_layer_eagle(LAYERED)
BUILT_SUBSET = first_layer_eagle(LAYERED, vocab=SUBSET)  # misses the tokens outside SUBSET


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(LAYERED, PROMPTS, max_new_tokens=24).tokens


# The default set runs the chains (one with the subset head) and the tree through the from-scratch
# reference above; EAGLE-3's loop tests run the same tree shapes by default; `make test-all` the grid.
FAST = {("chain1", "subset"), ("chain4", "full_vocab")}
GREEDY_GRID = [
    pytest.param(shape, head, marks=() if (shape, name) in FAST else pytest.mark.slow, id=f"{shape}-{name}")
    for shape in TREES
    for name, head in (("full_vocab", BUILT), ("subset", BUILT_SUBSET))
]


@pytest.mark.parametrize("shape, head", GREEDY_GRID)
def test_eagle_greedy_equals_plain(plain_greedy, shape, head):
    proposer = specjax.Eagle(head, **TREES[shape])
    result = specjax.generate(LAYERED, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    one = specjax.generate(LAYERED, PROMPTS[2:3], proposer=proposer, max_new_tokens=24)
    assert one.tokens == plain_greedy[2:3]
    m = result.metrics
    assert (m.accept_hist.sum(1) == m.steps).all()
    assert (m.accepted_at.sum(1) == m.accepted).all()
    check_acceptance(m, 0.08, 0.9)  # 0.13 (a chain of 4 from the subset) to 0.76 over the grid here


# -- A confidence threshold: a chain verifies only its confident prefix -------------------------


def test_a_threshold_keeps_the_drafts_whose_path_probability_reaches_it():
    """Driven by hand over ragged steps: draft j of a chain is valid exactly where the product of the
    head's probabilities of drafts 1..j (the reference's float64 softmax) is at least the threshold,
    and the tokens are the unthresholded chain's."""
    threshold = 0.0075  # between the second drafts' path probabilities on these rows (0.004-0.03)
    spec = specjax.Eagle(HEAD, k=3, confidence_threshold=threshold).spec(TARGET)
    params = specjax.Eagle(HEAD, k=3).params(TARGET)
    assert spec.capabilities.verify_widths == (1, 2, 3) and not spec.capabilities.always_drafts
    prompts = [PROMPTS[0], PROMPTS[1]]
    S = 64
    tokens, hidden = committed_rows(prompts, S)
    prompt_lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = by_hand.init(spec, TARGET.params, params, tokens[:, :12], prompt_lengths, S, hidden[:, :12])
    lengths = prompt_lengths + 1
    propose = by_hand.propose_fn(spec)
    seen = set()
    for accepted in [(0, 2), (3, 1), (1, 0), (2, 3), (0, 0), (1, 1)]:
        proposal, state = propose(TARGET.params, params, state, tokens, lengths, None, None, None)
        for b in range(2):
            drafts, path_probs = reference_tree(
                HEAD, spec.drafting_tree, hidden[b], np.asarray(tokens[b]), int(lengths[b])
            )
            assert np.asarray(proposal.draft_tokens[b]).tolist() == drafts
            assert min(abs(np.log(path_probs) - np.log(threshold))) > 1e-3  # no float32 near-tie
            want = [prob >= threshold for prob in path_probs]
            assert np.asarray(proposal.valid[b]).tolist() == want
            seen.add(sum(want))
        n = jnp.asarray(accepted, jnp.int32)
        path_hidden = hidden[jnp.arange(2)[:, None], (lengths - 1)[:, None] + jnp.arange(4)[None, :]]
        state = by_hand.update(spec, state, path_hidden, n)
        lengths = lengths + n + 1
    assert seen == {1, 2}  # both lengths of confident prefix occurred


@pytest.mark.parametrize("threshold", [pytest.param(0.0075, marks=pytest.mark.slow), 0.1])
def test_a_thresholded_chain_equals_plain(plain_greedy, threshold):
    """Greedy output is plain decoding's at batch 4 and 1; a step drafts only its confident prefix,
    so fewer drafts are verified than k per step (at 0.1 some steps draft nothing and make a
    one-token pass), every count adds up, and the drafts verified are accepted part of the time
    (0.64 and 0.92 of them here)."""
    proposer = specjax.Eagle(BUILT, k=3, confidence_threshold=threshold)
    result = specjax.generate(LAYERED, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    one = specjax.generate(LAYERED, PROMPTS[2:3], proposer=proposer, max_new_tokens=24)
    assert one.tokens == plain_greedy[2:3]
    m = result.metrics
    assert (m.drafted < 3 * m.steps).all() and m.drafted.sum() > 0
    assert (m.drafting_steps < m.steps).any() == (threshold == 0.1)
    assert (m.accept_hist.sum(1) == m.drafting_steps).all() and (m.accepted_at.sum(1) == m.accepted).all()
    assert (m.accepted <= m.drafted).all()
    check_drafted_acceptance(m, 0.2, 0.95)


def test_a_threshold_nothing_reaches_is_plain_decoding(plain_greedy):
    proposer = specjax.Eagle(BUILT, k=2, confidence_threshold=0.99)
    result = specjax.generate(LAYERED, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    assert int(result.metrics.drafted.sum()) == 0 and int(result.metrics.drafting_steps.sum()) == 0


def test_bad_confidence_thresholds():
    for bad in (-0.1, 1.0, 1.5, "0.3", True, float("nan")):
        with pytest.raises(ValueError, match=r"Eagle confidence_threshold must be a number in \[0, 1\), got"):
            specjax.Eagle(HEAD, k=2, confidence_threshold=bad)
    with pytest.raises(ValueError, match="applies to chains, not to a tree"):
        specjax.Eagle(HEAD, tree=TokenTree.top_k((2, 2)), confidence_threshold=0.2)
    chain = specjax.Eagle(HEAD, tree=TokenTree.chain(2), confidence_threshold=0.2)  # a chain tree is a chain
    assert (chain.k, chain.tree) == (2, None)
    kept = with_k(specjax.Eagle(HEAD, k=4, confidence_threshold=0.2), 2)
    assert (kept.k, kept.confidence_threshold) == (2, 0.2)


def test_a_chain_tree_is_the_chain():
    assert specjax.Eagle(HEAD, tree=TokenTree.chain(3)).tree is None
    assert specjax.Eagle(HEAD, tree=TokenTree.chain(3)).k == 3
    assert specjax.Eagle(HEAD).k == 4


def test_bad_eagle_arguments():
    with pytest.raises(ValueError, match="Eagle head must be"):
        specjax.Eagle("head")
    with pytest.raises(ValueError, match="Eagle k must be an integer in 1..16, got 0"):
        specjax.Eagle(HEAD, k=0)
    with pytest.raises(ValueError, match="disagrees with the tree's depth 2"):
        specjax.Eagle(HEAD, k=3, tree=TokenTree.top_k((2, 2)))
    with pytest.raises(ValueError, match="needs its parent"):
        specjax.Eagle(HEAD, tree=[(0,), (1, 0)])
    other = tiny_model(seed=12)
    with pytest.raises(ValueError, match="EAGLE head was trained for target"):
        specjax.generate(other, PROMPTS[:1], proposer=specjax.Eagle(HEAD), max_new_tokens=2)
    smaller = tiny_model(seed=11, hidden_size=32)
    with pytest.raises(ValueError, match="EAGLE head has hidden size 64"):
        specjax.generate(smaller, PROMPTS[:1], proposer=specjax.Eagle(HEAD), max_new_tokens=2)
    with pytest.raises(ValueError, match="must not repeat a token id"):
        EagleHead.init(TARGET, jax.random.key(0), vocab=[1, 2, 2])
    with pytest.raises(ValueError, match=r"token ids in \[0, 97\)"):
        EagleHead.init(TARGET, jax.random.key(0), vocab=[1, 97])
