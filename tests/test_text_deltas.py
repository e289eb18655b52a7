"""specjax.TextDeltas: streamed text deltas whose concatenation is the decoded text cut before
the first stop string, for any chunking of the ids, on a byte-level BPE tokenizer (SmolLM2's),
a SentencePiece-style one with byte fallback and a character tokenizer."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import tiny_sentencepiece_tokenizer, tiny_tokenizer

import specjax
from specjax.speculate.stops import cut_text

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café crème, naïve façade, Ærøskøbing, señor, Zürich.",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "Emoji 🚀🎉 family 👩‍👩‍👧 flag 🇫🇷 and ✓ marks",
    "def f(x):\n    return  x\t\t+ 1\n\n\n    # trailing   \n",
    "the cat sat on the mat, the mat sat on the cat.",
    "ab aab abab ba",
]


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    return {
        "smollm2": smollm2.tokenizer,
        "sentencepiece": tiny_sentencepiece_tokenizer(),
        "characters": tiny_tokenizer(),
    }


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream(tokenizer, chunks, stop=()) -> tuple[list[str], list[int], specjax.TextDeltas]:
    """Push every chunk, then finish: (the deltas, the ids pushed until the stream stopped, the
    TextDeltas). Pushes after a stop must yield nothing."""
    deltas, pushed = specjax.TextDeltas(tokenizer, stop), []
    out = []
    for chunk in chunks:
        was_stopped = deltas.stopped
        out.append(deltas.push(chunk))
        if was_stopped:
            assert out[-1] == "", "text yielded after a stop"
        else:
            pushed += chunk
    out.append(deltas.finish())
    return out, pushed, deltas


@st.composite
def streams(draw, tokenizer):
    """(chunks of ids, stop strings): a text's ids with special tokens put in, cut into chunks."""
    text = draw(st.one_of(st.sampled_from(TEXTS), st.text(max_size=30)))
    text += draw(st.sampled_from(["", " ", "\n", "猫", "é"])) + draw(st.sampled_from(TEXTS))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    for _ in range(draw(st.integers(0, 3))):
        ids.insert(draw(st.integers(0, len(ids))), draw(st.sampled_from(tokenizer.all_special_ids)))
    chunks, i = [], 0
    while i < len(ids):
        size = draw(st.integers(1, 6))
        chunks.append(ids[i : i + size])
        i += size
    full = decode(tokenizer, ids)
    stops = []
    for _ in range(draw(st.integers(0, 2))):
        if full and draw(st.booleans()):  # a piece of the text: it ends mid-token or spans tokens
            start = draw(st.integers(0, len(full) - 1))
            stops.append(full[start : start + draw(st.integers(1, 5))])
        else:
            stops.append(draw(st.text(min_size=1, max_size=3)))
    return chunks, stops


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece", "characters"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_deltas_join_to_the_cut_decoded_text(tokenizers, name, data):
    tokenizer = tokenizers[name]
    chunks, stops = data.draw(streams(tokenizer))
    out, pushed, deltas = stream(tokenizer, chunks, stops)
    whole = decode(tokenizer, pushed)
    assert "".join(out) == cut_text(whole, stops)
    assert deltas.stopped == any(s in whole for s in stops)
    if not deltas.stopped:
        assert pushed == [t for c in chunks for t in c]


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece", "characters"])
def test_deltas_of_every_chunking_of_the_texts(tokenizers, name):
    """Every text, one id at a time and all at once, with and without stops."""
    tokenizer = tokenizers[name]
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        full = decode(tokenizer, ids)
        for chunks in ([[t] for t in ids], [ids]):
            assert "".join(stream(tokenizer, chunks)[0]) == full
            for stop in (full[len(full) // 2 : len(full) // 2 + 2], full[-1], "never there"):
                out, pushed, _ = stream(tokenizer, chunks, stop)
                assert "".join(out) == cut_text(decode(tokenizer, pushed), [stop])


def test_a_split_character_is_held_until_whole(tokenizers):
    for name in ("smollm2", "sentencepiece"):
        tokenizer = tokenizers[name]
        ids = tokenizer("a 猫🚀 b", add_special_tokens=False)["input_ids"]
        out = stream(tokenizer, [[t] for t in ids])[0]
        assert "".join(out) == decode(tokenizer, ids) and not any("\ufffd" in d for d in out)
        # each character yielded whole, by the push of its last byte
        assert any("猫" in d for d in out) and any("🚀" in d for d in out), (name, out)
        assert out.count("") >= 2, (name, out)  # the pushes of the first bytes yielded nothing


def test_an_incomplete_character_at_the_end_comes_from_finish(tokenizers):
    tokenizer = tokenizers["smollm2"]
    ids = tokenizer("ab 猫", add_special_tokens=False)["input_ids"][:-1]  # the last byte missing
    deltas = specjax.TextDeltas(tokenizer)
    pushed = [deltas.push([t]) for t in ids]
    end = deltas.finish()
    assert end.endswith("\ufffd") and "".join(pushed) + end == decode(tokenizer, ids)
    assert "".join(pushed) == "ab"


def test_a_sentencepiece_space_survives_chunking(tokenizers):
    """Decoding a suffix of SentencePiece ids drops its leading space; the deltas keep it, also
    after special tokens (skipped) and after a lone "▁"."""
    tokenizer = tokenizers["sentencepiece"]
    the, cat, sat, space, eos = tokenizer.convert_tokens_to_ids(["▁the", "▁cat", "▁sat", "▁", "</s>"])
    assert decode(tokenizer, [cat]) == "cat"  # what decoding each chunk alone would give
    assert stream(tokenizer, [[the], [cat], [sat]])[0] == ["the", " cat", " sat", ""]
    assert stream(tokenizer, [[the], [eos], [cat]])[0] == ["the", "", " cat", ""]
    assert "".join(stream(tokenizer, [[the], [space], [cat]])[0]) == "the  cat"
    assert stream(tokenizer, [[eos], [cat], [sat]])[0] == ["", "cat", " sat", ""]


def test_stop_strings_in_and_across_tokens(tokenizers):
    """The character tokenizer's "ab" is one token: a stop can end inside it or span it."""
    tokenizer = tokenizers["characters"]
    x, ab, y = tokenizer.convert_tokens_to_ids(["x", "ab", "y"])
    # "a" ends inside "ab": the token that completes it is "ab", and its "b" is never yielded
    assert stream(tokenizer, [[x], [ab], [y]], stop="a")[0] == ["x", "", "", ""]
    # "by" spans "ab" and "y": "b" is held back until "y" decides
    out, _, deltas = stream(tokenizer, [[x], [ab], [y], [x]], stop="by")
    assert out == ["x", "a", "", "", ""] and deltas.stopped
    out, _, deltas = stream(tokenizer, [[x], [ab], [x]], stop="by")
    assert out == ["x", "a", "bx", ""] and not deltas.stopped


def test_text_that_may_begin_a_stop_is_held_back(tokenizers):
    tokenizer = tokenizers["characters"]

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    deltas = specjax.TextDeltas(tokenizer, stop=["<|end|>", "STOP"])
    assert [deltas.push(ids(t)) for t in ("Hi <", "|e", "nx ", "ST", "O")] == ["Hi ", "", "<|enx ", "", ""]
    assert deltas.finish() == "STO"  # the end of the stream: held text can no longer become a stop
    deltas = specjax.TextDeltas(tokenizer, stop=["<|end|>", "STOP"])
    assert [deltas.push(ids(t)) for t in ("Hi <", "|end|", "> more")] == ["Hi ", "", ""]
    assert deltas.stopped and deltas.finish() == ""


def test_a_tokenizer_that_cleans_up_spaces_streams_its_text_without_it():
    """Cleaning up " ." to "." after decoding rewrites text already streamed ("a " then "."):
    the deltas are the text as decoded without the clean-up, and none is lost."""
    tokenizer = tiny_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("a . b , c", add_special_tokens=False)["input_ids"]
    assert decode(tokenizer, ids) == "a. b, c"
    assert "".join(stream(tokenizer, [[t] for t in ids])[0]) == "a . b , c"


class CountingTokenizer:
    """A tokenizer that records the length of every id list it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.lengths = tokenizer, []

    def decode(self, ids, **options):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **options)


def test_each_push_decodes_a_short_window(tokenizers):
    """Linear cost: a long stream pushed one id at a time never decodes more than a few ids at
    once (decoding everything at every push would grow with the stream)."""
    counting = CountingTokenizer(tokenizers["smollm2"])
    ids = counting.tokenizer(" ".join(TEXTS) * 20, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2000
    out = stream(counting, [[t] for t in ids], stop="never there")[0]
    assert "".join(out) == decode(counting.tokenizer, ids)
    # the widest window: a 4-byte emoji's ids and the chunk before it
    assert max(counting.lengths[:-1]) <= 8 and sum(counting.lengths) < 8 * len(ids)


def test_bad_arguments(tokenizers):
    tokenizer = tokenizers["characters"]
    for stop in ("", [""], [3], None):
        with pytest.raises(
            ValueError, match="stop must be a non-empty string or a list of non-empty strings"
        ):
            specjax.TextDeltas(tokenizer, stop)
    deltas = specjax.TextDeltas(tokenizer)
    deltas.finish()
    with pytest.raises(RuntimeError, match="push after finish"):
        deltas.push([1])


def test_streamed_rows_read_as_generate_returns_them():
    """A generation's tokens streamed in chunks read as its returned texts, stops included."""
    from tiny import tiny_model

    base = tiny_model(seed=11)
    model = specjax.Model(base.config, base.params, tiny_tokenizer(), name="tiny-wordy-deltas")
    stops = ["d;", "=*", "never there"]
    prompts = ["Once upon", "abc", "x = 1"]
    result = specjax.generate(model, prompts, sampling=specjax.Sampling(stop=stops), max_new_tokens=20)
    assert result.finish_reasons[0] == "stop" and result.texts[0] != decode(model.tokenizer, result.tokens[0])
    for tokens, text in zip(result.tokens, result.texts, strict=True):
        chunks = [tokens[i : i + 3] for i in range(0, len(tokens), 3)]
        assert "".join(stream(model.tokenizer, chunks, stops)[0]) == text
