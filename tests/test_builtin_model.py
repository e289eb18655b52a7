"""The built-in model (SmolLM2-135M-Instruct, a Q4_1 GGUF) against transformers' own load of the
same file: config, tokenizer, chat template, prefill and cached-decode logits, and the disk cache."""

from __future__ import annotations

import time
import unicodedata

import numpy as np
import pytest
import torch
from logit_check import compare_with_torch

from specjax.models import gguf_loader, load
from specjax.models.checkpoint import flatten

TOL = 1e-4  # relative float32 logit error (max abs diff / max abs logit)

TEXTS = [
    "",
    "Hello world! How are you today?",
    "  two leading spaces, trailing space \t tab\n\n\nthree newlines\r\nCRLF",
    "don't won't I'll WE'RE they've y'all",
    "Numbers: 3.14159, 1,000,000, 2024-01-01, 0x1F, 1e-5 and 12345678901234567890.",
    "Unicode: héllo wörld naïve café, 日本語のテキスト, 中文, Ελληνικά, русский, العربية, हिन्दी",
    "Emoji 🙂👍🏽 👨‍👩‍👧 and combining e\u0301 and zero\u200bwidth",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}  <div class="x">&amp;</div>',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><filename>main.py<file_sep>print('hi')<jupyter_code>",
    "Partial specials: <|im_start <|im_end| im_start|> <|endoftext",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain rotary embeddings."},
    ],
    [
        {"role": "user", "content": "Write a haiku."},
        {
            "role": "assistant",
            "content": "Leaves fall, quietly\nthe pond holds the autumn sky\na frog breaks the calm",
        },
        {"role": "user", "content": "Another, about 日本."},
    ],
]


def split_numerals(text: str) -> list[str]:
    """llama.cpp's first "smollm" pre-tokenizer pass: every numeral (Unicode category N*) alone."""
    chunks, current = [], ""
    for char in text:
        if unicodedata.category(char).startswith("N"):
            chunks += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return chunks + [current] if current else chunks


def smollm_reference(reference, text: str) -> list[int]:
    """What llama.cpp (and SmolLM2's own tokenizer.json) produce: split numerals off first, then
    byte-level BPE each piece. transformers' GGUF tokenizer skips the first pass."""
    return [i for chunk in split_numerals(text) for i in reference.encode(chunk, add_special_tokens=False)]


def transformers_agrees(text: str) -> bool:
    """Skipping the numeral split changes the tokens only where 2+ whitespace chars precede a
    numeral: GPT-2's split then moves the last space onto the number (" 2016")."""
    chunks = split_numerals(text)
    return not any(
        len(a) >= 2 and a[-2:].isspace() and unicodedata.category(b).startswith("N")
        for a, b in zip(chunks[:-1], chunks[1:], strict=True)
    )


def test_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and smollm2.params.lm_head is None
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert smollm2.name == "smollm2-135m"


def test_tokenizer_matches_transformers(smollm2, hf_smollm2_tokenizer):
    ours, reference = smollm2.tokenizer, hf_smollm2_tokenizer
    assert len(ours) == len(reference) == 49152
    for text in TEXTS + ["in the   2016 season", "day.  20% of\t\t3 and\n\n4"]:
        ids = ours.encode(text)
        assert ids == smollm_reference(reference, text), text
        if transformers_agrees(text):
            assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids) == text, text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        ), text
    assert ours.encode("<|im_start|>") == [1]
    assert ours.tokenize("in   2016") == ["in", "ĠĠĠ", "2", "0", "1", "6"]  # llama.cpp's split
    assert reference.tokenize("in   2016") == ["in", "ĠĠ", "Ġ", "2", "0", "1", "6"]  # transformers' GGUF
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert ours.eos_token_id == 2


def test_chat_template_matches_transformers(smollm2, hf_smollm2_tokenizer):
    ours, reference = smollm2.tokenizer, hf_smollm2_tokenizer
    for chat in CHATS:
        for add_generation_prompt in (False, True):
            kwargs = dict(add_generation_prompt=add_generation_prompt)
            text = ours.apply_chat_template(chat, tokenize=False, **kwargs)
            assert text == reference.apply_chat_template(chat, tokenize=False, **kwargs)
            assert ours.encode(text) == reference.encode(text)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.data
def test_tokenizer_on_prompt_sets(spec_bench, humaneval, smollm2, hf_smollm2_tokenizer):
    texts = [turn for record in spec_bench for turn in record["turns"]]
    texts += [record["prompt"] for record in humaneval]
    ours, reference = smollm2.tokenizer, hf_smollm2_tokenizer
    ours_ids = ours(texts)["input_ids"]
    reference_ids = reference(texts)["input_ids"]
    agreeing = 0
    for text, ids, expected in zip(texts, ours_ids, reference_ids, strict=True):
        if transformers_agrees(text):
            assert ids == expected, text[:80]
            agreeing += 1
        else:
            assert ids == smollm_reference(reference, text), text[:80]
    assert agreeing > 0.9 * len(texts)


def spec_bench_prompts(records, tokenizer, categories, max_tokens=160):
    """The first prompt of each category, chat-templated and cut to at most max_tokens tokens."""
    prompts = []
    for category in categories:
        record = next(r for r in records if r["category"] == category)
        chat = [{"role": "user", "content": record["turns"][0]}]
        ids = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(ids)[-max_tokens:])
    return prompts


def hf_greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.data
def test_logits_match_transformers(spec_bench, smollm2, hf_smollm2):
    categories = ["writing", "coding", "translation", "math_reasoning", "summarization"]
    prompts = spec_bench_prompts(spec_bench, smollm2.tokenizer, categories)
    assert len({len(p) for p in prompts}) > 1  # rows of different lengths share one padded batch
    steps = 8
    continuations = [hf_greedy(hf_smollm2, prompt, steps) for prompt in prompts]
    error = compare_with_torch(smollm2, hf_smollm2, prompts, continuations)
    print(f"max relative logit error vs transformers: {error:.2e}")
    assert error < TOL


def test_cached_load_skips_the_conversion_and_is_identical(smollm2_load, smollm2_cache_dir, monkeypatch):
    """A second load reads the converted cache and never parses the GGUF again (its speed is
    printed, not asserted: timings belong to benchmarks, and a busy machine is slower)."""
    model, first_seconds = smollm2_load

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached load converted the GGUF again")

    monkeypatch.setattr(gguf_loader, "read_gguf", no_conversion)
    start = time.perf_counter()
    again = load("smollm2-135m", cache_dir=smollm2_cache_dir)
    seconds = time.perf_counter() - start
    print(f"first load (converts the GGUF) {first_seconds:.1f} s, cached load {seconds:.1f} s")
    assert again.config == model.config
    ours, cached = flatten(model.params), flatten(again.params)
    assert ours.keys() == cached.keys()
    for name, value in ours.items():
        np.testing.assert_array_equal(np.asarray(cached[name]), np.asarray(value), err_msg=name)
    for text in TEXTS:
        assert again.tokenizer.encode(text) == model.tokenizer.encode(text), text
    for chat in CHATS:
        assert again.tokenizer.apply_chat_template(
            chat, tokenize=False
        ) == model.tokenizer.apply_chat_template(chat, tokenize=False)
