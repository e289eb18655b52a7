"""The tokenizers of GGUF files, family by family, against the family's own transformers tokenizer.

Each family's tokenizer is built here as its `tokenizer.json` defines it (pre-tokenizer regex,
normalizer, decoder, special tokens, BOS rule, chat template) over a tiny vocabulary trained with
the `tokenizers` library on the text below, through transformers' class for the family where
transformers 5 rebuilds that family from its class (Qwen2Tokenizer, LlamaTokenizer,
GemmaTokenizer). It is then written into a GGUF the way llama.cpp's converter writes it
(convert_hf_to_gguf.py: `tokenizer.ggml.model` "gpt2" with the vocabulary, token types and merges,
or "llama" with SentencePiece pieces, scores and types; special ids, add_bos/add_eos, the chat
template), with a tiny model of the family's architecture, and loaded with `specjax.load` (the
tokenizer alone for Phi-3, GLM-4.5, DeepSeek-V3 and gpt-oss, whose GGUF models have their own
tests). The rebuilt tokenizer must give the reference's ids on varied text (unicode, CJK, emoji,
code, whitespace runs, numbers, special tokens in the text), decode as it does, add BOS/EOS as it
does, and render chat messages to the same ids, from the GGUF and again from specjax's cache."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer
from transformers import GemmaTokenizer, LlamaTokenizer, PreTrainedTokenizerFast, Qwen2Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter
from transformers.tokenization_utils_base import generate_merges

import specjax
from specjax.models import gguf_loader

REPO = Path(__file__).resolve().parent.parent
SPACE = "\u2581"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Speculative decoding drafts several tokens and verifies them with one pass of the target.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < count; ++i) {\n\tsum += values[i];\n}\n",
    'import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)\nprint(x.shape, "done")\n',
    "They're here, we've gone, I'll stay, you'd know, it's fine, don't worry, I'm sure.",
    "Numbers: 123 4567 89012 3.14159 2024-01-01 1,000,000 0x1F 1e-5 42 and 7 and 365 days.",
    "Héllo wörld, naïve café, résumé, façade; Ελληνικά και русский текст, 日本語のテキスト, 中文文本.",
    "THE UPPER CASE TEXT and MixedCase words like JavaScript, iPhone, McDonald and HTTPServer.",
    "    indented four spaces\n        eight spaces\n\n\nthree newlines and a tab\there.",
    '<div class="note">&amp; some HTML</div> {"key": [1, 2, 3], "nested": {"a": null}}',
    "Questions? Answers! Lists: a, b, c. Paths: /usr/local/bin and C:\\Windows\\System32.",
    "the the the and and and of of of to to to in in in is is is that that that with with",
    "model models modeling modelled token tokens tokenizer tokenization decode decoding decoder",
] * 3

TEXTS = [
    "",
    "Hello world! How are you today?",
    "  two leading spaces, trailing space \t tab\n\n\nthree newlines\r\nCRLF ",
    " one leading space",
    "don't won't I'll WE'RE they've y'all",
    "Numbers: 3.14159, 1,000,000, 2024-01-01, 0x1F, 1e-5 and 12345678901234567890.",
    "Unicode: héllo wörld naïve café, 日本語のテキスト, 中文, Ελληνικά, русский, العربية, हिन्दी",
    "Emoji 🙂👍🏽 👨‍👩‍👧 and combining e\u0301 and zero\u200bwidth, ＦＵＬＬＷＩＤＴＨ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tfor (int i = 0; i < n; ++i) {\n\t\tx[i] = y[i] * 2;\n\t}\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}  <div class="x">&amp;</div>',
    "speculative decoding verifies the drafted tokens",
    "a      b\n \n  \n\n\n\n\n\nc",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain rotary embeddings in 日本語."},
    ],
    [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall, quietly\nthe pond holds the autumn sky"},
        {"role": "user", "content": "  Another, with code: `x = 1`\n\n"},
    ],
]

# Chat templates in the shape of each family's own (condensed: the tests need their tokens).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_CHAT = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}[INST] {{ ns.system }}{{ m['content'] }}[/INST]{% set ns.system = '' %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
TEKKEN_CHAT = MISTRAL_CHAT.replace("[INST] ", "[INST]")
GEMMA_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else "
    "m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GLM_CHAT = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEEPSEEK_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
HARMONY_CHAT = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
PHI3_CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}{{ eos_token if false }}"
)


# ---------------------------------------------------------------------------------------------
# Tiny vocabularies


def train_bpe(pre_tokenizer, vocab_size: int, alphabet: list[str], normalizer=None) -> tuple[dict, list]:
    """(vocab, merges) of a BPE trained on CORPUS with this pre-tokenizer."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


