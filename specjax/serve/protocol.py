"""OpenAI's request and response bodies for /v1/chat/completions and /v1/completions.

`parse_chat` and `parse_completion` turn a request body (a dict of JSON values) into a
`GenerationRequest`: the prompt's token ids, a `specjax.Sampling`, the token budget and the
stream options. A bad field raises `RequestError`, which the app sends back as HTTP 400 in
OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with `param` naming the
field. The functions below them build the response bodies and the streamed chunks.

Fields read (OpenAI's, plus vLLM's extra sampling fields and one of specjax's):

    model, messages (chat) / prompt (completions), max_tokens, max_completion_tokens (chat),
    temperature, top_p, presence_penalty, frequency_penalty, logit_bias, seed, stop, n (1 only),
    stream, stream_options.include_usage, user (ignored)
    vLLM's: top_k (-1 or 0: off), min_p, repetition_penalty, stop_token_ids
    specjax's: speculative (default true; false decodes this request without the proposer)

OpenAI options the server does not implement (logprobs, tools, echo, ...) are accepted at their
neutral values only (false, null, n = 1, ...), so that clients that always send them work; any
other value, and any unknown field, is a 400 naming it, rather than an answer that silently
ignores what was asked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import time
import uuid
from typing import Any

from specjax.checks import is_int, is_number
from specjax.speculate.sampling import MAX_SEED, Sampling
from specjax.text import chat_prompt_ids, has_chat_template

CHAT, COMPLETION = "chat", "completion"
# OpenAI's default token budget of a completion; a chat completion may fill the context.
DEFAULT_COMPLETION_TOKENS = 16
# OpenAI options left unimplemented, with the values that ask for nothing (accepted and ignored).
NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "stop",
    "stop_token_ids",
)
COMMON_FIELDS = ("model", "n", "stream", "stream_options", "max_tokens", "speculative", "user")
FIELDS = {
    CHAT: {"messages", "max_completion_tokens", *COMMON_FIELDS, *SAMPLING_FIELDS, *NEUTRAL},
    COMPLETION: {"prompt", *COMMON_FIELDS, *SAMPLING_FIELDS, *NEUTRAL},
}


class RequestError(ValueError):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What one OpenAI request asks the engine for."""

    kind: str  # CHAT or COMPLETION
    prompt: list[int]  # token ids
    sampling: Sampling
    max_new_tokens: int
    speculate: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


# ---------------------------------------------------------------------------------------------
# parsing


