"""`generate(..., logprobs=N)`: each emitted token's logprob and the N most likely tokens, computed
inside the compiled loop, checked against an independent reference (a float64 numpy log-softmax
of a teacher-forced pass over the emitted tokens, with the sampling options' processing written
out again here), and equal under every proposer family to what plain decoding reports."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import first_layer_eagle, layered_target, noisy_copy
from oracle import Oracle, references

import specjax
from specjax import programs
from specjax.models import MedusaHead, forward, init_cache
from specjax.speculate.logprobs import Logprobs
from specjax.speculate.tree import TokenTree

TARGET = layered_target(seed=11, late_scale=0.3)
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [3, 9],
    [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11, 12, 13],
    [40, 41, 42, 40, 41],
]
N = 4
NEW = 16
TOL = 1e-5
# One greedy row and sampled rows that exercise every step of the processing: bias, penalties,
# temperature, top-k, top-p, min-p.
MIXED = [
    specjax.Sampling(logit_bias={7: 1.5}),
    specjax.Sampling(temperature=0.8, top_k=8, seed=1),
    specjax.Sampling(temperature=1.2, top_p=0.9, repetition_penalty=1.3, seed=2),
    specjax.Sampling(temperature=0.7, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3, seed=3),
]


@functools.partial(jax.jit, static_argnames="config")
def _logits(params, config, tokens):
    """Logits [1, S, V] of one row from an empty cache: the teacher-forced pass."""
    S = tokens.shape[1]
    positions = jnp.arange(S, dtype=jnp.int32)[None]
    return forward(params, config, tokens, positions, init_cache(config, 1, S))[0]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    top = np.max(z)
    return z - top - np.log(np.sum(np.exp(z - top)))


def processed(z: np.ndarray, s: specjax.Sampling, prompt, before) -> np.ndarray:
    """float64 log-probabilities [V] of the distribution a row with options `s` draws from, after
    `prompt` and the output tokens `before`, from the raw logits z [V] (vLLM's order for bias and
    penalties, HF's for the rest)."""
    z = z.astype(np.float64).copy()
    for token, bias in (s.logit_bias or {}).items():
        z[token] += bias
    counts = np.bincount(np.asarray(before, np.int64), minlength=len(z))
    seen = (counts > 0) | np.isin(np.arange(len(z)), prompt)
    r = s.repetition_penalty
    z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    z = z - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
    if s.temperature == 0:
        return _log_softmax(z)
    z = z / s.temperature
    keep = np.ones(len(z), bool)
    if s.top_k:
        keep &= z >= np.sort(z)[::-1][s.top_k - 1]
    if s.top_p < 1:
        order = np.argsort(-z, kind="stable")
        probs = np.exp(_log_softmax(np.where(keep, z, -np.inf)[order]))
        before_mass = np.cumsum(probs) - probs
        kept = (before_mass < s.top_p) | (np.arange(len(z)) == 0)
        keep &= z >= np.min(z[order][kept])
    if s.min_p:
        lp = _log_softmax(np.where(keep, z, -np.inf))
        keep &= lp >= lp.max() + np.log(s.min_p)
    return _log_softmax(np.where(keep, z, -np.inf))


def check_against_reference(model, result, samplings, top=N):
    """Every row's logprobs and top N equal the float64 reference over a teacher-forced pass."""
    for b, (prompt, out) in enumerate(zip(result.prompt_tokens, result.tokens, strict=True)):
        lp = result.logprobs[b]
        assert lp.token_ids.tolist() == out
        logits = np.asarray(_logits(model.params, model.config, jnp.asarray([prompt + out])))[0]
        for i, token in enumerate(out):
            ref = processed(logits[len(prompt) - 1 + i], samplings[b], prompt, out[:i])
            assert np.isfinite(lp.logprobs[i])
            np.testing.assert_allclose(lp.logprobs[i], ref[token], atol=TOL, err_msg=f"row {b} token {i}")
            order = np.argsort(-ref, kind="stable")[:top]
            np.testing.assert_allclose(lp.top_logprobs[i], ref[order], atol=TOL)
            finite = np.isfinite(ref[order])
            assert lp.top_ids[i][finite].tolist() == order[finite].tolist(), (b, i)
            assert np.all(lp.top_logprobs[i][~finite] == -np.inf)


@pytest.fixture(scope="module")
def plain_mixed():
    return specjax.generate(TARGET, PROMPTS, sampling=MIXED, max_new_tokens=NEW, logprobs=N)


def test_plain_decoding_equals_the_reference(plain_mixed):
    check_against_reference(TARGET, plain_mixed, MIXED)
    assert [len(lp) for lp in plain_mixed.logprobs] == [NEW] * 4


def test_greedy_logprobs_are_the_adjusted_logits_at_temperature_one(plain_mixed):
    """A greedy row's token is its distribution's most likely one, hence the first of the top N."""
    lp = plain_mixed.logprobs[0]
    assert lp.top_ids[:, 0].tolist() == lp.token_ids.tolist()
    np.testing.assert_array_equal(lp.top_logprobs[:, 0], lp.logprobs)
    assert np.all(np.diff(lp.top_logprobs, axis=1) <= 0)


def test_top_k_filtered_alternatives_are_minus_infinity():
    s = specjax.Sampling(temperature=1.0, top_k=2, seed=5)
    result = specjax.generate(TARGET, PROMPTS[:1], sampling=s, max_new_tokens=6, logprobs=3)
    lp = result.logprobs[0]
    assert np.all(np.isfinite(lp.top_logprobs[:, :2])) and np.all(lp.top_logprobs[:, 2] == -np.inf)
    np.testing.assert_allclose(np.logaddexp(lp.top_logprobs[:, 0], lp.top_logprobs[:, 1]), 0, atol=1e-6)


def test_off_by_default_and_zero_keeps_the_tokens_own():
    off = specjax.generate(TARGET, PROMPTS[:2], max_new_tokens=4)
    assert off.logprobs is None
    zero = specjax.generate(TARGET, PROMPTS[:2], max_new_tokens=4, logprobs=0)
    assert zero.tokens == off.tokens
    assert zero.logprobs[0].top_ids.shape == (4, 0) and zero.logprobs[0].logprobs.shape == (4,)
    assert np.all(zero.logprobs[0].logprobs <= 0)


@pytest.mark.parametrize("bad", [-1, 1.5, "5", True, 98])
def test_bad_logprobs_is_an_error(bad):
    with pytest.raises(ValueError, match=rf"logprobs must be None \(off\) or an integer in 0..97.*{bad!r}"):
        specjax.generate(TARGET, PROMPTS[:1], max_new_tokens=2, logprobs=bad)


@functools.cache
def eagle_head():
    return first_layer_eagle(TARGET)


def chain_proposers():
    return {
        "ngram": specjax.NGram(k=3, n_max=3, n_min=1),
        "draft": specjax.DraftModel(noisy_copy(TARGET, noise=0.05, seed=0), k=3),
        "self": specjax.SelfDraft(layers=1, k=2),
        "eagle": specjax.Eagle(eagle_head(), k=2),
        "dynamic": specjax.Dynamic(specjax.NGram(k=4, n_max=2)),
        "hybrid": specjax.Hybrid(specjax.NGram(k=4, n_max=3), specjax.Eagle(eagle_head(), k=2)),
        "medusa-tree": specjax.Medusa(
            MedusaHead.init(TARGET, num_heads=2, key=jax.random.key(0), scale=0.5),
            tree=TokenTree.top_k((3, 2)),
        ),
    }


FAST = {"ngram", "self", "dynamic", "hybrid", "medusa-tree"}


@pytest.fixture(scope="module")
def plain_greedy():
    return specjax.generate(TARGET, PROMPTS, max_new_tokens=NEW, logprobs=N)


def assert_same_logprobs(ours, theirs):
    assert ours.tokens == theirs.tokens
    for a, b in zip(ours.logprobs, theirs.logprobs, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, atol=TOL)
        assert a.top_ids.tolist() == b.top_ids.tolist()


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in chain_proposers()]
)
def test_every_proposer_reports_plain_decodings_logprobs(plain_greedy, name):
    """Greedy: the same tokens as plain decoding, with its logprobs; sampled rows (other tokens
    than plain decoding's: drawn otherwise): the reference's logprobs for the tokens they drew,
    correction tokens after a rejection included."""
    proposer = chain_proposers()[name]
    greedy = specjax.generate(TARGET, PROMPTS, proposer=proposer, max_new_tokens=NEW, logprobs=N)
    assert_same_logprobs(greedy, plain_greedy)
    assert 0 < greedy.metrics.accepted.sum() < greedy.metrics.drafted.sum()  # accepted in part
    mixed = specjax.generate(
        TARGET, PROMPTS, proposer=proposer, sampling=MIXED, max_new_tokens=NEW, logprobs=N
    )
    check_against_reference(TARGET, mixed, MIXED)


