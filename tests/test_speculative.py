"""Speculative decoding on tiny random models: lossless greedy and sampled output, model drafts
that accept part of the time and whose caches roll back, the n-gram rule, metrics, bad input."""

import dataclasses
import functools

import by_hand
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import check_acceptance, layered_target, noisy_copy
from hypothesis import given, settings
from hypothesis import strategies as st
from laws import assert_sequence_law
from tiny import tiny_model

import specjax
from specjax.models import forward, init_cache
from specjax.speculate.proposers import ngram_propose, resolve
from specjax.speculate.sampling import SamplingParams, WarpSpec, warp_logits

# A 2-layer target whose second layer adds small updates, so that SelfDraft(layers=1) drafts its next
# token part of the time, and a draft model that is the target with noise (and a third layer): both
# accept 29-69% of their drafts at k = 1..8 here (tests/drafters.py), where a random draft accepted none.
TARGET = layered_target(seed=11, late_scale=0.3)
NOISY_DRAFT = noisy_copy(TARGET, noise=0.05, seed=0)
# A random draft of other shapes, for the argument checks.
DRAFT = tiny_model(seed=12, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=48)
# Prompts with repeats, so that n-gram lookup finds matches; different lengths in one batch.
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]


def proposers(k):
    return {
        "ngram": specjax.NGram(k=k, n_max=3, n_min=1),
        "draft": specjax.DraftModel(NOISY_DRAFT, k=k),
        "self": specjax.SelfDraft(layers=1, k=k),
    }


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=24).tokens


# By default each proposer at one or two k, together 1, 2, 4 and 8; every pair with `make test-all`.
SPECULATIVE_FAST = {("ngram", 1), ("ngram", 8), ("draft", 4), ("self", 2)}


@pytest.mark.parametrize(
    "name, k",
    [
        pytest.param(name, k, marks=() if (name, k) in SPECULATIVE_FAST else pytest.mark.slow)
        for name in ("ngram", "draft", "self")
        for k in (1, 2, 4, 8)
    ],
)
def test_greedy_speculative_equals_plain(plain_greedy, name, k):
    result = specjax.generate(TARGET, PROMPTS, proposer=proposers(k)[name], max_new_tokens=24)
    assert result.tokens == plain_greedy
    m = result.metrics
    assert m.emitted.tolist() == [24] * 4
    assert (m.accept_hist.sum(1) == m.drafting_steps).all()
    assert (m.accepted <= m.drafted).all() and (m.drafted <= k * m.steps).all()
    assert (m.accepted_at.sum(1) == m.accepted).all()
    assert (m.reached_at >= m.accepted_at).all()
    if name != "ngram":  # model drafts accept part of the time by construction (tests/drafters.py)
        check_acceptance(m, 0.2, 0.9)


def test_greedy_batch_of_one_equals_plain(plain_greedy):
    # Row 3 takes the model drafts through accepted, partly and wholly rejected steps (row 2, where
    # SelfDraft accepts every draft, through long accepted runs).
    for k, name, row in [(2, "ngram", 2), (4, "draft", 3), (8, "self", 2), (4, "self", 3)]:
        prompts = PROMPTS[row : row + 1]
        result = specjax.generate(TARGET, prompts, proposer=proposers(k)[name], max_new_tokens=24)
        assert result.tokens == plain_greedy[row : row + 1], (k, name, row)
        if row == 3:
            check_acceptance(result.metrics, 0.2, 0.9)


@functools.partial(jax.jit, static_argnames="config")
def _scratch_logits(params, config, tokens):
    """Logits [B, S, V] over whole rows tokens [B, S], from an empty cache."""
    B, S = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    return forward(params, config, tokens, positions, init_cache(config, B, S))[0]