# Merges a byte-level family's split must keep from applying: across digits (families that split
# off every digit), across a lower-to-upper case change (Tekken, o200k) and between a space and a
# CJK character (DeepSeek-V3: "æ" begins 日's bytes). Appended to every byte-level vocabulary, they
# make a wrong split give other ids.
CROSSING_MERGES = [("1", "2"), ("a", "S"), ("Ġ", "1"), ("Ġ", "æ")]


def byte_level_vocab(pre_tokenizer, specials: list[str], extra: tuple[str, ...] = ()) -> tuple[dict, list]:
    """A byte-level BPE's vocabulary and merges (and CROSSING_MERGES), then `extra` tokens with
    no merge that makes them (reached only by a tokenizer that takes whole words from the
    vocabulary: ignore_merges), then `specials`."""
    vocab, merges = train_bpe(pre_tokenizer, 520, pre_tokenizers.ByteLevel.alphabet())
    merges += [m for m in CROSSING_MERGES if m[0] + m[1] not in vocab]
    for token in [a + b for a, b in merges[-len(CROSSING_MERGES) :]] + [*extra, *specials]:
        vocab.setdefault(token, len(vocab))
    return vocab, merges


def sentencepiece_vocab(
    head: list[str], tail: list[str], reorder: bool = False
) -> tuple[list[str], list[float], list[str]]:
    """SentencePiece-style pieces: `head` (special tokens), the 256 `<0xXX>` bytes, the learned
    pieces best first (`reorder`: in the opposite order, their scores unchanged, so that only
    scores say which merge comes first), the single characters, then `tail` (added tokens).
    Returns (pieces, scores, kinds) with SentencePiece's scores: 0 for special and byte pieces,
    minus the rank otherwise."""
    space = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    alphabet = sorted(
        {c for line in CORPUS for c in line.replace(" ", SPACE) if ord(c) < 0x3000} - {"\n", "\t"}
    )
    vocab, merges = train_bpe(space, 460, alphabet)
    learned = [a + b for a, b in merges if a + b not in tail]
    chars = [c for c in vocab if len(c) == 1]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    ranks = [-float(i) for i in range(len(learned))]
    if reorder:
        learned, ranks = learned[::-1], ranks[::-1]
    pieces = head + bytes_ + learned + chars
    scores = [0.0] * (len(head) + 256) + ranks + [-float(len(learned) + i) for i in range(len(chars))]
    kinds = ["special"] * len(head) + ["byte"] * 256 + ["normal"] * (len(learned) + len(chars))
    return pieces + tail, scores + [0.0] * len(tail), kinds + ["added"] * len(tail)


# ---------------------------------------------------------------------------------------------
# Each family's transformers tokenizer, and what the converter writes for it


@dataclasses.dataclass
class Family:
    name: str
    arch: str  # general.architecture of its GGUF (a tiny model of it too, unless TOKENIZER_ONLY)
    reference: PreTrainedTokenizerFast
    model: str  # tokenizer.ggml.model
    pre: str  # tokenizer.ggml.pre
    specials_in_text: str  # text with the family's special and added tokens
    scores: list[float] | None = None  # SentencePiece vocabularies: the pieces' scores
    write_add_bos: bool = True  # write tokenizer.ggml.add_bos_token (older files lack it)
    extra: dict = dataclasses.field(default_factory=dict)  # more tokenizer.ggml.* keys


def added(tokens, special: bool) -> list[AddedToken]:
    return [AddedToken(t, special=special, normalized=False) for t in tokens]


