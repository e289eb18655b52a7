"""Long prompts in chunks in the engine (EngineConfig.prefill_chunk, specjax/serve/engine.py): a
prompt longer than a chunk is prefilled one chunk per step between the running rows' chunks, in
one program whatever its length, and its request gets what `generate` gives it alone."""

import jax
import numpy as np
import pytest
from drafters import first_layer_eagle, layered_target, noisy_copy
from test_engine import accepted_and_drafted, drive

import specjax
from specjax.serve import Engine, EngineConfig, Request
from specjax.speculate.sampling import WarpSpec

TARGET = layered_target(seed=11, late_scale=0.3)
VOCAB = TARGET.config.vocab_size
CHUNK = 32


def _prompt(seed: int, length: int) -> list[int]:
    """A prompt whose second half repeats a phrase, so that prompt lookup drafts."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, VOCAB, 6).tolist()
    head = rng.integers(0, VOCAB, length - length // 2).tolist()
    return head + (phrase * length)[: length // 2]


def alone(request: Request, proposer) -> list[int]:
    return specjax.generate(
        TARGET, [request.prompt], proposer, request.sampling, request.max_new_tokens, prefill_chunk=CHUNK
    ).tokens[0]


PROPOSERS = {
    "plain": lambda: None,
    "ngram": lambda: specjax.NGram(k=3),
    "draft": lambda: specjax.DraftModel(noisy_copy(TARGET, noise=0.05, seed=0), k=3),
    "eagle": lambda: specjax.Eagle(first_layer_eagle(TARGET), k=3),  # reads the target's features
    "eagle-tree": lambda: specjax.Eagle(
        first_layer_eagle(TARGET), k=3, tree=specjax.TokenTree.top_k((2, 2, 1))
    ),
}
FAST = ("plain", "eagle")


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in PROPOSERS]
)
def test_long_prompts_in_chunks_beside_short_ones_equal_generate_alone(name):
    proposer = PROPOSERS[name]()
    lengths = (70, 12, 100, 33, 20, 64, 45)  # four in chunks (3, 4, 2 and 2 of them)
    limits = (14, 20, 9, 12, 16, 7, 11)
    requests = [
        Request(_prompt(i, n), max_new_tokens=m) for i, (n, m) in enumerate(zip(lengths, limits, strict=True))
    ]
    engine = Engine(TARGET, proposer, max_batch=3, max_model_len=160, chunk_steps=3, prefill_chunk=CHUNK)
    tokens, finals = drive(engine, requests, seed=2)
    for i, request in enumerate(requests):
        assert tokens[i] == alone(request, proposer), i
        assert finals[i].finish_reason == "length"
    assert engine.stats.prompt_chunks == sum(-(-n // CHUNK) for n in lengths if n > CHUNK)
    assert engine.stats.admissions == len(requests)
    if proposer is not None:
        accepted, drafted = accepted_and_drafted(finals)
        assert 0.1 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    # One chunk program whatever the lengths; the finish of a long prompt per power-of-two bucket.
    kinds = [kind for kind, _ in engine.compiled]
    assert kinds.count("prompt_chunk") == kinds.count("start_prompt") == 1
    finishes = {size for kind, size in engine.compiled if kind == "finish_prompt"}
    assert finishes == {64, 128}
    compiled = engine.num_compiles
    again = [Request(_prompt(10 + i, n), max_new_tokens=4) for i, n in enumerate((90, 120, 40, 77))]
    tokens, _ = drive(engine, again, seed=3)
    assert engine.num_compiles == compiled  # same buckets: nothing compiles
    assert tokens[1] == alone(again[1], proposer)


def test_running_rows_make_tokens_at_every_step_while_a_long_prompt_runs_its_chunks():
    """Each step runs one chunk of the long prompt and then a chunk of the running rows: they
    never wait for the whole prompt. With nothing running, its chunks run back to back."""
    engine = Engine(TARGET, None, max_batch=2, max_model_len=256, chunk_steps=4, prefill_chunk=CHUNK)
    short = engine.add(Request(_prompt(0, 10), max_new_tokens=60))
    engine.step()
    long = engine.add(Request(_prompt(1, 200), max_new_tokens=40))  # 7 chunks
    seen = []
    while engine.stats.admissions < 2:
        chunks = engine.stats.prompt_chunks
        updates = {u.request_id: u for u in engine.step()}
        assert engine.stats.prompt_chunks == chunks + 1
        assert len(updates[short].tokens) >= 1  # the running row made progress in this step
        seen.append(long in updates)
    assert len(seen) == 7 and seen == [False] * 6 + [True]  # admitted after its last chunk
    assert engine.num_waiting == 0 and engine.num_running == 2

    lone = Engine(TARGET, None, max_batch=2, max_model_len=256, chunk_steps=4, prefill_chunk=CHUNK)
    request = Request(_prompt(1, 200), max_new_tokens=5)
    lone.add(request)
    updates = lone.step()
    assert lone.stats.prompt_chunks == 7 and updates[0].tokens  # one step: its chunks, its first tokens
    assert lone.run([]) == {}
    tokens, _ = drive(lone, [request], seed=0)
    assert tokens[0] == alone(request, None)


def test_a_seeded_long_prompt_draws_as_generate_alone():
    sampling = specjax.Sampling(temperature=0.9, top_p=0.95, seed=77)
    probe = Request(_prompt(5, 90), sampling, max_new_tokens=16)
    crowd = [
        Request(_prompt(6 + i, 15), specjax.Sampling(temperature=1.0), max_new_tokens=12) for i in range(3)
    ]
    engine = Engine(
        TARGET, specjax.NGram(k=3), max_batch=2, max_model_len=128, chunk_steps=2, prefill_chunk=CHUNK
    )
    tokens, _ = drive(engine, [crowd[0], probe, *crowd[1:]], seed=1)
    own = Engine(
        TARGET,
        specjax.NGram(k=3),
        max_batch=1,
        max_model_len=128,
        prefill_chunk=CHUNK,
        warp=WarpSpec.of(sampling),
    )
    alone_tokens, _ = drive(own, [probe], seed=0)
    assert tokens[1] == alone_tokens[0]
    assert alone_tokens[0] == alone(probe, specjax.NGram(k=3))


def test_abort_of_a_prompt_in_chunks_and_precompile():
    engine = Engine(TARGET, None, max_batch=2, max_model_len=256, chunk_steps=2, prefill_chunk=CHUNK)
    assert engine.precompile([10, 100, 200]) >= 3  # the chunk, its start, two finishes (and more)
    kinds = {kind for kind, _ in engine.compiled}
    assert {"start_prompt", "prompt_chunk", "finish_prompt"} <= kinds
    compiled = engine.num_compiles
    runner = engine.add(Request(_prompt(0, 10), max_new_tokens=30))
    engine.step()
    long = engine.add(Request(_prompt(1, 150), max_new_tokens=5))
    engine.step()
    assert engine.num_waiting == 1 and engine.stats.prompt_chunks == 1
    [final] = engine.abort(long)
    assert final.finish_reason == "abort" and engine.num_waiting == 0
    assert engine.abort(long) == []
    later = engine.add(Request(_prompt(2, 120), max_new_tokens=3))
    tokens: dict[int, list[int]] = {}
    while engine.has_work:
        for update in engine.step():
            tokens.setdefault(update.request_id, []).extend(update.tokens)
    assert set(tokens) == {runner, later} and len(tokens[later]) == 3
    assert engine.num_compiles == compiled  # what precompile compiled served them all


@pytest.mark.parametrize("value", [0, 8, 20, 33.0, "128"])
def test_bad_prefill_chunk_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=value)


def test_engine_state_stays_on_device():
    engine = Engine(TARGET, None, max_batch=1, max_model_len=128, prefill_chunk=CHUNK)
    engine.add(Request(_prompt(0, 70), max_new_tokens=2))
    engine.step()
    assert isinstance(engine._batch.state.tokens, jax.Array)