def scratch_greedy_drafts(model, tokens, lengths, k):
    """The k tokens `model` decodes greedily after each row's tokens[b, :lengths[b]] [B, k], every
    one from a full forward over the row so far (no cache carried between them)."""
    tokens, lengths, rows = np.array(tokens), np.array(lengths), np.arange(len(lengths))
    drafts = []
    for i in range(k):
        logits = np.asarray(_scratch_logits(model.params, model.config, jnp.asarray(tokens)))
        drafts.append(logits[rows, lengths + i - 1].argmax(-1))
        tokens[rows, lengths + i] = drafts[-1]
    return np.stack(drafts, axis=1)


@pytest.mark.parametrize("name", ["draft", "self"])
def test_drafts_equal_a_from_scratch_recomputation(name):
    """Drive the proposer's init / propose by hand over steps with ragged acceptance (none, some,
    all, per row) and commit what a step would: the accepted drafts, then a token other than the
    next draft. Each step's drafts must equal the draft model's greedy decoding from scratch on the
    committed rows, so its KV cache, trusted only up to the committed length, was rolled back
    right. SelfDraft's draft model is the target's first layer with its final norm and head."""
    k, S = 3, 64
    if name == "draft":
        proposer, model = specjax.DraftModel(NOISY_DRAFT, k=k), NOISY_DRAFT
    else:
        proposer = specjax.SelfDraft(layers=1, k=k)
        config = dataclasses.replace(TARGET.config, num_layers=1)
        model = specjax.Model(config, TARGET.params.replace(layers=TARGET.params.layers[:1]))
    spec = proposer.spec(TARGET, WarpSpec.of(specjax.Sampling()))
    params = proposer.params(TARGET)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    B, V, rng = len(prompts), TARGET.config.vocab_size, np.random.default_rng(0)
    tokens = np.zeros((B, S), np.int32)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt) + 1] = prompt + [int(rng.integers(V))]  # and the prefill's token
    prompt_lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    init_args = (TARGET.params, params, jnp.asarray(tokens[:, :16]), prompt_lengths, S, None)
    if spec.capabilities.reads_target_cache:  # SelfDraft starts from the target's cache over the prompt
        positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16))
        *_, cache = forward(
            TARGET.params, TARGET.config, init_args[2], positions, init_cache(TARGET.config, B, S)
        )
        state = by_hand.init(spec, *init_args, target_cache=cache.replace(lengths=prompt_lengths))
    else:
        state = by_hand.init(spec, *init_args)
    lengths = np.asarray(prompt_lengths) + 1
    keys = jax.random.split(jax.random.key(0), B)
    sampling = SamplingParams.of(specjax.Sampling(), B)
    propose = by_hand.propose_fn(spec)
    schedule = [(0, 2, 3), (3, 1, 0), (1, 0, 3), (2, 3, 1), (0, 0, 2), (3, 3, 0)]  # accepted per row
    for accepted in schedule:
        proposal, state = propose(
            TARGET.params, params, state, jnp.asarray(tokens), jnp.asarray(lengths), keys, sampling, None
        )
        drafts = np.asarray(proposal.draft_tokens)
        np.testing.assert_array_equal(drafts, scratch_greedy_drafts(model, tokens, lengths, k), str(accepted))
        for b, n in enumerate(accepted):
            rejected = drafts[b, n] if n < k else -1
            bonus = next(t for t in rng.permutation(V) if t != rejected)
            tokens[b, lengths[b] : lengths[b] + n + 1] = [*drafts[b, :n], bonus]
        state = by_hand.update(spec, state, None, jnp.asarray(accepted, jnp.int32))
        lengths = lengths + np.asarray(accepted) + 1


@pytest.mark.parametrize("k", [1, 3, pytest.param(8, marks=pytest.mark.slow)])
def test_target_as_its_own_draft_accepts_everything(k):
    result = specjax.generate(TARGET, PROMPTS, proposer=specjax.DraftModel(TARGET, k=k), max_new_tokens=30)
    summary = result.metrics.summary()
    assert summary["acceptance_rate"] == 1.0
    assert summary["mean_acceptance_length"] == k + 1
    assert summary["conditional_acceptance_per_position"] == [1.0] * k
    assert summary["acceptance_per_position"] == [1.0] * k
    assert summary["acceptance_length_histogram"][-1] == summary["num_drafts"]
    assert summary["expected_acceptance_per_position"] == pytest.approx([1.0] * k)