def split_then_bytes(*regexes: str):
    """A tokenizer.json pre-tokenizer: Split (isolated) on each regex in turn, then ByteLevel."""
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def byte_level_reference(
    split,
    specials: list[str],
    *,
    user_defined: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    ignore_merges: bool = False,
    add_bos: bool = False,
    **special_tokens,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE family's tokenizer.json over a tiny vocabulary: `split` before the merges,
    `specials` special, `user_defined` added but not special, BOS added when `add_bos`.
    `special_tokens`: bos_token, eos_token... and chat_template."""
    vocab, merges = byte_level_vocab(split, specials + list(user_defined), extra=extra)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = split
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(added(specials, True))
    backend.add_tokens(added(user_defined, False))
    if add_bos:
        bos = special_tokens["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, vocab[bos])]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_tokens)


def llama3() -> Family:
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    # Llama 3's split, as transformers' tiktoken conversion writes it by default
    regex = inspect.signature(TikTokenConverter).parameters["pattern"].default
    reference = byte_level_reference(
        split_then_bytes(regex),
        specials,
        extra=("Ġspeculative", "Ġverifies"),
        ignore_merges=True,
        add_bos=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_CHAT,
    )
    text = (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|> <|eot_id <|end_of_text|>"
    )
    return Family("llama3", "llama", reference, "gpt2", "llama-bpe", text)


def qwen(name: str, arch: str) -> Family:
    qwen_split = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}).backend_tokenizer
    vocab, merges = byte_level_vocab(
        qwen_split.pre_tokenizer, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    )
    reference = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    reference.add_special_tokens({"additional_special_tokens": added(["<|im_start|>", "<|im_end|>"], True)})
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<|endoftext|> <|im_end"
    if name == "qwen3":  # Qwen3's thinking tags: added tokens, not special
        reference.add_tokens(added(["<think>", "</think>"], False))
        text += "<think>\nhmm\n</think>\n\n4"
    reference.chat_template = CHATML
    return Family(name, arch, reference, "gpt2", "qwen2", text)


def smollm2() -> Family:
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    reference = byte_level_reference(
        split,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=CHATML,
    )
    return Family("smollm2", "llama", reference, "gpt2", "smollm", "<|im_start|>user\nhi 123<|im_end|>\n")


def mistral_nemo() -> Family:
    # Tekken: as transformers converts Mistral's tekken.json (TikTokenConverter: whole words in the
    # vocabulary skip merges), with BOS added.
    regex = (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
        r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    reference = byte_level_reference(
        split_then_bytes(regex),
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        extra=("Ġspeculative", "Ġverifies"),
        ignore_merges=True,
        add_bos=True,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=TEKKEN_CHAT,
    )
    return Family("mistral-nemo", "llama", reference, "gpt2", "tekken", "<s>[INST]Hi[/INST]Hello</s> [INST")


def glm45() -> Family:
    """GLM-4.5's tokenizer.json: Llama 3's split, whole words in the vocabulary skip merges (llama.cpp
    merges them: its ids differ where merges cannot reach a token). Its converter writes [gMASK] as
    BOS and no add_bos_token: the chat template writes "[gMASK]<sop>" itself."""
    regex = inspect.signature(TikTokenConverter).parameters["pattern"].default
    specials = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>"]
    specials += ["<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
    reference = byte_level_reference(
        split_then_bytes(regex),
        specials,
        user_defined=("<think>", "</think>"),
        extra=("Ġspeculative", "Ġverifies"),
        ignore_merges=True,
        bos_token="[gMASK]",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=GLM_CHAT,
    )
    text = "[gMASK]<sop><|user|>\nhi<|assistant|>\n<think>\nhmm</think>\n42<|endoftext|> [gMASK"
    return Family("glm4.5", "glm4moe", reference, "gpt2", "glm4", text, write_add_bos=False)


def deepseek_v3() -> Family:
    """DeepSeek-V3's tokenizer.json: three Split regexes in turn (copied from its text), BOS added;
    its User/Assistant markers are added tokens that are not special."""
    splits = [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ]
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    reference = byte_level_reference(
        split_then_bytes(*splits),
        [bos, eos],
        user_defined=("<｜User｜>", "<｜Assistant｜>"),
        add_bos=True,
        bos_token=bos,
        eos_token=eos,
        chat_template=DEEPSEEK_CHAT,
    )
    text = f"{bos}<｜User｜>2+2=? 日本語のテキスト<｜Assistant｜>4{eos} <｜User"
    return Family("deepseek-v3", "deepseek2", reference, "gpt2", "deepseek-v3", text)


def gpt_oss() -> Family:
    """gpt-oss's tokenizer.json: tiktoken's o200k split (its pieces as tiktoken writes them), whole
    words in the vocabulary skip merges (TikTokenConverter), no BOS."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    contraction = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    regex = "|".join(
        [
            rf"[^\r\n\p{{L}}\p{{N}}]?{upper}*{lower}+{contraction}",
            rf"[^\r\n\p{{L}}\p{{N}}]?{upper}+{lower}*{contraction}",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    )
    specials = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>"]
    specials += ["<|start|>", "<|end|>", "<|message|>", "<|call|>"]
    reference = byte_level_reference(
        split_then_bytes(regex),
        specials,
        extra=("Ġspeculative", "Ġverifies"),
        ignore_merges=True,
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
        pad_token="<|endoftext|>",
        chat_template=HARMONY_CHAT,
    )
    text = "<|start|>user<|message|>What's 2+2?<|end|><|start|>assistant<|channel|>final<|message|>4"
    text += "<|return|> <|end"
    return Family("gpt-oss", "gpt-oss", reference, "gpt2", "gpt-4o", text, write_add_bos=False)


def sentencepiece_family(name: str, arch: str) -> Family:
    """Mistral v0.3 (also Mixtral's and Llama 2's shape) and Phi-3: LlamaTokenizer's pipeline,
    Phi-3's with its own normalizer. The reference's merges are transformers' own from the
    pieces' scores (what its SentencePiece conversion wrote into tokenizer.json)."""
    if name == "phi3":
        head, added_specials = (
            ["<unk>", "<s>", "</s>"],
            ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        )
    else:
        head, added_specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], []
    pieces, scores, kinds = sentencepiece_vocab(head, added_specials, reorder=True)
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = generate_merges(
        vocab, {p: s for p, s, k in zip(pieces, scores, kinds, strict=True) if k == "normal"}
    )
    reference = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    reference.add_special_tokens({"additional_special_tokens": added(head[3:] + added_specials, True)})
    if name == "phi3":
        backend = reference.backend_tokenizer
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
        backend.pre_tokenizer = None
        reference.eos_token = "<|endoftext|>"
        reference.chat_template = PHI3_CHAT
        text = "<|user|>\nHi there<|end|>\n<|assistant|>\n <|end|> <|end"
    else:
        reference.chat_template = MISTRAL_CHAT
        text = "<s>[INST] Hi [/INST] Hello</s>[INST]x[/INST] [INST"
    return Family(
        name, arch, reference, "llama", "default", text, scores=scores, write_add_bos=name == "phi3"
    )


