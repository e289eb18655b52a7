"""GenerateResult.finish_reasons: "stop" for rows that ended at EOS, a stop token id or a stop
string, "length" for rows that reached max_new_tokens; a stop on the last allowed token wins."""

import pytest
from tiny import tiny_model, tiny_sentencepiece_tokenizer, tiny_tokenizer

import specjax

MAX_NEW = 20
BASE = tiny_model(seed=11)
# The character tokenizer's "<eos>" (id 96) is the model's EOS: greedy rows of this model reach it.
WORDY = specjax.Model(BASE.config, BASE.params, tiny_tokenizer(), name="tiny-wordy-finish")
EOS = WORDY.tokenizer.eos_token_id
PROMPTS = ["abc", "The sea", "x = 1", "Once upon", "def f(", "for i in"]


@pytest.fixture(scope="module")
def free():
    """Greedy output without stop options: (tokens, text) per row."""
    result = specjax.generate(WORDY, PROMPTS, max_new_tokens=MAX_NEW)
    return result.tokens, result.texts


def stop_options(free):
    """One Sampling per row, each ending its row in a different way, read off the free output."""
    tokens, texts = free
    assert EOS in tokens[0] and len(tokens[0]) < MAX_NEW, "row 0 should reach EOS by itself"
    assert EOS not in tokens[1] + tokens[2] + tokens[3] + tokens[4] + tokens[5]
    # row 1: a stop token id in the middle, at its first occurrence
    middle = tokens[1][8]
    # row 2: a stop string first found in the middle of the text
    string = next(texts[2][i : i + 3] for i in range(6, 15) if texts[2].find(texts[2][i : i + 3]) == i)
    # row 4: a stop token id that first occurs as the last allowed token
    last = tokens[4][-1]
    assert len(tokens[4]) == MAX_NEW and tokens[4].index(last) == MAX_NEW - 1
    # row 5: a stop string completed by the last allowed token, found nowhere before it
    ending = texts[5][-3:]
    assert len(tokens[5]) == MAX_NEW and texts[5].find(ending) == len(texts[5]) - 3
    return [
        specjax.Sampling(),  # EOS
        specjax.Sampling(stop_token_ids=[middle]),
        specjax.Sampling(stop=[string, "never-there"]),
        specjax.Sampling(),  # runs to max_new_tokens
        specjax.Sampling(stop_token_ids=[last]),
        specjax.Sampling(stop=ending),
    ]


def expected_end(tokens: list[int], sampling: specjax.Sampling) -> tuple[list[int], str]:
    """The free row cut at its first stop, by decoding each prefix: (tokens, finish reason)."""
    for n in range(1, len(tokens) + 1):
        text = WORDY.tokenizer.decode(tokens[:n], skip_special_tokens=True)
        if tokens[n - 1] in (EOS, *sampling.stop_token_ids) or any(s in text for s in sampling.stop):
            return tokens[:n], "stop"
    return tokens, "length"


@pytest.mark.parametrize("proposer", ["none", "target"])
def test_finish_reasons_per_row(free, proposer):
    samplings = stop_options(free)
    # The target drafting for itself accepts every draft, so stops land inside accepted drafts.
    chosen = None if proposer == "none" else specjax.DraftModel(WORDY, k=4)
    result = specjax.generate(WORDY, PROMPTS, proposer=chosen, sampling=samplings, max_new_tokens=MAX_NEW)
    expected = [expected_end(t, s) for t, s in zip(free[0], samplings, strict=True)]
    assert result.tokens == [tokens for tokens, _ in expected]
    assert result.finish_reasons == [reason for _, reason in expected]
    assert result.finish_reasons == ["stop", "stop", "stop", "length", "stop", "stop"]
    assert [len(t) for t in result.tokens[3:]] == [MAX_NEW] * 3  # the last three used every token


def test_finish_reasons_without_a_tokenizer():
    """Token-id prompts on a model without a tokenizer: EOS from the config, stop token ids."""
    plain = specjax.generate(BASE, [[1, 2, 3], [4, 5, 6]], max_new_tokens=12).tokens
    stopper = plain[0][4]
    eos = next(t for t in plain[1][2:] if t not in plain[0] and t not in plain[1][:2])
    model = specjax.Model(tiny_model(seed=11, eos_token_ids=(eos,)).config, BASE.params, name="tiny-eos")
    samplings = [specjax.Sampling(stop_token_ids=[stopper]), specjax.Sampling()]
    result = specjax.generate(model, [[1, 2, 3], [4, 5, 6]], sampling=samplings, max_new_tokens=12)
    assert result.texts is None
    assert result.tokens == [plain[0][: plain[0].index(stopper) + 1], plain[1][: plain[1].index(eos) + 1]]
    assert result.finish_reasons == ["stop", "stop"]
    assert specjax.generate(BASE, [[1, 2, 3]], max_new_tokens=5).finish_reasons == ["length"]


def test_a_stop_string_the_decoded_text_does_not_show():
    """A SentencePiece-style tokenizer drops the leading space of the first decoded token: a row
    whose first token "▁cat" completes the stop string " cat" (as the text reads after the prompt)
    stops there, though its returned text is "cat". With max_new_tokens=1 the stop is also the
    limit; the stop wins."""
    tokenizer = tiny_sentencepiece_tokenizer()
    base = tiny_model(vocab_size=len(tokenizer))
    model = specjax.Model(base.config, base.params, tokenizer, name="tiny-sentencepiece")
    cat = tokenizer.convert_tokens_to_ids("▁cat")
    forced = {cat: 100.0}  # the first token is "▁cat" whatever the random model says
    samplings = [
        specjax.Sampling(logit_bias=forced, stop=" cat"),
        specjax.Sampling(logit_bias=forced, stop=" mat"),
    ]
    result = specjax.generate(model, ["the", "the"], sampling=samplings, max_new_tokens=1)
    assert result.tokens == [[cat], [cat]]
    assert result.texts == ["cat", "cat"]
    assert result.finish_reasons == ["stop", "length"]