def test_drafts_accepted_past_a_stop_are_not_counted():
    """The target as its own draft accepts every draft, also those after a stop token it drafts
    itself; the row ends at the stop, and the metrics count only the accepted drafts up to it
    (every emitted token but the prefill's is an accepted draft or a step's bonus token)."""
    k, prompt = 3, PROMPTS[0]
    plain = specjax.generate(TARGET, [prompt], max_new_tokens=24).tokens[0]
    # A token's first appearance at a step's first or second draft (the prefill emits token 0, each
    # step k + 1 = 4 more: drafts at 1, 2, 3, the bonus at 4, ...), so drafts follow it in its step.
    first_stop = next(i for i, t in enumerate(plain) if i % (k + 1) in (1, 2) and t not in plain[:i])
    sampling = specjax.Sampling(stop_token_ids=[plain[first_stop]])
    result = specjax.generate(
        TARGET, [prompt], proposer=specjax.DraftModel(TARGET, k=k), sampling=sampling, max_new_tokens=24
    )
    assert result.tokens[0] == plain[: first_stop + 1]
    metrics = result.metrics
    steps = int(metrics.drafting_steps.sum())
    assert int(metrics.accepted.sum()) == int(metrics.emitted.sum()) - 1 - (steps - 1)
    assert int(metrics.accepted.sum()) < steps * k  # the last step's drafts past the stop: not counted


def one_live_layer(model):
    """The model with its second (last) layer's attention and MLP output projections zeroed: that
    layer adds exactly zero to the residual stream, so the first layer, the final norm and the head
    (SelfDraft(layers=1)) compute the model itself."""
    first, last = model.params.layers
    last = last.replace(o=jnp.zeros_like(last.o), down=jnp.zeros_like(last.down))
    params = model.params.replace(layers=(first, last))
    return specjax.Model(model.config, params, name=f"{model.name}-one-live-layer")


@pytest.mark.parametrize("k", [1, 3, 8])
def test_self_draft_that_is_the_target_accepts_everything(k):
    """SelfDraft's own cache, checked as the test above checks DraftModel's: greedy output is right
    whatever the draft's cache holds (verification repairs it), so only the acceptance shows a
    draft that reads a stale or misplaced slot (tests/planted_bugs.py, selfdraft-rollback)."""
    target = one_live_layer(TARGET)
    result = specjax.generate(target, PROMPTS, proposer=specjax.SelfDraft(layers=1, k=k), max_new_tokens=30)
    assert result.tokens == specjax.generate(target, PROMPTS, max_new_tokens=30).tokens
    summary = result.metrics.summary()
    assert summary["acceptance_rate"] == 1.0
    assert summary["mean_acceptance_length"] == k + 1
    assert summary["acceptance_per_position"] == [1.0] * k


def exact_joint(model, prompt, sampling, num_tokens):
    """P(first num_tokens tokens) by enumeration over the warped target distribution (float64)."""
    spec, params = WarpSpec.of(sampling), SamplingParams.of(sampling, 1)

    @jax.jit
    def next_probs(seq):  # seq [1, T] -> [V]
        T = seq.shape[1]
        positions = jnp.arange(T, dtype=jnp.int32)[None]
        logits = forward(model.params, model.config, seq, positions, init_cache(model.config, 1, T))[0]
        return jnp.exp(warp_logits(logits[:, -1], params, spec))[0]

    joint = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for prefix, prob in joint.items():
            p = np.asarray(next_probs(jnp.asarray([prompt + list(prefix)], jnp.int32)), np.float64)
            for token in np.flatnonzero(p > 0):
                grown[prefix + (int(token),)] = prob * p[token]
        joint = grown
    return joint


# The sampled law with top-k and top-p (and every other option) under each proposer is tested
# in test_sampling_options.py::test_mixed_batch_follows_the_reference_law.