def test_a_tree_whose_paths_run_through_later_siblings(plain_greedy):
    """An oracle tree puts the right token at varying ranks: accepted paths run through later
    siblings, whose logits the records must be gathered from."""
    tree = TokenTree.top_k((3, 2, 2))
    reference = references(PROMPTS, plain_greedy.tokens)
    result = specjax.generate(
        TARGET, PROMPTS, proposer=Oracle(tree, reference), max_new_tokens=NEW, logprobs=N
    )
    assert result.metrics.accepted.sum() > NEW
    assert_same_logprobs(result, plain_greedy)


def test_no_recompilation_per_prompt_length_and_no_host_callback():
    specjax.generate(TARGET, [[1, 2, 3]], max_new_tokens=5, logprobs=2)
    before = programs.compiled_program_count()
    for prompt in ([1, 2, 3, 4, 5], [7] * 9, [4, 5]):
        specjax.generate(TARGET, [prompt], max_new_tokens=5, logprobs=2)
    assert programs.compiled_program_count() == before
    specjax.generate(TARGET, [[1, 2, 3]], max_new_tokens=5, logprobs=3)  # N is static
    assert programs.compiled_program_count() == before + 1

    from specjax import planner
    from specjax.speculate.loop import generate_program

    plan = planner.plan(TARGET, [[1, 2, 3]], proposer=specjax.NGram(k=2), max_new_tokens=5, logprobs=2)
    jaxpr = jax.make_jaxpr(generate_program, static_argnums=0)(
        plan.spec, plan.params, plan.proposer_params, plan.inputs
    )
    text = str(jaxpr)
    assert "while" in text and "top_k" in text
    assert "callback" not in text


