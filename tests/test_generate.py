"""Plain (non-speculative) generation on tiny random models: the loop, its compiled form, stops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from laws import check_counts
from tiny import tiny_model

import specjax
from specjax.models import forward, init_cache
from specjax.models.llama import lm_head
from specjax.models.products import project
from specjax.planner import prompt_bucket
from specjax.programs import compiled_program_count


def reference_greedy(model, prompt, num_tokens, width=64):
    """Greedy tokens by re-running the whole sequence each step through an empty cache. The
    sequence is zero-padded to `width` (causal attention: padding after it changes nothing)."""

    @jax.jit
    def logits_of(tokens):
        positions = jnp.arange(width, dtype=jnp.int32)[None]
        return forward(model.params, model.config, tokens, positions, init_cache(model.config, 1, width))[0]

    seq = list(prompt)
    for _ in range(num_tokens):
        padded = jnp.zeros((1, width), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq))
        seq.append(int(jnp.argmax(logits_of(padded)[0, len(seq) - 1])))
    return seq[len(prompt) :]


def test_greedy_matches_uncached_reference_with_ragged_batch():
    model = tiny_model(seed=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [40, 41, 42], list(range(20, 37))]
    result = specjax.generate(model, prompts, max_new_tokens=12)
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        assert tokens == reference_greedy(model, prompt, 12)
    assert result.texts is None
    m = result.metrics
    assert m.emitted.tolist() == [12] * 4
    assert m.steps.tolist() == [11] * 4  # the first token comes from the prefill
    assert m.target_forwards.tolist() == [12] * 4


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (2, 48), (1, 2, 48), (3, 48), (2, 4, 48), (1, 47)])
def test_project_equals_the_plain_product(shape):
    """`project` (models/llama.py) equals x @ w against float64 numpy. One or two rows with an
    even input width go row by row, each as one batched product over the two halves of the width
    (the form XLA:CPU runs on both cores), so a row gets bit for bit what it gets alone; more
    rows, or an odd width, go as the plain product."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((shape[-1], 40)).astype(np.float32)
    got = jax.jit(project)(jnp.asarray(x), jnp.asarray(w))
    assert got.shape == (*shape[:-1], 40)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)
    dots = [e for e in jax.make_jaxpr(project)(x, w).jaxpr.eqns if e.primitive.name == "dot_general"]
    rows = int(np.prod(shape[:-1]))
    halves = rows <= 2 and shape[-1] % 2 == 0
    assert len(dots) == (rows if halves else 1)
    assert all(dot.params["dimension_numbers"][1][0] == ((0,) if halves else ()) for dot in dots)
    if halves:
        flat = np.asarray(got).reshape(rows, 40)
        for r, row in enumerate(x.reshape(rows, -1)):
            np.testing.assert_array_equal(flat[r], np.asarray(jax.jit(project)(jnp.asarray(row[None]), w))[0])


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (2, 64), (2, 3, 64)])
@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_equals_the_plain_product(shape, tied):
    """`lm_head` equals the float64 product with the head, for one row and for several; a tied
    head's rows go through the transposed, barriered form ([V, D] @ [D, rows]) when there are
    several, as the plain [rows, D] @ [D, V] product otherwise."""
    params = tiny_model(seed=4, tie_word_embeddings=tied).params
    head = np.asarray(params.embed, np.float64).T if tied else np.asarray(params.lm_head, np.float64)
    hidden = np.random.default_rng(shape[-2]).standard_normal(shape).astype(np.float32)
    got = jax.jit(lm_head)(params, jnp.asarray(hidden))
    assert got.shape == (*shape[:-1], head.shape[1]) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), hidden.astype(np.float64) @ head, rtol=1e-4, atol=1e-4)
    names = [e.primitive.name for e in jax.make_jaxpr(lm_head)(params, hidden).jaxpr.eqns]
    assert ("optimization_barrier" in names) == (tied and np.prod(shape[:-1]) > 1)


def test_batch_rows_do_not_interact():
    model = tiny_model(seed=2)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17]]
    together = specjax.generate(model, prompts, max_new_tokens=10).tokens
    # Alone, each row is a batch of one, whose products go in two halves (see project).
    alone = [specjax.generate(model, [p], max_new_tokens=10).tokens[0] for p in prompts]
    assert together == alone


def test_per_row_eos_stops_only_that_row():
    model = tiny_model(seed=3)
    prompts = [[1, 2, 3], [50, 51]]
    free = specjax.generate(model, prompts, max_new_tokens=10).tokens
    eos = free[0][4]  # row 0 emits this token at step 5: make it the EOS
    assert eos not in free[0][:4]
    stopped_model = tiny_model(seed=3, eos_token_ids=(eos,))
    result = specjax.generate(stopped_model, prompts, max_new_tokens=10)
    assert result.tokens[0] == free[0][:5]  # EOS included, nothing after it
    expected_row1 = free[1][: free[1].index(eos) + 1] if eos in free[1] else free[1]
    assert result.tokens[1] == expected_row1
    assert result.metrics.emitted.tolist() == [5, len(expected_row1)]


