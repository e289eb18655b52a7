"""Text on the host, around the compiled loop: chat conversations rendered to prompt token ids.

Nothing here runs on the device; `generate` and the server share these helpers.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant" | ..., "content": str}


def is_conversation(value) -> bool:
    """Whether `value` reads as one conversation: a list whose first item is a message dict.

    This is how a prompt tells a conversation (a list of dicts) from token ids (a list of ints),
    and a batch of conversations (a list of lists) from one."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and len(value) > 0
        and isinstance(value[0], Mapping)
    )


def check_messages(messages, name: str = "messages") -> list[dict[str, str]]:
    """The messages as plain dicts, or a ValueError naming `name` (or `name[j]`, the message at
    fault), the value and what is allowed: a non-empty list of {"role": str, "content": str}.

    Other keys (e.g. "name") pass through to the template. Content must be text: lists of content
    parts (images, audio) have no meaning for a text model's template here."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or len(messages) == 0:
        raise ValueError(
            f'{name} must be a non-empty list of messages {{"role": str, "content": str}}, '
            f"got {reprlib.repr(messages)}"
        )
    checked = []
    for j, message in enumerate(messages):
        where = f"{name}[{j}]"
        if not isinstance(message, Mapping):
            raise ValueError(
                f'{where} must be a message {{"role": str, "content": str}}, got '
                f"{type(message).__name__} {reprlib.repr(message)}"
            )
        if "role" not in message or "content" not in message:
            raise ValueError(f'{where} must have a "role" and a "content", got {reprlib.repr(message)}')
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role:
            raise ValueError(
                f'{where}["role"] must be a non-empty str ("system", "user", "assistant", ...), '
                f"got {reprlib.repr(role)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f'{where}["content"] must be a str (the message\'s text), got '
                f"{type(content).__name__} {reprlib.repr(content)}"
            )
        checked.append(dict(message))
    return checked


def chat_prompt_ids(tokenizer, messages: Sequence[Message], name: str = "messages") -> list[int]:
    """The prompt token ids of a conversation: `messages` rendered by the tokenizer's chat template
    with the assistant's turn opened (`add_generation_prompt=True`), then tokenized without
    adding special tokens (the template writes its own: a BOS added again would appear twice).

    The same ids as `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`. ValueError, naming `name`, for malformed messages or a tokenizer without a chat
    template."""
    checked = check_messages(messages, name)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{name}: the tokenizer has no chat template to render messages with; give the prompt as "
            "text formatted by hand (with chat=False) or as token ids"
        )
    text = tokenizer.apply_chat_template(checked, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