def gemma3() -> Family:
    """GemmaTokenizer, its merges in the vocabulary's order (as transformers rebuilds Gemma's)."""
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces, scores, kinds = sentencepiece_vocab(head, ["\n\n", "\n\n\n", SPACE * 2, SPACE * 4, "<table>"])
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = generate_merges(vocab, {p: -float(i) for i, p in enumerate(pieces)})
    reference = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True)
    reference.add_special_tokens({"additional_special_tokens": added(head[5:], True)})
    reference.add_tokens(added(["\n\n", "\n\n\n", SPACE * 2, SPACE * 4, "<table>"], False))
    reference.chat_template = GEMMA_CHAT
    text = "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    text += "<table>  x    y\n\n\n\nz<eos> <end_of"
    return Family(
        "gemma3",
        "gemma3",
        reference,
        "llama",
        "default",
        text,
        scores=scores,
        extra={"add_space_prefix": False},
    )


FAMILIES: dict[str, Callable[[], Family]] = {
    "llama3": llama3,
    "qwen2": lambda: qwen("qwen2", "qwen2"),
    "qwen3": lambda: qwen("qwen3", "qwen3"),
    "smollm2": smollm2,
    "mistral-nemo": mistral_nemo,
    "mistral-v0.3": lambda: sentencepiece_family("mistral-v0.3", "llama"),
    "phi3": lambda: sentencepiece_family("phi3", "phi3"),
    "gemma3": gemma3,
    "glm4.5": glm45,
    "deepseek-v3": deepseek_v3,
    "gpt-oss": gpt_oss,
}


