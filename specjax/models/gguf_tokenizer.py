"""The tokenizer of a llama.cpp `.gguf` file, rebuilt from its `tokenizer.ggml.*` metadata.

A GGUF has no `tokenizer.json`: llama.cpp's converter (convert_hf_to_gguf.py) stores the
vocabulary, the token types, the merges or scores, the special ids and the chat template as
metadata, and names the tokenizer with two keys. This module rebuilds each as the family's own
transformers tokenizer builds it from its `tokenizer.json` (the tests compare with those), with the
`tokenizers` library wrapped in `PreTrainedTokenizerFast`: transformers' own GGUF reader imports
torch, which specjax cannot depend on.

`tokenizer.ggml.model` "gpt2": byte-level BPE, vocabulary and merges stored, and
`tokenizer.ggml.pre` naming how text is split before the merges (`BYTE_LEVEL_SPLITS`):

    pre                               families                       split before byte-level BPE
    gpt2, gpt-2                       GPT-2 style                    GPT-2's regex
    smollm                            SmolLM, SmolLM2                every digit alone, then GPT-2's
    llama-bpe, llama3, llama-v3       Llama 3, 3.1, 3.2, 3.3         Llama 3's regex; whole words
                                                                     in the vocabulary skip merges
    qwen2, deepseek-r1-qwen           Qwen2, 2.5, 3, Qwen3-MoE,      NFC, then Qwen2's regex (one
                                      R1-Distill-Qwen                digit a piece)
    tekken                            Mistral Nemo, Mistral Small 3  Tekken's regex; whole words
                                                                     skip merges
    glm4                              GLM-4, GLM-4.5                 Llama 3's regex; whole words
                                                                     skip merges (no BOS)
    deepseek-v3                       DeepSeek-V3, R1                digits by threes, then runs
                                                                     of CJK and kana, then words
                                                                     (three regexes in turn)
    gpt-4o                            gpt-oss                        o200k's regex; whole words
                                                                     skip merges (tiktoken's rule)

`tokenizer.ggml.model` "llama": SentencePiece BPE with byte fallback (Llama 2, Mistral v0.1-v0.3,
Mixtral, Phi-3, Gemma 3; `tokenizer.ggml.pre` is "default" and says nothing). Spaces become "▁"
and the whole text is one word; pieces missing from the vocabulary fall back to `<0xXX>` bytes.
The file stores each piece's score but no merges: SentencePiece joins first the adjacent pair
whose union scores best, so every split of a piece into two pieces becomes a merge ranked by that
piece's score (Gemma: by its position, as transformers does; Gemma's scores do not follow its merge
order). Then, after `tokenizer.ggml.add_space_prefix` (true unless said otherwise):

- true: a "▁" is put before the text, as transformers' `LlamaTokenizer` does (only at its start,
  not after each special token, and not when it starts with a space: llama.cpp, like the older
  `legacy` tokenizers, puts one before every piece of text between special tokens); Phi-3 files
  (`general.architecture` phi3) get Phi-3's own normalizer, which always prepends one.
- false (Gemma): nothing is prepended. Gemma's files store its whitespace-run tokens with real
  spaces, which are spelled with "▁" again here.

Token types: control tokens (`<|im_end|>`, `<start_of_turn>`) stay whole and are special;
user-defined ones (`<think>`, Gemma's "\\n\\n") stay whole and are plain text, as llama.cpp
matches both in the text before splitting it. BOS and EOS are added after
`tokenizer.ggml.add_bos_token` / `add_eos_token`, or llama.cpp's default where the file has no
such key (BOS for "llama" vocabularies, llama-bpe and tekken). Decoding never cleans up spaces
(`clean_up_tokenization_spaces=False`), so decoding the encoding gives the text back.

Any other model or pre-tokenizer is an `UnsupportedTokenizer` naming it and what is supported;
`specjax.load(..., tokenizer=...)` takes the user's tokenizer instead.
"""

from __future__ import annotations

