"""EAGLE-3 in the compiled loop, on tiny random models: the target's score pass captures the
streams the head fuses (checked against transformers' hidden states), the proposer's cached,
block-fed drafting equals a from-scratch recomputation at every step (ragged acceptance, chain
and tree, full and subset draft vocabularies), and greedy EAGLE-3 decoding equals plain decoding
(chains and trees, batch 1 and 4, a Gemma 3 target with its interleaved windows too), with heads
built from the target's first layer whose drafts are accepted part of the time."""

from __future__ import annotations

import dataclasses
import functools

import by_hand
import families
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from drafters import (
    check_acceptance,
    check_drafted_acceptance,
    check_part_acceptance,
    first_layer_eagle3,
    quiet_target,
)
from tiny import tiny_model

import specjax
from specjax.models import Eagle3Head, init_cache
from specjax.models.eagle3 import eagle3_features, eagle3_logits, fuse_features
from specjax.models.llama import forward_hidden
from specjax.speculate.tree import TokenTree

# A target with quiet embeddings and small later layers (tests/drafters.py): an EAGLE-3 head built
# from its first layer drafts it part of the time. The reference tests drive random heads (every
# weight in use); the loop's, heads built from the target.
TARGET = quiet_target(seed=11, num_layers=4)
AUX = (1, 2, 4)  # entering layers 1 and 2, and the last layer's output
HEAD = Eagle3Head.init(TARGET, jax.random.key(0), aux_layer_ids=AUX, scale=1.0)
SUBSET = np.random.default_rng(1).permutation(TARGET.config.vocab_size)[:40]
SUBSET_HEAD = Eagle3Head.init(TARGET, jax.random.key(1), vocab=SUBSET, aux_layer_ids=AUX, scale=1.0)
BUILT = first_layer_eagle3(TARGET, AUX)
BUILT_SUBSET = first_layer_eagle3(TARGET, AUX, vocab=SUBSET)  # misses the tokens outside SUBSET
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]


def test_captured_streams_are_transformers_hidden_states(tmp_path):
    """Layer id i is the stream entering layer i: transformers' hidden_states[i] (i < L)."""
    torch_model = families.save_folder("qwen3", tmp_path)
    model = specjax.load(tmp_path)
    ids = families.prompts(lengths=(20,))[0]
    T = len(ids)
    cache = init_cache(model.config, 1, T)
    _, _, captured = forward_hidden(
        model.params,
        model.config,
        jnp.asarray([ids]),
        jnp.arange(T)[None],
        cache,
        empty_cache=True,
        capture=(2, 0, 1),
    )
    with torch.no_grad():
        hf = torch_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = np.concatenate([hf[i][0].numpy() for i in (2, 0, 1)], axis=-1)
    np.testing.assert_allclose(np.asarray(captured[0]), want, rtol=1e-4, atol=1e-4)


# -- The drafting bookkeeping against a from-scratch reference ---------------------------------


@functools.partial(jax.jit, static_argnames="config")
def _scratch_outputs(head_params, config, embed, fused, next_tokens):
    """The head over pairs (fused[t], next_tokens[t]) from an empty cache: [1, T, D]."""
    T = next_tokens.shape[1]
    cache = init_cache(config.layer_config, 1, T)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    out, _ = eagle3_features(
        head_params, config, embed, fused, next_tokens, positions, cache, empty_cache=True
    )
    return out


def reference_drafts(head, tree, aux, sequence, length):
    """Every node's token for a row whose committed sequence is sequence[:length]: the head run
    from scratch for each path, over pairs (fc(aux_p), x_{p+1}), p < length - 1, then its own
    outputs along the path."""
    c, p = head.config, head.params
    base_h = fuse_features(p, c, aux[: length - 1])
    base_x = sequence[1:length]

    def output_along(extra_h, extra_x):
        h = jnp.concatenate([base_h] + extra_h)[None]
        x = jnp.asarray(np.concatenate([base_x, np.asarray(extra_x, np.int32)]), jnp.int32)[None]
        return _scratch_outputs(p, c, TARGET.params.embed, h, x)[0, -1]

    tokens = {}

    def expand(path, output, extra_h, extra_x):
        order = np.argsort(-np.asarray(eagle3_logits(p, c, output)), kind="stable")
        for child in [q for q in tree.paths if len(q) == len(path) + 1 and q[:-1] == path]:
            token = int(head.vocab[order[child[-1]]])
            tokens[child] = token
            if any(len(q) > len(child) and q[: len(child)] == child for q in tree.paths):
                h, x = extra_h + [output[None]], extra_x + [token]
                expand(child, output_along(h, x), h, x)

    expand((), output_along([], []), [], [])
    return [tokens[q] for q in tree.paths]