def test_ngram_rule_on_hand_made_sequences():
    def propose(seq, k=3, n_max=3, n_min=1):
        tokens = jnp.asarray([seq + [0] * (32 - len(seq))], jnp.int32)
        p = ngram_propose(tokens, jnp.asarray([len(seq)], jnp.int32), k, n_max, n_min)
        return [int(t) for t, v in zip(p.draft_tokens[0], p.valid[0], strict=True) if v]

    # The longest match wins: the 2-gram (1, 2) continues with 3, 4, 5; the 1-gram 2 also with 9.
    assert propose([1, 2, 3, 4, 5, 2, 9, 7, 1, 2]) == [3, 4, 5]
    # Several occurrences of the same n-gram: the most recent one wins.
    assert propose([1, 2, 7, 1, 2, 8, 6, 1, 2]) == [8, 6, 1]
    # The continuation stops at the end of the sequence: fewer than k drafts.
    assert propose([4, 5, 4, 5]) == [4, 5]
    # No earlier occurrence of the last token: nothing drafted.
    assert propose([1, 2, 3, 4]) == []
    # n_min excludes short matches.
    assert propose([1, 2, 3, 4, 5, 2, 9, 7, 6, 2], n_min=2) == []
    assert propose([1, 2, 3, 4, 5, 2, 9, 7, 6, 2], n_min=1) == [9, 7, 6]
    # n_max caps the length considered: with n_max 1, the most recent 2 wins.
    assert propose([1, 2, 3, 4, 5, 2, 9, 7, 1, 2], n_max=1) == [9, 7, 1]


def test_ngram_row_without_match_still_gains_a_token():
    result = specjax.generate(TARGET, [[1, 2, 3, 4]], proposer=specjax.NGram(k=4), max_new_tokens=1)
    assert len(result.tokens[0]) == 1


def test_single_top_level_while_with_a_proposer():
    from specjax.planner import prompt_bucket
    from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program
    from specjax.speculate.proposers import resolve

    for proposer in proposers(3).values():
        warp = WarpSpec.of(specjax.Sampling(temperature=0.5, top_p=0.9))
        proposer_spec, proposer_params = resolve(proposer, TARGET, warp)
        spec = LoopSpec(TARGET.config, 2, prompt_bucket(4), 128, warp, proposer_spec)
        inputs = GenerationInputs.simple(
            prompt_tokens=jnp.zeros((2, 16), jnp.int32),
            prompt_lengths=jnp.array([3, 5], jnp.int32),
            max_new_tokens=jnp.array([8, 8], jnp.int32),
            sampling=SamplingParams.of(specjax.Sampling(temperature=0.5, top_p=0.9), 2),
            key=jax.random.key(0),
        )
        jaxpr = jax.make_jaxpr(generate_program, static_argnums=0)(
            spec, TARGET.params, proposer_params, inputs
        )
        names = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
        assert names.count("while") == 1, type(proposer).__name__


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: specjax.NGram(k=0), r"NGram k must be an integer in 1..16, got 0"),
        (lambda: specjax.NGram(k=17), r"NGram k must be an integer in 1..16, got 17"),
        (lambda: specjax.NGram(n_min=0), "NGram n_min must be an integer >= 1, got 0"),
        (lambda: specjax.NGram(n_min=3, n_max=2), r"NGram n_min \(3\) must not exceed n_max \(2\)"),
        (lambda: specjax.DraftModel(DRAFT, k=0), "DraftModel k must be"),
        (lambda: specjax.DraftModel("small", k=2), "DraftModel model must be a specjax.Model"),
        (
            lambda: specjax.DraftModel(DRAFT, prompt_from_target=1),
            "DraftModel prompt_from_target must be a bool, got 1",
        ),
        (lambda: specjax.SelfDraft(layers=0), "SelfDraft layers must be an integer >= 1"),
        (lambda: specjax.SelfDraft(k=20), "SelfDraft k must be"),
    ],
)
def test_bad_proposer_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "proposer, message",
    [
        (specjax.SelfDraft(layers=2), r"SelfDraft layers must be in 1..1 for a target of 2 layers, got 2"),
        (specjax.DraftModel(tiny_model(vocab_size=50), k=2), "vocab_size 50, the target 97"),
        (
            specjax.DraftModel(tiny_model(num_layers=1), prompt_from_target=True),
            r"prompt_from_target=True needs a draft with the target's config .*num_layers 1 \(target 2\)",
        ),
        (object(), "proposer must be None, one of"),
    ],
)
def test_bad_proposer_for_this_target(proposer, message):
    with pytest.raises(ValueError, match=message):
        specjax.generate(TARGET, [[1, 2, 3]], proposer=proposer, max_new_tokens=4)