# ---------------------------------------------------------------------------------------------
# Writing the GGUF as llama.cpp's converter does


def looks_special(token: str) -> bool:
    """The converter's test for added tokens it marks control although not flagged special."""
    return (
        token in ("<pad>", "<mask>")
        or (token.startswith("<|") and token.endswith("|>"))
        or token.startswith("<unused")
    )


def tokenizer_fields(family: Family) -> list[tuple[str, object, gguf.GGUFValueType]]:
    """The `tokenizer.*` metadata the converter writes for this tokenizer."""
    reference = family.reference
    by_id = {i: t for t, i in reference.get_vocab().items()}
    added_tokens = reference.added_tokens_decoder
    tokens, types = [], []
    for i in range(max(by_id) + 1):
        token = by_id.get(i, f"[PAD{i}]")
        if i not in by_id:
            kind = gguf.TokenType.UNUSED
        elif i in added_tokens and (added_tokens[i].special or looks_special(token)):
            kind = gguf.TokenType.CONTROL
        elif i in added_tokens:
            kind = gguf.TokenType.USER_DEFINED
            token = token.replace(SPACE, " ")  # the converter's spelling of user-defined spaces
        elif family.model == "llama" and token.startswith("<0x") and len(token) == 6:
            kind = gguf.TokenType.BYTE
        elif family.model == "llama" and token == reference.unk_token:
            kind = gguf.TokenType.UNKNOWN
        elif family.model == "llama" and token in ("<s>", "</s>"):
            kind = gguf.TokenType.CONTROL
        else:
            kind = gguf.TokenType.NORMAL
        tokens.append(token)
        types.append(int(kind))
    A, S = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType
    fields = [
        ("tokenizer.ggml.model", family.model, S.STRING),
        ("tokenizer.ggml.pre", family.pre, S.STRING),
        ("tokenizer.ggml.tokens", tokens, A),
        ("tokenizer.ggml.token_type", types, A),
    ]
    if family.scores is not None:
        fields.append(
            ("tokenizer.ggml.scores", family.scores + [-1000.0] * (len(tokens) - len(family.scores)), A)
        )
    else:
        merges = json.loads(reference.backend_tokenizer.to_str())["model"]["merges"]
        fields.append(
            ("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in merges], A)
        )
    for key, token_id in (
        ("bos", reference.bos_token_id),
        ("eos", reference.eos_token_id),
        ("unknown", reference.unk_token_id),
        ("padding", reference.pad_token_id),
    ):
        if token_id is not None:
            fields.append((f"tokenizer.ggml.{key}_token_id", token_id, S.UINT32))
    empty = reference("", add_special_tokens=True)["input_ids"]
    if family.write_add_bos:
        fields.append(("tokenizer.ggml.add_bos_token", reference.bos_token_id in empty, S.BOOL))
        fields.append(
            ("tokenizer.ggml.add_eos_token", bool(empty) and empty[-1] == reference.eos_token_id, S.BOOL)
        )
    for key, value in family.extra.items():
        fields.append((f"tokenizer.ggml.{key}", value, S.BOOL))
    fields.append(("tokenizer.chat_template", reference.chat_template, S.STRING))
    return fields


D, F, HEADS, HEAD_DIM = 16, 32, 2, 8
# Architectures whose tests write no tiny model (its GGUF loading is tests/test_gguf_families.py's).
TOKENIZER_ONLY = ("phi3", "glm4moe", "deepseek2", "gpt-oss")


def tiny_tensors(arch: str, vocab_size: int) -> dict[str, np.ndarray]:
    """One random layer of `arch` (2 heads of 8, one kv head), tied embeddings."""
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    tensors = {"token_embd.weight": rand(vocab_size, D), "output_norm.weight": np.ones(D, np.float32)}
    layer = {
        "attn_norm.weight": np.ones(D, np.float32),
        "attn_q.weight": rand(HEADS * HEAD_DIM, D),
        "attn_k.weight": rand(HEAD_DIM, D),
        "attn_v.weight": rand(HEAD_DIM, D),
        "attn_output.weight": rand(D, HEADS * HEAD_DIM),
        "ffn_norm.weight": np.ones(D, np.float32),
        "ffn_gate.weight": rand(F, D),
        "ffn_up.weight": rand(F, D),
        "ffn_down.weight": rand(D, F),
    }
    if arch == "qwen2":
        layer |= {
            "attn_q.bias": rand(HEADS * HEAD_DIM),
            "attn_k.bias": rand(HEAD_DIM),
            "attn_v.bias": rand(HEAD_DIM),
        }
    if arch in ("qwen3", "gemma3"):
        layer |= {
            "attn_q_norm.weight": np.ones(HEAD_DIM, np.float32),
            "attn_k_norm.weight": np.ones(HEAD_DIM, np.float32),
        }
    if arch == "gemma3":
        layer |= {
            "post_attention_norm.weight": np.ones(D, np.float32),
            "post_ffw_norm.weight": np.ones(D, np.float32),
        }
    return tensors | {f"blk.0.{name}": value for name, value in layer.items()}


def write_gguf(path: Path, arch: str, fields, vocab_size: int, with_model: bool = True) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    if with_model:
        writer.add_block_count(1)
        writer.add_context_length(256)
        writer.add_embedding_length(D)
        writer.add_feed_forward_length(F)
        writer.add_head_count(HEADS)
        writer.add_head_count_kv(1)
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_layer_norm_rms_eps(1e-6)
    for key, value, kind in fields:
        writer.add_key_value(key, value, kind)
    if with_model:
        for name, array in tiny_tensors(arch, vocab_size).items():
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]()