def test_new_prompt_length_in_same_bucket_does_not_recompile():
    model = tiny_model(seed=4, num_layers=3)  # a config no other test compiles
    # An XLA compilation, or an executable read back from the persistent compilation cache
    # (tests/conftest.py), which records its retrieval instead of a backend compile.
    compile_events = {
        "/jax/core/compile/backend_compile_duration",
        "/jax/compilation_cache/cache_retrieval_time_sec",
    }
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if name in compile_events else None
    )
    first = specjax.generate(model, [[1, 2, 3, 4, 5]], max_new_tokens=8)
    programs, backend_compiles = compiled_program_count(), len(compiles)
    assert prompt_bucket(5) == prompt_bucket(11)
    second = specjax.generate(model, [[7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=8)
    third = specjax.generate(model, [[9, 8]], max_new_tokens=8, sampling=specjax.Sampling())
    assert compiled_program_count() == programs
    assert len(compiles) == backend_compiles  # not one XLA compilation for the new lengths
    assert second.metrics.compile_time_s == 0 and third.metrics.compile_time_s == 0
    assert first.metrics.compile_time_s > 0


def test_compiled_generate_is_one_top_level_while_loop():
    from specjax.speculate.loop import GenerationInputs, LoopSpec, generate_program
    from specjax.speculate.sampling import Sampling, SamplingParams, WarpSpec

    model = tiny_model()
    sampling = [Sampling(0.7, 3, repetition_penalty=1.2), Sampling(logit_bias={3: 1.0})]
    spec = LoopSpec(model.config, 2, 16, 128, WarpSpec.of(sampling))
    inputs = GenerationInputs.simple(
        prompt_tokens=jnp.zeros((2, 16), jnp.int32),
        prompt_lengths=jnp.array([3, 5], jnp.int32),
        max_new_tokens=jnp.array([8, 8], jnp.int32),
        sampling=SamplingParams.of(sampling, 2, model.config.vocab_size),
        key=jax.random.key(0),
    )
    jaxpr = jax.make_jaxpr(generate_program, static_argnums=0)(spec, model.params, None, inputs)
    top_level = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert top_level.count("while") == 1
    assert not any("callback" in name for name in top_level)


def test_max_new_tokens_and_texts_with_sampling():
    model = tiny_model(seed=5)
    sampling = specjax.Sampling(temperature=0.8, top_k=10, top_p=0.9, min_p=0.01)
    a = specjax.generate(
        model, [[1, 2], [3, 4, 5]], sampling=sampling, max_new_tokens=7, key=jax.random.key(3)
    )
    b = specjax.generate(
        model, [[1, 2], [3, 4, 5]], sampling=sampling, max_new_tokens=7, key=jax.random.key(3)
    )
    c = specjax.generate(
        model, [[1, 2], [3, 4, 5]], sampling=sampling, max_new_tokens=7, key=jax.random.key(4)
    )
    assert [len(t) for t in a.tokens] == [7, 7]
    assert a.tokens == b.tokens  # same key, same tokens
    assert a.tokens != c.tokens
    assert all(0 <= t < model.config.vocab_size for row in a.tokens for t in row)


def test_sampled_first_token_follows_warped_distribution():
    """Many rows of one prompt: the first sampled token's counts match the exact warped law, checked
    by tests/laws.py (per-cell bounds and a G-test at false-alarm rate 1e-6): at 4,000 rows over
    its 8 tokens it detects a shift of 5.7% of the mass."""
    from specjax.speculate.sampling import SamplingParams, WarpSpec, warp_logits

    model = tiny_model(seed=6)
    prompt = [4, 8, 15, 16, 23, 42]
    sampling = specjax.Sampling(temperature=0.7, top_k=12, top_p=0.8)
    rows = 4000
    result = specjax.generate(
        model, [prompt] * rows, sampling=sampling, max_new_tokens=1, key=jax.random.key(7)
    )
    counts = np.bincount([t[0] for t in result.tokens], minlength=model.config.vocab_size)

    tokens = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits, _, _ = forward(model.params, model.config, tokens, positions, init_cache(model.config, 1, 16))
    probs = np.exp(
        np.asarray(warp_logits(logits[:, -1], SamplingParams.of(sampling, 1), WarpSpec.of(sampling))[0])
    )
    probs = probs.astype(np.float64)
    check = check_counts(counts, probs / probs.sum(), "first token")  # filtered tokens never appear
    assert check.detectable_shift < 0.057, check
    assert (probs > 0).sum() > 2  # the test exercises a real spread, not a single token


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[]), "prompts must not be empty"),
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
        (dict(prompts=[[1, 2, 1000]]), "token id 1000 outside the vocabulary"),
        (dict(prompts=["hello"]), "has no tokenizer"),
        (dict(prompts=[1.5]), r"prompts\[0\] must be a str"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(prompts=[list(range(10)) * 50], max_new_tokens=20), "exceeds the model's context of 512"),
        (dict(sampling=specjax.Sampling(temperature=0.5)), "key is required"),
        (dict(proposer="ngram"), "proposer must be None, one of"),
    ],
)
def test_bad_generate_arguments(kwargs, message):
    model = tiny_model()
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=message):
        specjax.generate(model, **args)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0, got -0.1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(min_p=2.0), r"min_p must be in \[0, 1\]"),
    ],
)
def test_bad_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        specjax.Sampling(**kwargs)