def test_counts_are_consistent_across_rows():
    result = specjax.generate(TARGET, PROMPTS, proposer=specjax.NGram(k=3), max_new_tokens=16)
    m = result.metrics
    assert m.emitted.tolist() == [len(t) for t in result.tokens]
    # every step emits between 1 and k+1 tokens, plus one from the prefill
    assert ((m.emitted - 1 >= m.steps) & (m.emitted - 1 <= 4 * m.steps)).all()
    assert m.target_forwards.tolist() == (m.steps + 1).tolist()


class _Vocab:
    """Stands in for a tokenizer: the vocabulary check only compares get_vocab()."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.eos_token_id = None

    def get_vocab(self):
        return dict(self.vocab)


def test_draft_with_another_tokenizer_is_refused():
    target = specjax.Model(TARGET.config, TARGET.params, _Vocab({"a": 0, "b": 1}))
    draft = specjax.Model(DRAFT.config, DRAFT.params, _Vocab({"a": 1, "b": 0}))
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        specjax.generate(target, [[1, 2, 3]], proposer=specjax.DraftModel(draft, k=2), max_new_tokens=4)


def test_ngram_misses_are_not_counted_as_drafts():
    # This random target never repeats a token in 12 steps here: every lookup misses.
    random = tiny_model(seed=11)
    missing = specjax.generate(
        random, [[7, 8, 9, 7, 8], [1, 2, 3, 4]], proposer=specjax.NGram(k=3), max_new_tokens=12
    )
    m = missing.metrics
    assert m.steps.tolist() == [11, 11] and m.drafting_steps.tolist() == [0, 0] and m.drafted.sum() == 0
    assert np.isnan(m.summary()["mean_acceptance_length"])  # no drafts: undefined, not 1.0
    # A tied random model repeats its last token: every lookup after the first step matches.
    repeating = tiny_model(seed=11, tie_word_embeddings=True)
    result = specjax.generate(
        repeating, [[7, 8, 9, 7, 8], [1, 2, 3, 4]], proposer=specjax.NGram(k=3), max_new_tokens=12
    )
    m = result.metrics
    assert (m.drafting_steps > 0).all() and (m.drafting_steps <= m.steps).all()
    assert m.drafted_at.sum() == m.drafted.sum()
    assert (m.drafted_at[:, 0] == m.drafting_steps).all()  # a draft always has a valid first token
    summary = m.summary()
    assert summary["num_drafts"] == int(m.drafting_steps.sum())
    assert summary["mean_acceptance_length"] == pytest.approx(1 + m.accepted.sum() / m.drafting_steps.sum())


@pytest.mark.slow  # tests/test_laws.py and the chain laws above cover the verifier's law
def test_sampled_law_when_no_row_drafts():
    """Steps where no row drafts take a one-token pass (a batch-wide branch): its sampled
    tokens must follow the same law. The prompt is chosen so that no first token can be found
    in it, so every row misses its lookup at the first speculative step. The law of the two
    tokens is checked by tests/laws.py (per-cell bounds and a G-test at false-alarm rate 1e-6):
    at 6,000 rows over its 16 sequences it detects a shift of 5.1% of the mass."""
    sampling = specjax.Sampling(temperature=0.8, top_k=4, top_p=0.9)
    for start in range(20, 90, 7):
        prompt = [start, start + 1, start + 2]
        joint = exact_joint(TARGET, prompt, sampling, 2)
        if not {seq[0] for seq in joint} & set(prompt):
            break
    rows = 6000
    result = specjax.generate(
        TARGET,
        [prompt] * rows,
        proposer=specjax.NGram(k=3),
        sampling=sampling,
        max_new_tokens=2,
        key=jax.random.key(9),
    )
    assert result.metrics.drafting_steps.sum() == 0 and result.metrics.steps.sum() == rows
    check = assert_sequence_law(result.tokens, joint, "two tokens")
    assert check.detectable_shift < 0.052, check


def ngram_reference(seq, k, n_max, n_min):
    """The rule, written out: the longest n-gram ending at the last token that occurs earlier,
    its most recent earlier occurrence, and the (up to k) tokens after that occurrence."""
    last = len(seq) - 1
    for n in range(min(n_max, len(seq)), n_min - 1, -1):
        suffix = seq[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):  # most recent first
            if seq[end - n + 1 : end + 1] == suffix:
                return seq[end + 1 : end + 1 + k]
    return []


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=24), min_size=1, max_size=4),
    k=st.integers(1, 6),
    n_max=st.integers(1, 4),
    n_min=st.integers(1, 4),
)
def test_ngram_invariants(rows, k, n_max, n_min):
    """On random sequences over a small vocabulary (so that matches abound): the valid mask is a
    prefix, drafted tokens come from the sequence and equal the rule's reference, and padding
    beyond a row's length never leaks into a draft."""
    n_min = min(n_min, n_max)
    tokens = np.full((len(rows), 32), 7, np.int32)  # 7: a token no sequence holds
    for b, seq in enumerate(rows):
        tokens[b, : len(seq)] = seq
    proposal = ngram_propose(jnp.asarray(tokens), jnp.asarray([len(r) for r in rows]), k, n_max, n_min)
    draft, valid = np.asarray(proposal.draft_tokens), np.asarray(proposal.valid)
    for b, seq in enumerate(rows):
        count = int(valid[b].sum())
        assert valid[b, :count].all() and not valid[b, count:].any()  # a prefix
        assert draft[b, :count].tolist() == ngram_reference(seq, k, n_max, n_min)
        assert set(draft[b, :count].tolist()) <= set(seq)