import dataclasses

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k (gpt-oss): Tekken's words, each with an optional contraction, digits by threes.
_O200K_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3: three splits in turn, digits by threes, runs of CJK ideographs and kana, then words.
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclasses.dataclass(frozen=True)
class ByteLevelSplit:
    """How a byte-level BPE family splits text before its merges."""

    splits: tuple[str, ...] = ()  # regexes split on in turn (matches kept); none: GPT-2's regex
    digits: bool = False  # first every digit alone (SmolLM)
    nfc: bool = False  # NFC-normalize the text first (Qwen2's tokenizer.json)
    ignore_merges: bool = False  # a word that is a token is that token, merges or not
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token key


_GPT2 = ByteLevelSplit()
_LLAMA3 = ByteLevelSplit((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = ByteLevelSplit((_QWEN2_SPLIT,), nfc=True)
# tokenizer.ggml.pre -> its split. (llama.cpp's "default", used when the key is missing, is not
# GPT-2's split, so it is not claimed here.)
BYTE_LEVEL_SPLITS: dict[str, ByteLevelSplit] = {
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": ByteLevelSplit(digits=True),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "tekken": ByteLevelSplit((_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    # GLM's tokenizer.json takes whole words from the vocabulary; llama.cpp merges them (other ids
    # where merges cannot reach a token, e.g. GLM-4.5's " 王").
    "glm4": ByteLevelSplit((_LLAMA3_SPLIT,), ignore_merges=True),
    "deepseek-v3": ByteLevelSplit(_DEEPSEEK3_SPLITS),
    "gpt-4o": ByteLevelSplit((_O200K_SPLIT,), ignore_merges=True),
}
SUPPORTED_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model
_NO_VOCABULARY = ("none", "no_vocab")  # llama.cpp's names for a file without a tokenizer
# Architectures whose SentencePiece merges follow the vocabulary's order, not its scores.
_MERGES_BY_POSITION = ("gemma", "gemma2", "gemma3", "gemma3n")
_SPACE = "\u2581"  # SentencePiece's "▁"


class UnsupportedTokenizer(ValueError):
    """A GGUF's tokenizer that this module does not rebuild."""


def tokenizer_from_gguf(metadata):
    """A `transformers.PreTrainedTokenizerFast` from a GGUF's metadata, or None when it has no
    tokenizer. `metadata` reads keys (`get`, `require`) and names its file (`path`).

    UnsupportedTokenizer for a tokenizer model or pre-tokenizer not in `SUPPORTED_MODELS` /
    `BYTE_LEVEL_SPLITS`."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind is None or kind in _NO_VOCABULARY:
        return None
    pre = metadata.get("tokenizer.ggml.pre")
    if kind == "gpt2" and pre in BYTE_LEVEL_SPLITS:
        return _byte_level(metadata, BYTE_LEVEL_SPLITS[pre])
    if kind == "llama":
        return _sentencepiece(metadata)
    what = f"tokenizer.ggml.pre {pre!r}" if kind == "gpt2" else f"tokenizer.ggml.model {kind!r}"
    raise UnsupportedTokenizer(
        f"GGUF file {metadata.path}: its tokenizer ({what}) is not supported; supported: "
        f"tokenizer.ggml.model 'llama' (SentencePiece), or 'gpt2' (byte-level BPE) with "
        f"tokenizer.ggml.pre one of {', '.join(BYTE_LEVEL_SPLITS)}. Pass the model's own tokenizer "
        "instead: specjax.load(path, tokenizer=transformers.AutoTokenizer.from_pretrained(...))"
    )


def _byte_level(metadata, split: ByteLevelSplit):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tokens = metadata.require("tokenizer.ggml.tokens")
    merges = [_merge(m) for m in metadata.require("tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split.ignore_merges))
    if split.nfc:
        backend.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split.digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in split.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not split.splits))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return _wrapped(metadata, backend, tokens, _token_types(metadata, tokens), split.add_bos)


def _merge(merge: str) -> tuple[str, str]:
    """ "a b" -> ("a", "b"). The first character is never the separator (llama.cpp's reading), so a
    merge of a space token (SentencePiece-style vocabularies) still splits right."""
    cut = merge.index(" ", 1)
    return merge[:cut], merge[cut + 1 :]


def _sentencepiece(metadata):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    stored_tokens = metadata.require("tokenizer.ggml.tokens")
    tokens, types = _respelled_spaces(stored_tokens, _token_types(metadata, stored_tokens))
    stored = metadata.get("tokenizer.ggml.merges")
    if stored is not None:
        merges = [_merge(m) for m in stored]
    elif metadata.get("general.architecture") in _MERGES_BY_POSITION:
        merges = merges_from_ranks(tokens, types, range(len(tokens)))
    else:
        scores = metadata.require("tokenizer.ggml.scores")
        merges = merges_from_ranks(tokens, types, [-float(s) for s in scores])
    unk = _token(metadata, tokens, "tokenizer.ggml.unknown_token_id")
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if not metadata.get("tokenizer.ggml.add_space_prefix", True):
        # Gemma's tokenizer: spaces become "▁" and nothing is prepended. (Its split on " " finds
        # none after the normalizer; it is kept to be the same pipeline.)
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif metadata.get("general.architecture") == "phi3":
        # Phi-3's tokenizer.json: a "▁" before every piece of text, even one that starts with a space.
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)]
        )
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
        decode.append(decoders.Strip(" ", 1, 0))  # the prepended space
    backend.decoder = decoders.Sequence(decode)
    return _wrapped(metadata, backend, tokens, types, add_bos_default=True)


def _respelled_spaces(tokens: list[str], types: list[int]) -> tuple[list[str], list[int]]:
    """Whitespace runs stored with real spaces (the converter writes Gemma's user-defined "▁▁"
    tokens so) spelled with "▁" again, as ordinary pieces that merges reach, as in the family's
    tokenizer.json."""
    stored = set(tokens)
    tokens, types = list(tokens), list(types)
    for i, token in enumerate(tokens):
        respelled = _SPACE * len(token)
        if token and not token.strip(" ") and respelled not in stored:
            tokens[i] = respelled
            types[i] = NORMAL if types[i] == USER_DEFINED else types[i]
    return tokens, types


def merges_from_ranks(tokens: list[str], types: list[int], ranks) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges, best first: every split of a piece into two pieces, ranked by
    the piece's rank (lower first; ties by position). Control, byte, unknown and unused tokens
    are never the result of a merge."""
    index = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for position, (token, kind, rank) in enumerate(zip(tokens, types, ranks, strict=True)):
        if kind not in (NORMAL, USER_DEFINED):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in index and right in index:
                ranked.append((rank, position, cut, left, right))
    ranked.sort(key=lambda merge: merge[:3])
    return [(left, right) for *_, left, right in ranked]


def _token_types(metadata, tokens: list[str]) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    return [NORMAL] * len(tokens) if types is None else [int(t) for t in types]


def _token(metadata, tokens: list[str], key: str) -> str | None:
    index = metadata.get(key)
    return None if index is None or not 0 <= int(index) < len(tokens) else tokens[int(index)]


def _wrapped(metadata, backend, tokens: list[str], types: list[int], add_bos_default: bool):
    """The backend with the file's special tokens, BOS/EOS rule and chat template, as a
    `PreTrainedTokenizerFast`."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    kinds = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in kinds if k == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in kinds if k == USER_DEFINED]
    )

    bos = _token(metadata, tokens, "tokenizer.ggml.bos_token_id")
    eos = _token(metadata, tokens, "tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:

        def template(segment: str, type_id: int) -> list[str]:
            return (
                ([f"{bos}:{type_id}"] if add_bos else [])
                + [f"${segment}:{type_id}"]
                + ([f"{eos}:{type_id}"] if add_eos else [])
            )

        specials = [(t, tokens.index(t)) for t, used in ((bos, add_bos), (eos, add_eos)) if used]
        backend.post_processor = processors.TemplateProcessing(
            single=template("A", 0), pair=template("A", 0) + template("B", 1), special_tokens=specials
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token(metadata, tokens, "tokenizer.ggml.unknown_token_id"),
        pad_token=_token(metadata, tokens, "tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
