"""Text on the host, around the compiled loop: chat conversations rendered to prompt token ids
(`chat_prompt_ids`), and committed token ids turned into text deltas for streaming (`TextDeltas`).

Nothing here runs on the device; `generate` and the server share these helpers.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Mapping, Sequence

from specjax.speculate.stops import stop_end

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

    Other keys (e.g. "name", "tool_calls") pass through to the template. Content must be text
    (lists of content parts, images, audio, have no meaning for a text model's template here),
    or null in an assistant's message that makes tool calls."""
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
        if content is None and message.get("tool_calls"):  # an assistant's calls, OpenAI's shape
            checked.append(dict(message))
            continue
        if not isinstance(content, str):
            raise ValueError(
                f'{where}["content"] must be a str (the message\'s text), got '
                f"{type(content).__name__} {reprlib.repr(content)}"
            )
        checked.append(dict(message))
    return checked


def has_chat_template(tokenizer) -> bool:
    """Whether a tokenizer (HF's, or any with `apply_chat_template`) has a chat template to render
    messages with: an HF tokenizer built without one has `chat_template` None; other tokenizers
    may not have the attribute at all."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(
    tokenizer,
    messages: Sequence[Message],
    name: str = "messages",
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    template_kwargs: Mapping | None = None,
    tools: Sequence[Mapping] | None = None,
) -> list[int]:
    """The prompt token ids of a conversation: `messages` rendered by the tokenizer's chat template
    with the assistant's turn opened (`add_generation_prompt=True`), then tokenized without
    adding special tokens (the template writes its own: a BOS added again would appear twice).

    The same ids as `tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    tokenize=True)`. ValueError, naming `name`, for malformed messages or a tokenizer without a chat
    template. The keywords are the server's (vLLM's chat options): `continue_final_message` renders
    the last message unclosed, for the answer to continue it; `template_kwargs` are more variables
    for the template (e.g. {"enable_thinking": False}); `tools`, OpenAI's function tools, for a
    template that renders them."""
    text = chat_text(
        tokenizer,
        messages,
        name,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
        tools=tools,
    )
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def chat_text(
    tokenizer,
    messages: Sequence[Message],
    name: str = "messages",
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: Mapping | None = None,
    tools: Sequence[Mapping] | None = None,
) -> str:
    """The text `chat_prompt_ids` tokenizes: the messages rendered by the chat template."""
    checked = check_messages(messages, name)
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"{name}: the tokenizer has no chat template to render messages with; give the prompt as "
            "text formatted by hand (with chat=False) or as token ids"
        )
    return tokenizer.apply_chat_template(
        checked,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        tools=None if tools is None else list(tools),
        **(template_kwargs or {}),
    )


REPLACEMENT = "\ufffd"  # what decode writes for the bytes of an incomplete character


class TextDeltas:
    """The text of a stream of token ids, delta by delta, for streaming a generation.

    Push the ids as they are committed (`push(ids) -> str`), then call `finish() -> str` once at
    the end. Joined, the deltas are exactly `cut_text(tokenizer.decode(ids, skip_special_tokens=True),
    stop)` for the ids pushed, however they were chunked: the text stops before the first stop
    string (after it with `include_stop`; special tokens' texts kept with
    `skip_special_tokens=False`: the server's vLLM options). Once the text holds one, `stopped` is
    True and further pushes yield nothing (the loop ends a row at the token that completes a stop,
    so no ids follow it there).

    Decoding each push's ids alone would be wrong twice: a byte-level token may hold part of a
    character (decode writes U+FFFD for it), and SentencePiece tokenizers drop the leading space
    of the first token they decode. Decoding all the ids at every push would be right but
    quadratic. So each push decodes a short window of ids that starts a chunk back, at `_prefix`:
    once up to `_read` (the ids already turned into text) and once to the end. What the second
    adds to the first is the new text as it reads in the middle of the sequence. While the window
    ends in U+FFFD, a character is incomplete: nothing is taken, and the ids wait for the next push.

    Text that could be the beginning of a stop string ("ab" with the stop "abc") is held back
    until the text after it rules the stop out, so nothing past a stop is ever yielded.

    Exact for tokenizers whose decode writes each token's text whatever the tokens after it, apart
    from a leading space dropped at the start of the text: byte-level BPE (GPT-2, Llama 3, Qwen,
    SmolLM2) and SentencePiece (Llama 2, Mistral). Tokenizers that clean up spaces before
    punctuation after decoding (`clean_up_tokenization_spaces=True`, WordPiece-era; transformers
    ignores it for BPE) rewrite text already streamed: the deltas are their text without it.
    """

    def __init__(
        self,
        tokenizer,
        stop: str | Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        stops = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
        self.tokenizer = tokenizer
        self.stop = tuple(stops)
        self.skip_special_tokens, self.include_stop = skip_special_tokens, include_stop
        self.stopped = False  # the text holds a stop string: nothing more will be yielded
        self._longest = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # the window decoded at each push starts at this id ...
        self._read = 0  # ... and the ids before this one are in _text already
        self._text = ""  # the text of ids[:_read], whole characters only
        self._sent = 0  # characters of _text yielded so far
        self._searched = 0  # characters of _text already searched for stop strings
        self._finished = False

    def push(self, ids: Iterable[int]) -> str:
        """Add token ids; returns the text they complete (possibly "")."""
        if self._finished:
            raise RuntimeError("TextDeltas.push after finish(): make a new TextDeltas for a new stream")
        if self.stopped:
            return ""
        self._ids.extend(int(t) for t in ids)
        self._text += self._new_text(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back until now: an incomplete character at the end (as decode writes it,
        U+FFFD) and text that could have begun a stop string."""
        if self._finished:
            raise RuntimeError("TextDeltas.finish() called twice")
        self._finished = True
        if self.stopped:
            return ""
        self._text += self._new_text(final=True)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        # (clean_up_tokenization_spaces is False for the exact tokenizers above; forcing it keeps
        # the others' windows extending each other, see the class docstring)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _new_text(self, final: bool) -> str:
        """The text of ids[_read:] as it reads after the ones before, moving the window on; ""
        when there is none yet (special tokens only, or, unless `final`, an incomplete character)."""
        context = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        # (a window that does not extend its context would be a decode that rewrites earlier text:
        # none of the tokenizers above does)
        if len(window) <= len(context) or not window.startswith(context):
            return ""
        if window.endswith(REPLACEMENT) and not final:
            return ""
        # Only once the new ids added text: a window starting with special tokens only would
        # decode its first real token as the start of a text, without its leading space.
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(context) :]

    def _release(self, final: bool) -> str:
        """The text that can be yielded now: up to the first stop string, else all of it but what
        may begin one (all of it when `final`)."""
        text, end = self._text, len(self._text)
        if self.stop:
            # A new occurrence ends in the new text: it starts at most len(stop) - 1 before it.
            start = max(0, self._searched - self._longest + 1)
            found = stop_end(text, self.stop, start, self.include_stop)
            self._searched = len(text)
            if found is not None:
                end, self.stopped = found, True
            elif not final:
                end = self._held_from(text)
        delta, self._sent = text[self._sent : end], end
        return delta

    def _held_from(self, text: str) -> int:
        """Where the longest end of `text` that some stop string begins with starts (len(text)
        when there is none): the text from there on may still turn out to be a stop."""
        for i in range(max(self._sent, len(text) - self._longest + 1), len(text)):
            if any(s.startswith(text[i:]) for s in self.stop):
                return i
        return len(text)