@pytest.mark.parametrize("stacked", [False, True], ids=["layer by layer", "stacked"])
def test_a_draft_prompt_from_target_starts_from_the_targets_cache(stacked):
    """DraftModel(prompt_from_target=True): the draft's state after the prompt is the target's
    cache, laid out as the draft's layers are (one buffer per layer, or a stack's), not a prefill
    of its own."""
    copy = noisy_copy(TARGET, noise=0.05, extra_layers=0)
    spec, params = resolve(specjax.DraftModel(copy, k=2, prompt_from_target=True), TARGET, WarpSpec())
    if stacked:
        params = spec.stack_layers(params)
    lengths = jnp.array([5, 3], jnp.int32)
    empty = init_cache(TARGET.config, 2, 16)
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(empty.k)))
    target_cache = empty.replace(
        k=tuple(jax.random.normal(next(keys), b.shape) for b in empty.k),
        v=tuple(jax.random.normal(next(keys), b.shape) for b in empty.v),
        lengths=lengths,
    )
    prompts = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]], jnp.int32)
    state = by_hand.init(spec, TARGET.params, params, prompts, lengths, 16, None, target_cache=target_cache)
    assert state.cache.layout == ((2,) if stacked else (None, None))
    per_layer = (
        [(k[i], v[i]) for k, v in zip(state.cache.k, state.cache.v, strict=True) for i in range(2)]
        if stacked
        else list(zip(state.cache.k, state.cache.v, strict=True))
    )
    for (k, v), k_target, v_target in zip(per_layer, target_cache.k, target_cache.v, strict=True):
        np.testing.assert_array_equal(k, k_target)
        np.testing.assert_array_equal(v, v_target)
    np.testing.assert_array_equal(state.cache.lengths, lengths)