def joined_logprobs(pieces):
    """One Logprobs of consecutive pieces (a stream's deltas, an engine's updates)."""
    pieces = [p for p in pieces if p is not None and len(p)]
    return Logprobs(
        *(np.concatenate([getattr(p, f.name) for p in pieces]) for f in dataclasses.fields(Logprobs))
    )


def assert_row_equal(ours: Logprobs, theirs: Logprobs):
    assert ours.token_ids.tolist() == theirs.token_ids.tolist()
    np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=TOL)
    np.testing.assert_allclose(ours.top_logprobs, theirs.top_logprobs, atol=TOL)
    assert ours.top_ids.tolist() == theirs.top_ids.tolist()


@pytest.mark.parametrize("name", ["plain", "ngram"])
def test_stream_carries_generates_logprobs(name):
    proposer = None if name == "plain" else specjax.NGram(k=3, n_max=3)
    sampling = MIXED[1]  # seeded: the stream draws generate's tokens
    whole = specjax.generate(TARGET, [PROMPTS[0]], proposer, sampling, max_new_tokens=NEW, logprobs=N)
    deltas = list(
        specjax.stream(TARGET, PROMPTS[0], proposer, sampling, max_new_tokens=NEW, chunk_steps=2, logprobs=N)
    )
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    assert_row_equal(joined_logprobs([d.logprobs for d in deltas]), whole.logprobs[0])


def test_engine_updates_carry_logprobs(plain_greedy):
    engine = specjax.Engine(TARGET, specjax.NGram(k=3, n_max=3), max_batch=2, max_model_len=96, chunk_steps=3)
    assert engine.spec.logprobs is None  # off by default
    engine = specjax.Engine(
        TARGET, specjax.NGram(k=3, n_max=3), max_batch=2, max_model_len=96, chunk_steps=3, logprobs=N
    )
    # Requests 0 and 2 ask for logprobs (request 2 for fewer alternatives), request 1 for none.
    asked = [N, None, 1]
    ids = [
        engine.add(specjax.Request(p, max_new_tokens=NEW, logprobs=n))
        for p, n in zip(PROMPTS[:3], asked, strict=True)
    ]
    pieces = {i: [] for i in ids}
    while engine.has_work:
        for update in engine.step():
            if asked[update.request_id] is None:
                assert update.logprobs is None
            else:
                assert len(update.logprobs) == len(update.tokens)
                pieces[update.request_id].append(update.logprobs)
    for b, i in enumerate(ids):
        if asked[b] is not None:
            expected = plain_greedy.logprobs[b].first(asked[b])
            assert_row_equal(joined_logprobs(pieces[i]), expected)
    with pytest.raises(ValueError, match="logprobs must be an integer >= 0, got -2"):
        specjax.EngineConfig(logprobs=-2)
    with pytest.raises(ValueError, match=r"logprobs=5: this engine computes at most .*allowed: 0 to 4"):
        engine.add(specjax.Request(PROMPTS[0], max_new_tokens=NEW, logprobs=N + 1))
    with pytest.raises(ValueError, match=r"prompt_logprobs=0: .*allowed: none"):
        specjax.Engine(TARGET, max_batch=1, max_model_len=96).add(
            specjax.Request(PROMPTS[0], max_new_tokens=NEW, prompt_logprobs=0)
        )


def test_engine_runs_logprobs_programs_only_for_chunks_that_ask():
    """A chunk of requests that ask for no logprobs runs a program computing none; the variant
    computing them compiles on the first chunk whose request asks, and its tokens are the same."""
    engine = specjax.Engine(TARGET, max_batch=1, max_model_len=96, chunk_steps=4, logprobs=N)
    plain = engine.run([specjax.Request(PROMPTS[0], max_new_tokens=NEW)])
    compiled = engine.num_compiles
    asked = engine.run([specjax.Request(PROMPTS[0], max_new_tokens=NEW, logprobs=N)])
    assert engine.num_compiles == compiled + 1  # the loop with logprobs, at width 1
    assert list(asked.values()) == list(plain.values())


