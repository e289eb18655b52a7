"""Training prompts the target writes itself (specjax.train.prompts): the built-in model's
user-turn prefix, what is kept, determinism, exclusion, and errors."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from specjax.train import self_instruct_prompts
from specjax.train.prompts import user_turn_prefix

SMALL = {"batch_size": 4, "max_prompt_tokens": 48}


def test_the_prefix_is_the_template_before_the_users_message(smollm2):
    prefix = user_turn_prefix(smollm2)
    text = smollm2.tokenizer.decode(prefix)
    whole = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    assert whole.startswith(text) and whole[len(text) :].startswith("Hello")
    assert text.endswith("<|im_start|>user\n")


@pytest.fixture(scope="module")
def written(smollm2):
    return self_instruct_prompts(smollm2, 4, seed=3, **SMALL)


@pytest.mark.slow  # the built-in model writes the prompts: minutes here
def test_prompts_are_finished_distinct_user_turns(smollm2, written):
    assert len(written) == 4 and len(set(written)) == 4
    for prompt in written:
        assert prompt == prompt.strip() and len(prompt.split()) >= 3
        assert "<|im_end|>" not in prompt and "<|im_start|>" not in prompt


# Writes two more sets of prompts with the real model (~27 s): in `make test-all`.
@pytest.mark.slow
def test_same_seed_same_prompts_and_exclude_holds_them_out(smollm2, written):
    assert self_instruct_prompts(smollm2, 4, seed=3, **SMALL) == written
    without_first = self_instruct_prompts(smollm2, 3, seed=3, exclude={written[0]}, **SMALL)
    assert written[0] not in without_first and without_first == written[1:]


@pytest.mark.slow
def test_too_few_kept_turns_is_an_error(smollm2):
    with pytest.raises(ValueError, match=r"kept \d+ of num_prompts=50 user turns after max_batches=1"):
        self_instruct_prompts(smollm2, 50, max_batches=1, **SMALL)


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("num_prompts", 0, "num_prompts must be an integer >= 1, got 0"),
        ("max_prompt_tokens", 0, "max_prompt_tokens must be an integer >= 1"),
        ("batch_size", 2.0, "batch_size must be an integer >= 1, got 2.0"),
        ("max_batches", 0, "max_batches must be an integer >= 1"),
        ("seed", "0", "seed must be an integer, got '0'"),
    ],
)
def test_bad_arguments(smollm2, argument, value, message):
    kwargs = {"num_prompts": 2, argument: value}
    with pytest.raises(ValueError, match=message):
        self_instruct_prompts(smollm2, **kwargs)


def test_a_model_without_a_chat_template_is_refused():
    with pytest.raises(ValueError, match="has no tokenizer with a chat template"):
        self_instruct_prompts(tiny_model(seed=1), 2)
