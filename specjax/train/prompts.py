"""Training prompts the target writes itself (Magpie, Xu et al. 2024).

A chat model fed its chat template up to the start of a user turn, and nothing else, continues
with a user turn: a question or request in the style of the chats it was tuned on. Sampling many
of them gives chat-like training prompts without a chat corpus, and without touching the prompts
a head is evaluated on (`exclude` drops any exact repeat of those, and none of them is ever shown
to the model). The head trainers then distil the target's own answers to these prompts.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from specjax.api import generate
from specjax.checks import check_int
from specjax.models.model import Model
from specjax.speculate.sampling import Sampling
from specjax.text import has_chat_template

_MARKER = "\x00specjax-user-turn\x00"


def user_turn_prefix(model: Model) -> list[int]:
    """The token ids of the model's chat template up to where a user's message begins (the system
    prompt, if the template adds one, and the user turn's header)."""
    tokenizer = model.tokenizer
    if tokenizer is None or not has_chat_template(tokenizer):
        raise ValueError(f"model {model.name!r} has no tokenizer with a chat template to write prompts from")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in text:
        raise ValueError(
            f"the chat template of {model.name!r} drops the user's message; cannot write prompts"
        )
    return tokenizer(text[: text.index(_MARKER)], add_special_tokens=False)["input_ids"]


def self_instruct_prompts(
    model: Model,
    num_prompts: int,
    seed: int = 0,
    max_prompt_tokens: int = 64,
    batch_size: int = 16,
    temperature: float = 1.0,
    top_p: float = 0.95,
    exclude=(),
    max_batches: int | None = None,
) -> list[str]:
    """`num_prompts` distinct user turns sampled from `model` after its user-turn prefix.

    A turn is kept when the model ended it (an end-of-sequence token within `max_prompt_tokens`),
    it has at least three words, and it is neither a repeat nor in `exclude` (e.g. the held-out
    evaluation prompts). Deterministic given `seed`. Sampling stops after `max_batches` batches
    (default: three times the batches `num_prompts` needs) and raises if too few turns were kept.
    """
    check_int("num_prompts", num_prompts, 1)
    check_int("max_prompt_tokens", max_prompt_tokens, 1)
    check_int("batch_size", batch_size, 1)
    if max_batches is None:
        max_batches = 3 * math.ceil(num_prompts / batch_size)
    check_int("max_batches", max_batches, 1)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    prefix = user_turn_prefix(model)
    stops = np.asarray(model.config.eos_token_ids)
    sampling = Sampling(temperature=temperature, top_p=top_p)
    seen = set(exclude)
    prompts: list[str] = []
    for batch in range(max_batches):
        key = jax.random.fold_in(jax.random.key(seed), batch)
        result = generate(
            model, [prefix] * batch_size, sampling=sampling, max_new_tokens=max_prompt_tokens, key=key
        )
        for tokens, text in zip(result.tokens, result.texts, strict=True):
            text = text.strip()
            finished = len(tokens) > 0 and np.isin(tokens[-1], stops)
            if finished and len(text.split()) >= 3 and text not in seen:
                seen.add(text)
                prompts.append(text)
        if len(prompts) >= num_prompts:
            return prompts[:num_prompts]
    raise ValueError(
        f"self_instruct_prompts: kept {len(prompts)} of num_prompts={num_prompts} user turns after "
        f"max_batches={max_batches} batches of {batch_size}; raise max_batches or max_prompt_tokens"
    )
