"""Tiny random models shared by the tests (real weights are not the point there)."""

import jax

from specjax.models import LlamaConfig, Model, init_params


def tiny_config(**overrides) -> LlamaConfig:
    # An untied head gives logits of unit scale: distributions with some spread, unlike a tied
    # random model, which mostly predicts the token it was just fed.
    fields = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        eos_token_ids=(),
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> Model:
    config = tiny_config(**overrides)
    return Model(config, init_params(config, jax.random.key(seed)), name=f"tiny-{seed}")


def tiny_tokenizer():
    """A 97-token character tokenizer for tiny models: ids 0..94 are the printable ASCII
    characters, 95 is the two-character token "ab", 96 is "<eos>" (special). Decoding joins token
    texts, so stop strings can end inside a token or span several."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab |= {"ab": 95, "<eos>": 96}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


# A chat template for tiny_tokenizer (role tags around each message), so that chat=True prompts
# work on a tiny model.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# Pieces of the SentencePiece-style tokenizer below, besides its 256 byte tokens.
SENTENCEPIECE_WORDS = ["▁", "▁the", "▁cat", "▁sat", "▁on", "▁mat", "ing", "▁a", ".", ","] + [
    chr(c) for c in range(ord("a"), ord("z") + 1)
]


def tiny_sentencepiece_tokenizer():
    """A Llama-2-style tokenizer (SentencePiece unigram, byte fallback): "<unk>", "<s>", "</s>",
    the 256 byte tokens "<0x00>".."<0xFF>" (ids 3..258), then SENTENCEPIECE_WORDS. Words carry
    their leading space as "▁"; decoding drops the space of the first token, so the decode of a
    suffix of ids loses a space the whole sequence has, and characters outside the words are
    spelled in UTF-8 bytes, split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    # Longer pieces score higher, so "▁the" wins over "▁" + "t" + "h" + "e".
    vocab = [(p, 0.0) for p in special] + [(w, len(w) - 10.0) for w in SENTENCEPIECE_WORDS]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