@pytest.mark.parametrize(
    "head, shape, observed",
    [
        pytest.param(
            HEAD, "tree", (), marks=pytest.mark.slow
        ),  # (26 s) the subset head's cases run by default
        (SUBSET_HEAD, "chain3", ()),
        (SUBSET_HEAD, "chain3", (1, 2)),
        (HEAD, "chain1-accepting3", ()),
        (SUBSET_HEAD, "chain1-accepting3", (0, 2)),
    ],
    ids=["tree-full_vocab", "chain3-subset", "chain3-observing", "chain1-accepting3", "chain1-observing"],
)
def test_drafts_equal_a_from_scratch_reference(head, shape, observed):
    """init / propose / update driven by hand over steps with ragged acceptance (0, some, all).
    On the `observed` steps the head only catches up (`observe`, a gated Hybrid's step that
    another part drafts): its later drafts must still equal the reference's. A chain of 1 that
    accepts 3 (a Hybrid part beside a drafter of 3) catches up on up to 3 accepted drafts."""
    if shape == "tree":
        proposer = specjax.Eagle3(head, tree=TokenTree.top_k((2, 2, 1)))
    else:
        proposer = specjax.Eagle3(head, k=3 if shape == "chain3" else 1)
    spec, params = proposer.spec(TARGET), proposer.params(TARGET)
    if shape == "chain1-accepting3":
        spec = spec.accepting(3)
        assert (spec.k, spec.accepts) == (1, 3)
    assert spec.capabilities.feature_layers == AUX
    tree = spec.drafting_tree
    prompts = [PROMPTS[0], PROMPTS[1]]
    plain = specjax.generate(TARGET, prompts, max_new_tokens=30).tokens
    S = 64
    tokens = np.zeros((2, S), np.int32)
    for b, (p, t) in enumerate(zip(prompts, plain, strict=True)):
        tokens[b, : len(p) + len(t)] = p + t
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (2, S))
    _, _, aux = forward_hidden(
        TARGET.params,
        TARGET.config,
        tokens,
        positions,
        init_cache(TARGET.config, 2, S),
        empty_cache=True,
        capture=AUX,
    )
    bucket = 12
    prompt_lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    state = by_hand.init(spec, TARGET.params, params, tokens[:, :bucket], prompt_lengths, S, aux[:, :bucket])
    lengths = prompt_lengths + 1
    propose, observe = by_hand.propose_fn(spec), by_hand.observe_fn(spec)
    for step, accepted in enumerate([(0, 2), (3, 1), (1, 0), (2, 3)]):
        if step in observed:  # a gated Hybrid's step without this head's drafts: only catch up
            state = observe(TARGET.params, params, state, tokens, lengths)
        else:
            proposal, state = propose(TARGET.params, params, state, tokens, lengths, None, None, None)
        for b in range(0 if step in observed else 2):
            expected = reference_drafts(head, tree, aux[b], np.asarray(tokens[b]), int(lengths[b]))
            assert np.asarray(proposal.draft_tokens[b]).tolist() == expected, (accepted, b)
        n = jnp.asarray(accepted, jnp.int32)
        path = aux[jnp.arange(2)[:, None], (lengths - 1)[:, None] + jnp.arange(spec.accepts + 1)[None, :]]
        state = by_hand.update(spec, state, path, n)
        lengths = lengths + n + 1


# -- In the loop --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


# The band each case's accepted fraction lies in (check_acceptance): 0.26, 0.23 and 0.44 here.
@pytest.mark.parametrize(
    "head, options, band",
    [
        (BUILT, {"k": 4}, (0.1, 0.9)),
        (BUILT_SUBSET, {"tree": TokenTree.top_k((3, 2))}, (0.1, 0.9)),
        (BUILT, {"tree": [(0,), (1,), (0, 0), (0, 0, 0)]}, (0.15, 0.9)),
    ],
    ids=["chain4-full", "top_k-subset", "sparse-full"],
)
def test_eagle3_greedy_equals_plain(plain_greedy, head, options, band):
    proposer = specjax.Eagle3(head, **options)
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=24)
    assert result.tokens == plain_greedy
    one = specjax.generate(TARGET, PROMPTS[2:3], proposer=proposer, max_new_tokens=24)
    assert one.tokens == plain_greedy[2:3]
    m = result.metrics
    assert (m.accept_hist.sum(1) == m.steps).all() and (m.accepted_at.sum(1) == m.accepted).all()
    check_acceptance(m, *band)