def _check_fields(body: dict, kind: str) -> None:
    for name in body:
        if name not in FIELDS[kind]:
            route = "/v1/chat/completions" if kind == CHAT else "/v1/completions"
            raise RequestError(f"unknown field {name!r} for {route}", param=name)
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise RequestError(
                f"{name}={body[name]!r} is not supported by this server (accepted: "
                f"{' or '.join(json.dumps(v) for v in neutral)})",
                param=name,
            )
    if body.get("n") not in (None, 1):
        raise RequestError(f"n must be 1 (one choice per request), got {body['n']!r}", param="n")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"user must be a string, got {body['user']!r}", param="user")


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    """stream_options.include_usage (only with stream = true, as OpenAI requires)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError(
            f"stream_options must be an object with include_usage, got {options!r}", param="stream_options"
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(
            f"stream_options.include_usage must be true or false, got {include!r}",
            param="stream_options.include_usage",
        )
    return include


def _stop_strings(body: dict):
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}", param="stop"
        )
    return tuple(stop)


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI sends {"token id as a string": bias}."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise RequestError(
            f"logit_bias must be an object {{token id: bias}}, got {bias!r}", param="logit_bias"
        )
    parsed = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d+", str(key)) or int(key) >= vocab_size:
            raise RequestError(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias"
            )
        if not is_number(value) or not math.isfinite(value):
            raise RequestError(f"logit_bias[{key!r}] must be a number, got {value!r}", param="logit_bias")
        parsed[int(key)] = float(value)
    return parsed


def _token_ids(value, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise RequestError(f"{name} must be a list of token ids, got {value!r}", param=name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"{name} holds token id {bad[0]} outside the vocabulary [0, {vocab_size})", param=name
        )
    return value


def _sampling(body: dict, vocab_size: int) -> Sampling:
    """The request's Sampling. A sampled request without a seed gets a fresh random one: OpenAI's
    answers to the same unseeded request differ, and the engine draws from per-request seeds."""
    options = {
        name: body[name]
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
        if body.get(name) is not None
    }
    options.setdefault("temperature", 1.0)  # OpenAI's default
    if body.get("repetition_penalty") is not None:
        options["repetition_penalty"] = body["repetition_penalty"]
    top_k = body.get("top_k")
    if top_k is not None:
        options["top_k"] = 0 if top_k == -1 else top_k  # vLLM's -1 is "off", specjax's 0
    if body.get("stop_token_ids") is not None:
        options["stop_token_ids"] = _token_ids(body["stop_token_ids"], "stop_token_ids", vocab_size)
    seed = body.get("seed")
    if seed is None and options["temperature"] != 0:
        seed = secrets.randbelow(MAX_SEED)
    options.update(logit_bias=_logit_bias(body, vocab_size), stop=_stop_strings(body), seed=seed)
    try:
        return Sampling(**options)
    except ValueError as error:  # "Sampling top_p must be in (0, 1] ...": the field is its second word
        name = re.match(r"Sampling (\w+)", str(error))
        raise RequestError(str(error), param=name and name.group(1)) from None


def _max_tokens(body: dict, kind: str, prompt_len: int, max_model_len: int) -> int:
    """The token budget: max_completion_tokens (chat) or max_tokens; default 16 for a completion
    (OpenAI's) and what the context leaves for a chat completion. The prompt and the budget must
    fit in max_model_len."""
    prompt = "messages" if kind == CHAT else "prompt"
    if prompt_len >= max_model_len:
        raise RequestError(
            f"{prompt}: the prompt has {prompt_len} tokens, the server's max_model_len is {max_model_len}",
            param=prompt,
        )
    chat_budget = kind == CHAT and body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if chat_budget else "max_tokens"
    value = body.get(name)
    if value is None:
        value = DEFAULT_COMPLETION_TOKENS if kind == COMPLETION else max_model_len - prompt_len
    if not is_int(value) or value < 1:
        raise RequestError(f"{name} must be an integer >= 1, got {value!r}", param=name)
    if prompt_len + value > max_model_len:
        raise RequestError(
            f"{name}={value}: with a prompt of {prompt_len} tokens it exceeds the server's max_model_len "
            f"of {max_model_len} tokens",
            param=name,
        )
    return value


def _message_text(message, i: int):
    """A message's content, OpenAI's list of text parts joined by newlines (what vLLM does); a
    string, None or anything else stays as it is, for chat_prompt_ids to check."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return content
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
        return "\n".join(texts)
    raise RequestError(
        f"messages[{i}].content must be a string or a list of text parts, got {content!r}",
        param=f"messages[{i}].content",
    )


def chat_prompt(tokenizer, messages) -> list[int]:
    """The prompt token ids of a chat request: the chat template over the messages with the
    assistant's turn opened (`specjax.chat_prompt_ids`, which `generate` uses too)."""
    if not has_chat_template(tokenizer):
        raise RequestError("the served model's tokenizer has no chat template: use /v1/completions")
    if isinstance(messages, list):
        messages = [
            {**m, "content": _message_text(m, i)} if isinstance(m, dict) else m
            for i, m in enumerate(messages)
        ]
    try:
        return chat_prompt_ids(tokenizer, messages)
    except ValueError as error:  # 'messages[1]["content"] must be a str ...': it names the message
        name = re.match(r"messages(\[\d+\])?", str(error))
        raise RequestError(str(error), param=name.group(0) if name else "messages") from None
    except Exception as error:  # the template's own checks (jinja2's TemplateError: roles, order)
        raise RequestError(f"messages: the chat template refused them: {error}", param="messages") from None


def completion_prompt_ids(tokenizer, prompt, vocab_size: int) -> list[int]:
    """One prompt: a string (tokenized as `generate` tokenizes a string prompt), a list of token
    ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and (not prompt or all(is_int(t) for t in prompt)):
        ids = _token_ids(prompt, "prompt", vocab_size)
    else:
        raise RequestError(
            "prompt must be a string or a list of token ids (one prompt per request), got "
            f"{str(prompt)[:80]!r}",
            param="prompt",
        )
    if not ids:
        raise RequestError("prompt is empty: it needs at least one token", param="prompt")
    return ids


def parse_request(body: Any, kind: str, tokenizer, vocab_size: int, max_model_len: int) -> GenerationRequest:
    """A chat (kind CHAT) or completions (COMPLETION) request body, checked and turned into what
    the engine takes; RequestError names the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_fields(body, kind)
    if kind == CHAT:
        prompt = chat_prompt(tokenizer, body.get("messages"))
    else:
        if "prompt" not in body:
            raise RequestError("prompt is required", param="prompt")
        prompt = completion_prompt_ids(tokenizer, body["prompt"], vocab_size)
    stream = _bool(body, "stream", False)
    return GenerationRequest(
        kind=kind,
        prompt=prompt,
        sampling=_sampling(body, vocab_size),
        max_new_tokens=_max_tokens(body, kind, len(prompt), max_model_len),
        speculate=_bool(body, "speculative", True),
        stream=stream,
        include_usage=_stream_options(body, stream),
    )


# ---------------------------------------------------------------------------------------------
# responses

# The per-request acceptance figures sent with a finished request (the choice's
# "speculate_metrics", where FastDeploy puts its own): SpecMetrics.summary()'s counts and rates,
# named as specjax and vLLM name them.
SPECULATE_METRICS_KEYS = (
    "num_speculative_tokens",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_emitted_tokens",
    "acceptance_rate",
    "mean_acceptance_length",
    "acceptance_per_position",
    "conditional_acceptance_per_position",
    "acceptance_length_histogram",
)


def _finite(value):
    """NaN (a rate over no drafts) as null: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def speculate_metrics(metrics) -> dict | None:
    """A finished request's acceptance figures from its SpecMetrics (None: none to report)."""
    if metrics is None:
        return None
    summary = metrics.summary()
    return {key: _finite(summary[key]) for key in SPECULATE_METRICS_KEYS if key in summary}


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclasses.dataclass(frozen=True)
class Responder:
    """Builds one request's response bodies: the whole answer, or its streamed chunks."""

    kind: str
    model: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: str, model: str) -> Responder:
        return cls(kind, model, new_id(kind), int(time.time()))

    def _body(self, object: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(self, text: str, finish_reason: str | None, usage: dict, spec: dict | None) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.kind == CHAT else {"text": text}
        choice = {
            "index": 0,
            **content,
            "logprobs": None,
            "finish_reason": finish_reason,
            "speculate_metrics": spec,
        }
        return self._body(
            "chat.completion" if self.kind == CHAT else "text_completion", [choice], usage=usage
        )

    def chunk(
        self,
        text: str,
        *,
        first: bool = False,
        finish_reason: str | None = None,
        spec: dict | None = None,
        include_usage: bool = False,
    ) -> dict:
        """A streamed chunk with a text delta; the first chat chunk also says the role, the last
        one gives the finish reason and the acceptance figures."""
        if self.kind == CHAT:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            content = {"delta": delta}
        else:
            content = {"text": text}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["speculate_metrics"] = spec
        extra = {"usage": None} if include_usage else {}  # OpenAI: null until the usage chunk
        return self._body(self._chunk_object, [choice], **extra)

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the whole usage."""
        return self._body(self._chunk_object, [], usage=usage)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == CHAT else "text_completion"
