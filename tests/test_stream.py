"""`specjax.stream`: text deltas as the loop commits tokens, joined equal to `generate`'s text."""

import jax
import pytest
from drafters import check_acceptance, layered_target
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax.serve import stream as streaming

TARGET = layered_target(seed=11, late_scale=0.3)
WORDY = specjax.Model(TARGET.config, TARGET.params, tiny_tokenizer(), name="tiny-wordy")
NO_EOS = {96: -100.0}  # tiny_tokenizer's "<eos>"


def with_tokenizer(model, tokenizer):
    return specjax.Model(model.config, model.params, tokenizer, name=f"{model.name}-with-tokenizer")


def joined(deltas):
    deltas = list(deltas)
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], deltas


@pytest.mark.parametrize(
    "sampling",
    # EOS (96) biased away, so that the rows run long enough for drafts to be accepted in part; the
    # stops by default (the string "!8" ends the row at 37 tokens), plain greedy and seeded
    # sampling in make test-all (10 to 13 s each).
    [
        pytest.param(specjax.Sampling(logit_bias=NO_EOS), marks=pytest.mark.slow),
        specjax.Sampling(stop=["!8", "zz"], stop_token_ids=[7], logit_bias=NO_EOS),
        pytest.param(
            specjax.Sampling(temperature=0.8, top_k=30, seed=3, logit_bias=NO_EOS), marks=pytest.mark.slow
        ),
    ],
)
def test_stream_joins_to_generate(sampling):
    proposer = specjax.SelfDraft(layers=1, k=3)  # accepts part of the time (tests/drafters.py)
    prompt = "Speculative decoding, streamed: "
    expected = specjax.generate(WORDY, prompt, proposer, sampling, max_new_tokens=40)
    text, tokens, deltas = joined(
        specjax.stream(WORDY, prompt, proposer, sampling, max_new_tokens=40, chunk_steps=1)
    )
    assert tokens == expected.tokens[0] and text == expected.texts[0]
    assert len(deltas) >= min(3, len(tokens) // 4)  # text arrived in pieces
    assert all(d.finish_reason is None and d.metrics is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == expected.finish_reasons[0]
    assert last.metrics.summary()["num_emitted_tokens"] == len(tokens)
    check_acceptance(last.metrics, 0.2, 0.95)  # measured: 0.60 greedy, 0.88 sampled


def test_stream_with_an_unseeded_key_equals_generate():
    sampling = specjax.Sampling(temperature=1.0)
    key = jax.random.key(42)
    expected = specjax.generate(WORDY, "abc", sampling=sampling, max_new_tokens=20, key=key)
    _, tokens, _ = joined(specjax.stream(WORDY, "abc", sampling=sampling, max_new_tokens=20, key=key))
    assert tokens == expected.tokens[0]
    with pytest.raises(ValueError, match="key is required"):
        specjax.stream(WORDY, "abc", sampling=sampling)


def test_a_character_split_across_byte_tokens_waits_until_whole(smollm2):
    """A tiny random model over SmolLM2's byte-level vocabulary writes byte tokens that split
    characters: no delta but the last ends in half a character, and the deltas join to generate's
    text (replacement characters where the model wrote invalid bytes, as decode writes them)."""
    model = with_tokenizer(tiny_model(5, vocab_size=smollm2.config.vocab_size), smollm2.tokenizer)
    # Prompted with multi-byte text, sampled so that it wanders over the vocabulary.
    prompt = "naïve café 東京 🙂 — "
    sampling = specjax.Sampling(temperature=1.5, seed=11)
    expected = specjax.generate(model, prompt, sampling=sampling, max_new_tokens=48)
    text, tokens, deltas = joined(
        specjax.stream(model, prompt, sampling=sampling, max_new_tokens=48, chunk_steps=1)
    )
    assert tokens == expected.tokens[0] and text == expected.texts[0]
    pieces = [smollm2.tokenizer.decode([t]) for t in tokens]
    assert any("\ufffd" in p for p in pieces), "no token split a character: the test shows nothing"
    assert not any(d.text.endswith("\ufffd") for d in deltas[:-1])


def test_chat_messages_stream(smollm2):
    model = with_tokenizer(tiny_model(2, vocab_size=smollm2.config.vocab_size), smollm2.tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = specjax.generate(model, [messages], chat=True, max_new_tokens=12)
    text, tokens, _ = joined(specjax.stream(model, messages, chat=True, max_new_tokens=12))
    assert tokens == expected.tokens[0] and text == expected.texts[0]


def test_closing_a_stream_early_frees_its_engine_for_the_next_call():
    first = specjax.stream(WORDY, "hello", max_new_tokens=60, chunk_steps=2)
    next(first)
    busy = [engine for _, engine in streaming._ENGINES.values() if engine.has_work]
    assert len(busy) == 1
    engine = busy[0]
    first.close()  # a `break` out of the loop does the same
    assert not engine.has_work
    compiles = engine.num_compiles
    text, _, _ = joined(specjax.stream(WORDY, "hello again", max_new_tokens=60, chunk_steps=2))
    assert engine.num_compiles == compiles  # the kept engine ran it: nothing compiled
    assert text == specjax.generate(WORDY, "hello again", max_new_tokens=60).texts[0]