@pytest.mark.slow  # (40 s) Eagle's thresholded chain is in the default set (tests/test_eagle.py)
def test_a_thresholded_eagle3_chain_and_its_hybrid_equal_plain(plain_greedy):
    """EAGLE-3 drafts through EAGLE's code, threshold included (its reference test is in
    test_eagle.py): greedy equals plain with some steps drafting nothing; as a Hybrid's second part,
    its shorter widths join the n-gram part's k."""
    head = specjax.Eagle3(BUILT, k=3, confidence_threshold=0.05)
    result = specjax.generate(TARGET, PROMPTS, proposer=head, max_new_tokens=24)
    assert result.tokens == plain_greedy
    m = result.metrics
    assert 0 < m.drafting_steps.sum() < m.steps.sum() and (m.drafted < 3 * m.drafting_steps).any()
    check_drafted_acceptance(m, 0.2, 0.9)  # 0.52 here
    hybrid = specjax.Hybrid(specjax.NGram(k=4, n_min=2), dataclasses.replace(head, k=2))
    assert hybrid.spec(TARGET).capabilities.verify_widths == (1, 2, 4)
    result = specjax.generate(TARGET, PROMPTS, proposer=hybrid, max_new_tokens=24)
    assert result.tokens == plain_greedy
    counts = result.metrics.proposer
    assert counts["first_steps"].sum() > 0 and counts["then_steps"].sum() > 0
    check_part_acceptance(result.metrics, "then", 0.1, 0.9)


@pytest.mark.slow  # make test-all: the default suite keeps within its 20 minutes
def test_eagle3_on_gemma3_and_sampled(tmp_path):
    """A Gemma 3 target (local and global layers, its embedding scale): greedy EAGLE-3 equals plain
    decoding; seeded sampling gives plain decoding's distribution only in law, so here it must just
    run, reproducibly."""
    families.save_folder("gemma3", tmp_path)
    model = specjax.load(tmp_path)
    head = Eagle3Head.init(model, jax.random.key(2), scale=0.5)
    assert head.config.aux_layer_ids == (1, 2)  # the defaults 2, L // 2, L - 3 for L = 4, distinct
    prompts = families.prompts(lengths=(33, 20), seed=2)
    plain = specjax.generate(model, prompts, max_new_tokens=24).tokens
    for options in ({"k": 3}, {"tree": TokenTree.top_k((2, 2))}):
        assert (
            specjax.generate(
                model, prompts, proposer=specjax.Eagle3(head, **options), max_new_tokens=24
            ).tokens
            == plain
        )
    sampling = specjax.Sampling(temperature=0.8, seed=3)
    first = specjax.generate(
        model, prompts, proposer=specjax.Eagle3(head, k=3), sampling=sampling, max_new_tokens=16
    )
    again = specjax.generate(
        model, prompts, proposer=specjax.Eagle3(head, k=3), sampling=sampling, max_new_tokens=16
    )
    assert first.tokens == again.tokens


def test_bad_eagle3_arguments():
    with pytest.raises(ValueError, match="Eagle3 head must be a specjax.models.Eagle3Head"):
        specjax.Eagle3(HEAD.params)
    with pytest.raises(ValueError, match="Eagle3 k must be an integer in 1..16, got 0"):
        specjax.Eagle3(HEAD, k=0)
    other = tiny_model(seed=3, num_layers=2, hidden_size=32)
    with pytest.raises(ValueError, match="does not fit the target"):
        specjax.generate(other, [[1, 2]], proposer=specjax.Eagle3(HEAD), max_new_tokens=2)


def test_eagle3_on_a_mesh_equals_one_device(plain_greedy):
    """The captured streams leave the shard_map'd forward split by row, whole on each device."""
    mesh = specjax.sharding.make_mesh(model=2, data=2, devices=jax.devices()[:4])
    proposer = specjax.Eagle3(BUILT, tree=TokenTree.top_k((2, 2)))
    result = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=24, mesh=mesh)
    assert result.tokens == plain_greedy
    check_acceptance(result.metrics, 0.2, 0.9)  # 0.7 here