def test_engine_reports_prompt_logprobs_with_the_first_update():
    """Request.prompt_logprobs: the first Update carries generate(prompt_logprobs=N)'s records of
    the prompt, for a short prompt and for one longer than prefill_chunk (scored in one pass, not
    in chunks), beside a request that asks for none."""
    long_prompt = (PROMPTS[2] * 3)[:40]
    prompts = [PROMPTS[0], long_prompt, PROMPTS[1]]
    whole = specjax.generate(TARGET, prompts[:2], max_new_tokens=4, prompt_logprobs=N)
    engine = specjax.Engine(TARGET, max_batch=2, max_model_len=96, prefill_chunk=16, logprobs=N)
    asked = [N, 2, None]
    ids = [
        engine.add(specjax.Request(p, max_new_tokens=4, prompt_logprobs=n))
        for p, n in zip(prompts, asked, strict=True)
    ]
    first = {}
    while engine.has_work:
        for update in engine.step():
            first.setdefault(update.request_id, update)
    for b, i in enumerate(ids):
        scored = first[i].prompt_logprobs
        if asked[b] is None:
            assert scored is None
        else:
            assert_row_equal(scored, whole.prompt_logprobs[b].first(asked[b]))
    assert engine.stats.prompt_chunks == 0


def test_prompt_logprobs_equal_the_reference():
    """Each prompt token from the second on, under the raw log-softmax of the teacher-forced logits
    before it (rows of different lengths in one padded prefill, beside a proposer and sampled rows'
    logprobs)."""
    result = specjax.generate(
        TARGET,
        PROMPTS,
        proposer=specjax.NGram(k=2),
        sampling=MIXED,
        max_new_tokens=4,
        logprobs=1,
        prompt_logprobs=N,
    )
    for b, prompt in enumerate(PROMPTS):
        lp = result.prompt_logprobs[b]
        assert lp.token_ids.tolist() == prompt[1:]
        logits = np.asarray(_logits(TARGET.params, TARGET.config, jnp.asarray([prompt])))[0]
        for i, token in enumerate(prompt[1:]):
            ref = _log_softmax(logits[i].astype(np.float64))
            np.testing.assert_allclose(lp.logprobs[i], ref[token], atol=TOL)
            order = np.argsort(-ref, kind="stable")[:N]
            assert lp.top_ids[i].tolist() == order.tolist()
            np.testing.assert_allclose(lp.top_logprobs[i], ref[order], atol=TOL)
    check_against_reference(TARGET, result, MIXED, top=1)
    assert specjax.generate(TARGET, PROMPTS[:1], max_new_tokens=2).prompt_logprobs is None


def test_prompt_logprobs_refuse_a_chunked_prefill():
    with pytest.raises(ValueError, match="prompt_logprobs=0 scores the prompts in one pass"):
        specjax.generate(TARGET, PROMPTS[:1], max_new_tokens=2, prompt_logprobs=0, prefill_chunk=32)
    with pytest.raises(ValueError, match="prompt_logprobs must be None"):
        specjax.generate(TARGET, PROMPTS[:1], max_new_tokens=2, prompt_logprobs=-1)


@pytest.mark.slow  # the built-in model and transformers' load of it (tiny models check the rest)
def test_builtin_model_logprobs_equal_transformers(smollm2, hf_smollm2):
    """Greedy logprobs (top 5) and prompt logprobs of SmolLM2 under NGram drafts, against the
    log-softmax of transformers' float32 logits of the same GGUF over prompt and output: within
    twice the logits' float32 tolerance (tests/test_builtin_model.py, 1e-4 of the largest logit)."""
    import torch

    prompt = smollm2.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    result = specjax.generate(
        smollm2, [prompt], proposer=specjax.NGram(k=3), max_new_tokens=8, logprobs=5, prompt_logprobs=5
    )
    ids = prompt + result.tokens[0]
    with torch.no_grad():
        logits = hf_smollm2(torch.tensor([ids]), use_cache=False).logits[0].double().numpy()
    for i in range(1, len(ids)):
        ref = _log_softmax(logits[i - 1])
        tol = 2e-4 * np.abs(logits[i - 1]).max()
        ours = result.prompt_logprobs[0] if i < len(prompt) else result.logprobs[0]
        j = i - 1 if i < len(prompt) else i - len(prompt)
        assert ours.token_ids[j] == ids[i]
        np.testing.assert_allclose(ours.logprobs[j], ref[ids[i]], atol=tol)
        order = np.argsort(-ref)[:5]
        np.testing.assert_allclose(ours.top_logprobs[j], ref[order], atol=tol)