def family_texts(family: Family) -> list[str]:
    return [
        *TEXTS,
        family.specials_in_text,
        family.specials_in_text + " " + TEXTS[6] + family.specials_in_text,
    ]


def check_same_tokenizer(ours, reference, family: Family) -> None:
    assert ours.get_vocab() == reference.get_vocab()
    special = {i for i, t in reference.added_tokens_decoder.items() if t.special}
    assert {i for i, t in ours.added_tokens_decoder.items() if t.special} == special
    for name in ("bos_token_id", "eos_token_id"):
        assert getattr(ours, name) == getattr(reference, name), name
    for text in family_texts(family):
        for add_special_tokens in (True, False):
            expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert ours(text, add_special_tokens=add_special_tokens)["input_ids"] == expected, (
                text,
                add_special_tokens,
            )
        ids = reference(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert ours.decode(ids, skip_special_tokens=skip) == expected, (text, skip)
    for chat in CHATS:
        rendered = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == rendered
        expected = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert specjax.chat_prompt_ids(ours, chat) == expected


def test_gguf_tokenizer_matches_the_familys_transformers_tokenizer(family: Family, tmp_path):
    fields = tokenizer_fields(family)
    vocab_size = len(fields[2][1])
    if family.arch in TOKENIZER_ONLY:  # the tokenizer alone, no tiny model of the architecture
        path = write_gguf(tmp_path / f"{family.name}.gguf", family.arch, fields, vocab_size, with_model=False)
        check_same_tokenizer(gguf_loader.read_tokenizer(path), family.reference, family)
        return
    path = write_gguf(tmp_path / f"{family.name}.gguf", family.arch, fields, vocab_size)
    model = specjax.load(path, cache_dir=tmp_path / "cache")
    assert model.config.vocab_size == vocab_size
    check_same_tokenizer(model.tokenizer, family.reference, family)
    again = specjax.load(path, cache_dir=tmp_path / "cache")  # from the cache's saved tokenizer
    check_same_tokenizer(again.tokenizer, family.reference, family)


def test_decoding_round_trips(family: Family):
    """The rebuilt tokenizer decodes its own encoding to the text (NFC for Qwen2's normalizer),
    apart from a leading space of the text, which LlamaTokenizer's decoder drops (it prepends none
    to text that starts with one, and strips one when decoding)."""
    ours = tokenizer_from_fields(family)
    # (Phi-3's normalizer puts a "▁" before the text after each special token: those decode with
    # one more space, in transformers' tokenizer too.)
    for text in TEXTS + ([] if family.name == "phi3" else [family.specials_in_text]):
        ids = ours(text, add_special_tokens=False)["input_ids"]
        expected = unicodedata.normalize("NFC", text) if family.pre == "qwen2" else text
        if family.name == "mistral-v0.3" and text.startswith(" "):
            expected = expected[1:]
        assert ours.decode(ids, skip_special_tokens=False) == expected, text


def tokenizer_from_fields(family: Family):
    """The rebuilt tokenizer straight from the converter's metadata (no file)."""

    class Metadata:
        path = f"<{family.name}>"
        values = {key: value for key, value, _ in tokenizer_fields(family)} | {
            "general.architecture": family.arch
        }

        def get(self, key, default=None):
            return self.values.get(key, default)

        def require(self, key):
            return self.values[key]

    return gguf_loader.tokenizer_from_gguf(Metadata())


def test_bos_and_eos_follow_the_file(tmp_path):
    """llama.cpp's defaults where the file has no add_bos_token key (BOS for SentencePiece and
    llama-bpe files, none for Qwen2's), and the key where it has one."""
    ours = tokenizer_from_fields(FAMILIES["mistral-v0.3"]())
    assert ours("hi")["input_ids"][0] == ours.bos_token_id
    assert ours("hi", add_special_tokens=False)["input_ids"][0] != ours.bos_token_id
    llama = FAMILIES["llama3"]()
    llama.write_add_bos = False
    assert tokenizer_from_fields(llama)("")["input_ids"] == [llama.reference.bos_token_id]
    qwen = FAMILIES["qwen2"]()
    qwen.write_add_bos = False
    assert tokenizer_from_fields(qwen)("")["input_ids"] == []
    qwen.extra = {"add_eos_token": True}
    ids = tokenizer_from_fields(qwen)("hi")["input_ids"]
    assert ids[-1] == qwen.reference.eos_token_id and ids[:-1] == qwen.reference("hi")["input_ids"]


def unsupported_gguf(tmp_path: Path, pre: str = "deepseek-llm") -> Path:
    fields = tokenizer_fields(FAMILIES["qwen2"]())
    fields[1] = ("tokenizer.ggml.pre", pre, gguf.GGUFValueType.STRING)
    return write_gguf(tmp_path / f"{pre}.gguf", "qwen2", fields, len(fields[2][1]))


def test_unsupported_tokenizer_is_an_error_unless_one_is_given(tmp_path):
    path = unsupported_gguf(tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(
        ValueError, match=r"tokenizer\.ggml\.pre 'deepseek-llm'\) is not supported.*qwen2.*tokenizer="
    ):
        specjax.load(path, cache_dir=cache)
    given = FAMILIES["qwen2"]().reference
    model = specjax.load(path, cache_dir=cache, tokenizer=given)
    assert model.tokenizer is given
    # The cache written by that load holds no tokenizer: a load without one still refuses the file's.
    with pytest.raises(ValueError, match="deepseek-llm"):
        specjax.load(path, cache_dir=cache)
    assert specjax.load(path, cache_dir=cache, tokenizer=given).tokenizer is given
    fields = [("tokenizer.ggml.model", "bert", gguf.GGUFValueType.STRING)]
    bert = write_gguf(tmp_path / "bert.gguf", "qwen2", fields, len(given), with_model=False)
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model 'bert'\) is not supported"):
        gguf_loader.read_tokenizer(bert)
    with pytest.raises(ValueError, match="tokenizer must be a tokenizer object"):
        specjax.load(path, cache_dir=cache, tokenizer="Qwen/Qwen2.5-0.5B")


def test_a_gguf_without_a_tokenizer_loads_without_one(tmp_path):
    path = write_gguf(tmp_path / "bare.gguf", "llama", [], 300)
    assert specjax.load(path, cache_dir=tmp_path / "cache").tokenizer is None
    assert specjax.load(path, cache_dir=tmp_path / "cache").tokenizer is None


def test_the_tokenizer_is_built_without_torch(tmp_path):
    family = FAMILIES["gemma3"]()
    fields = tokenizer_fields(family)
    path = write_gguf(tmp_path / "gemma3.gguf", "gemma3", fields, len(fields[2][1]), with_model=False)
    code = (
        "import sys\nfrom specjax.models import gguf_loader\n"
        f"tokenizer = gguf_loader.read_tokenizer({str(path)!r})\n"
        "assert tokenizer('hello world')['input_ids'], 'no ids'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert result.returncode == 0, result.stderr[-2000:]
