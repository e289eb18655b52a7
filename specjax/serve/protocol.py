"""OpenAI's request bodies for /v1/chat/completions and /v1/completions.

`parse_request` turns a request body (a dict of JSON values) into a `GenerationRequest`: the
prompts' token ids, a `specjax.Sampling` per choice, the token budget and the output options. A
bad field raises `RequestError`, which the app sends back in OpenAI's error shape,
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the field. The response
bodies are responses.py's.

Fields read (OpenAI's, vLLM's extras and one of specjax's):

    model, messages (chat) / prompt (completions: a string, token ids, or a list of either),
    max_tokens, max_completion_tokens (chat), temperature, top_p, presence_penalty,
    frequency_penalty, logit_bias, seed, stop, n, stream, stream_options (include_usage, and
    vLLM's continuous_usage_stats), logprobs and top_logprobs (chat), logprobs and echo
    (completions; max_tokens=0 with echo scores the prompt only)
    vLLM's: top_k (-1 or 0: off), min_p, repetition_penalty, stop_token_ids, ignore_eos,
        min_tokens (0 only), include_stop_str_in_output, skip_special_tokens, add_special_tokens,
        prompt_logprobs, return_tokens_as_token_ids,
        chat (add_generation_prompt, continue_final_message, chat_template_kwargs)
    specjax's: speculative (default true; false decodes this request without the proposer)
    constraints (structured_fields.py): response_format, vLLM's structured_outputs, guided_json,
        guided_regex, guided_choice; tools, tool_choice, parallel_tool_calls (chat: tool_calls.py)

The policy for the others (docs/serving.md, "Fields"): a field that cannot change the answer
(IGNORED: OpenAI's store, metadata, service_tier, user; vLLM's priority, cache_salt, ...) is
accepted, type-checked and ignored, and the app logs it; a field the server does not implement
and that would change the answer (UNSUPPORTED: suffix, functions, bad_words, ...) is accepted
only at the value that asks for nothing (false, null, ...), and any other value is a 400 naming
it; and any other field is a 400 "unknown field" (a misspelt option answered as if it were absent
would be an answer to another question).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
from typing import Any

from specjax.checks import is_int, is_number
from specjax.serve.responses import CHAT, COMPLETION, error_body
from specjax.serve.structured_fields import FIELDS as CONSTRAINT_FIELDS
from specjax.serve.structured_fields import ConstraintFieldError, constraint_options
from specjax.serve.tool_calls import FIELDS as TOOL_FIELDS
from specjax.serve.tool_calls import ToolCalls, check_rendered, tool_request
from specjax.speculate.sampling import MAX_SEED, Sampling
from specjax.text import chat_text, has_chat_template

# OpenAI's default token budget of a completion; a chat completion may fill the context.
DEFAULT_COMPLETION_TOKENS = 16
# Options left unimplemented that would change the answer, with the values that ask for nothing
# (accepted and ignored); a value is neutral when it equals one of them and has its type (so
# logprobs=0, which asks for the sampled token's logprob, is not the neutral false).
UNSUPPORTED = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "truncate_prompt_tokens": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "spaces_between_special_tokens": (None, True),
    "chat_template": (None,),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
}
# Fields that cannot change the answer: accepted, checked for their type, and ignored (logged).
IGNORED = {
    "store": bool,  # OpenAI: keep the answer for distillation or evals
    "metadata": dict,  # OpenAI: tags for stored answers
    "service_tier": str,  # OpenAI: which capacity serves it
    "user": str,  # OpenAI: the end user, for abuse monitoring
    "priority": int,  # vLLM: its scheduler's priority (this server serves in arrival order)
    "cache_salt": str,  # vLLM: keeps its prefix cache apart per tenant
    "request_id": str,  # vLLM: its engine's request id (X-Request-Id names the response here)
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
    "min_tokens",
    "ignore_eos",
)
OUTPUT_FIELDS = (
    "include_stop_str_in_output",
    "skip_special_tokens",
    "best_of",
    "logprobs",
    "prompt_logprobs",
    "return_tokens_as_token_ids",
)
COMMON_FIELDS = ("model", "n", "stream", "stream_options", "max_tokens", "speculative", *CONSTRAINT_FIELDS)
CHAT_FIELDS = (
    "messages",
    "top_logprobs",
    "echo",  # (vLLM's chat echo is not served: refused unless false, `_logprobs_options`)
    "max_completion_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "add_special_tokens",
    *TOOL_FIELDS,
)
FIELDS = {
    CHAT: {*CHAT_FIELDS, *COMMON_FIELDS, *SAMPLING_FIELDS, *OUTPUT_FIELDS, *UNSUPPORTED, *IGNORED},
    COMPLETION: {
        "prompt",
        "echo",
        "add_special_tokens",
        *COMMON_FIELDS,
        *SAMPLING_FIELDS,
        *OUTPUT_FIELDS,
        *UNSUPPORTED,
        *IGNORED,
    },
}
# Keys of chat_template_kwargs that are the template call's own arguments, set by other fields.
TEMPLATE_ARGUMENTS = (
    "conversation",
    "messages",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "return_dict",
    "tools",
    "documents",
)


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


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What one OpenAI request asks the engine for: `n` choices of each prompt, choice j of
    prompt i numbered i * n + j (as OpenAI and vLLM number a list of prompts' choices)."""

    kind: str  # CHAT or COMPLETION
    prompts: list[list[int]]  # token ids, one list per prompt (chat: one)
    samplings: list[Sampling]  # one per choice of a prompt (n): seeded, choice j draws with seed + j
    max_new_tokens: int
    speculate: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    ignore_eos: bool = False
    include_stop: bool = False  # include_stop_str_in_output: the text keeps the stop string
    skip_special_tokens: bool = True
    ignored: tuple[str, ...] = ()  # the IGNORED fields the request sent (the app logs them)
    # N: each generated token's logprob and the N most likely tokens (chat: top_logprobs, with
    # logprobs true; completions: logprobs); None: none
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt comes back before the answer (and its logprobs)
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs and top N
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs' tokens as "token_id:7"
    constraint_field: str | None = None  # the field that constrains the answer (its errors name it)
    tool_calls: ToolCalls | None = None  # chat's tools and tool_choice (tool_calls.py)

    @property
    def scored_prompt(self) -> int | None:
        """The alternatives the engine scores the prompt with (Request.prompt_logprobs): echo's
        logprobs and vLLM's prompt_logprobs, whichever asks for more; None: the prompt unscored."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None

    @property
    def n(self) -> int:
        return len(self.samplings)

    @property
    def sampling(self) -> Sampling:  # the first choice's (the stop strings are every choice's)
        return self.samplings[0]

    @property
    def prompt(self) -> list[int]:  # the first prompt (a chat request's only one)
        return self.prompts[0]

    def choices(self) -> list[tuple[int, list[int], Sampling]]:
        """(index, prompt, sampling) of every choice, in the order of their indices."""
        return [
            (i * self.n + j, prompt, sampling)
            for i, prompt in enumerate(self.prompts)
            for j, sampling in enumerate(self.samplings)
        ]


# ---------------------------------------------------------------------------------------------
# parsing


def _is_neutral(value, neutral) -> bool:
    if value is None or neutral is None:
        return value is neutral
    if isinstance(value, bool) or isinstance(neutral, bool):  # 0 is not false here
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _check_fields(body: dict, kind: str) -> tuple[str, ...]:
    """Refuse unknown fields and unsupported values; the IGNORED fields sent."""
    route = "/v1/chat/completions" if kind == CHAT else "/v1/completions"
    for name in body:
        if name not in FIELDS[kind]:
            raise RequestError(f"unknown field {name!r} for {route}", param=name)
    for name, neutral in UNSUPPORTED.items():
        if name in body and not any(_is_neutral(body[name], v) for v in neutral):
            raise RequestError(
                f"{name}={body[name]!r} is not supported by this server (accepted: "
                f"{' or '.join(json.dumps(v) for v in neutral)}): it would change the answer",
                param=name,
            )
    for name, kind_of in IGNORED.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kind_of) or (kind_of is int and not is_int(value))):
            raise RequestError(f"{name} must be a {kind_of.__name__}, got {value!r}", param=name)
    if isinstance(body.get("metadata"), dict) and not all(
        isinstance(v, str) for v in body["metadata"].values()
    ):
        raise RequestError(
            f"metadata must map strings to strings, got {body['metadata']!r}", param="metadata"
        )
    return tuple(name for name in IGNORED if body.get(name) is not None)


def bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats), only with stream = true, as OpenAI requires."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError(
            "stream_options must be an object with include_usage and continuous_usage_stats, got "
            f"{options!r}",
            param="stream_options",
        )
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name)
        if value is not None and not isinstance(value, bool):
            raise RequestError(
                f"stream_options.{name} must be true or false, got {value!r}", param=f"stream_options.{name}"
            )
        flags.append(bool(value))
    return flags[0], flags[1]


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


def token_ids(value, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise RequestError(f"{name} must be a list of token ids, got {str(value)[:80]!r}", param=name)
    bad = [t for t in value if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"{name} holds token id {bad[0]} outside the vocabulary [0, {vocab_size})", param=name
        )
    return value


def _int_at_least(body: dict, name: str, default: int, least: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < least:
        raise RequestError(f"{name} must be an integer >= {least}, got {value!r}", param=name)
    return value


def _sampling(body: dict, vocab_size: int, tools: ToolCalls | None) -> tuple[Sampling, str | None]:
    """The request's Sampling, its seed as given (None: each choice gets its own, `_choices`),
    and the field its constraint comes from (None: unconstrained)."""
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
        options["stop_token_ids"] = token_ids(body["stop_token_ids"], "stop_token_ids", vocab_size)
    options.update(logit_bias=_logit_bias(body, vocab_size), stop=_stop_strings(body), seed=body.get("seed"))
    try:
        constraint, field = constraint_options(body)
    except ConstraintFieldError as error:
        raise RequestError(str(error), param=error.param) from None
    if tools is not None and tools.schema is not None:
        if constraint:
            raise RequestError(
                f"{field} and tool_choice={tools.choice!r} both constrain the answer; a request takes one "
                "constraint at most",
                param=field,
            )
        constraint, field = {"json_schema": tools.schema}, "tools"
    options.update(constraint)
    try:
        return Sampling(**options), field
    except ValueError as error:  # "Sampling top_p must be in (0, 1] ...": the field is its second word
        name = re.match(r"Sampling (\w+)", str(error))
        name = name and name.group(1)
        if name in constraint:  # (a schema's, a regex's or a choice's error: the field that gave it)
            name = field
        raise RequestError(str(error), param=name) from None


def _choices(body: dict, sampling: Sampling) -> list[Sampling]:
    """The n choices' Samplings. Seeded, choice j draws with seed + j (vLLM's rule); sampled
    without a seed, each gets a fresh random one: OpenAI's answers to the same unseeded request
    differ, and the engine draws from per-request seeds. Greedy choices are alike."""
    n = _int_at_least(body, "n", 1, 1)
    best_of = body.get("best_of")
    if best_of is not None and not (is_int(best_of) and best_of == n):
        raise RequestError(
            f"best_of={best_of!r} is not supported by this server (accepted: null, or n={n}): it would "
            "change the answer",
            param="best_of",
        )
    if sampling.greedy:
        return [sampling] * n
    if sampling.seed is None:
        return [dataclasses.replace(sampling, seed=secrets.randbelow(MAX_SEED)) for _ in range(n)]
    if sampling.seed + n > MAX_SEED:
        raise RequestError(
            f"seed={sampling.seed} with n={n}: choice j draws with seed + j, which must stay below 2**32",
            param="seed",
        )
    return [dataclasses.replace(sampling, seed=sampling.seed + j) for j in range(n)]


def _min_tokens(body: dict) -> None:
    """vLLM's min_tokens holds back EOS and the stop tokens for that many tokens: inside the loop
    on the device, which does not do it; so 0 only, and anything more is refused, not ignored."""
    value = _int_at_least(body, "min_tokens", 0, 0)
    if value > 0:
        raise RequestError(
            f"min_tokens={value} is not supported by this server (accepted: 0): the compiled loop "
            "cannot hold back the stop tokens; use ignore_eos with max_tokens for a fixed length",
            param="min_tokens",
        )


def _max_tokens(body: dict, kind: str, prompts: list[list[int]], max_model_len: int, scores: bool) -> int:
    """The token budget: max_completion_tokens (chat) or max_tokens; default 16 for a completion
    (OpenAI's) and what the context leaves for a chat completion. Each prompt and the budget must
    fit in max_model_len. 0 only where the prompt comes back (`scores`: echo, or prompt_logprobs),
    as lm-eval's loglikelihood requests may send: the answer is the prompt's, and its logprobs."""
    check_prompt_lengths(kind, prompts, max_model_len)
    longest = max(len(p) for p in prompts)
    chat_budget = kind == CHAT and body.get("max_completion_tokens") is not None
    name = "max_completion_tokens" if chat_budget else "max_tokens"
    default = DEFAULT_COMPLETION_TOKENS if kind == COMPLETION else max_model_len - longest
    value = _int_at_least(body, name, default, 0)
    if value == 0 and not scores:
        raise RequestError(
            f"{name}=0 asks for no token: allowed only where the prompt comes back (echo, or "
            "prompt_logprobs); else give at least 1",
            param=name,
        )
    if longest + value > max_model_len:
        raise RequestError(
            f"{name}={value}: with a prompt of {longest} tokens it exceeds the server's max_model_len "
            f"of {max_model_len} tokens",
            param=name,
        )
    return value


NO_LOGPROBS = "this server computes no logprobs (it was started with --max-logprobs -1)"


def _count_of_alternatives(body: dict, name: str, max_logprobs: int | None) -> int | None:
    """A field asking for N >= 0 alternatives per token (None: absent), at most the server's."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 0:
        raise RequestError(f"{name} must be an integer >= 0, got {value!r}", param=name)
    if max_logprobs is None:
        raise RequestError(f"{name}={value}: {NO_LOGPROBS}", param=name)
    if value > max_logprobs:
        raise RequestError(
            f"{name}={value}: this server computes at most {max_logprobs} alternatives per token "
            f"(--max-logprobs; allowed: 0 to {max_logprobs})",
            param=name,
        )
    return value


def _logprobs_options(body: dict, kind: str, max_logprobs: int | None) -> dict:
    """What the request asks of logprobs (GenerationRequest's logprobs, echo, prompt_logprobs,
    tokens_as_ids). Chat: logprobs true or false, and top_logprobs (N alternatives, with logprobs
    true, as OpenAI requires). Completions: logprobs N (OpenAI's legacy shape; 0 is the sampled
    token's alone), and echo. Both: vLLM's prompt_logprobs N and return_tokens_as_token_ids."""
    if kind == CHAT:
        if bool_field(body, "echo", False):
            raise RequestError(
                "echo=true is not supported for chat completions by this server (accepted: false); "
                "use /v1/completions with echo",
                param="echo",
            )
        wanted = bool_field(body, "logprobs", False)
        top = _count_of_alternatives(body, "top_logprobs", max_logprobs)
        if top and not wanted:  # (0 without logprobs asks for nothing)
            raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        if wanted and max_logprobs is None:
            raise RequestError(f"logprobs=true: {NO_LOGPROBS}", param="logprobs")
        logprobs = (0 if top is None else top) if wanted else None
        echo = False
    else:
        if isinstance(body.get("logprobs"), bool):
            raise RequestError(
                f"logprobs must be an integer >= 0 for /v1/completions, got {body['logprobs']!r}",
                param="logprobs",
            )
        logprobs = _count_of_alternatives(body, "logprobs", max_logprobs)
        echo = bool_field(body, "echo", False)
    return dict(
        logprobs=logprobs,
        echo=echo,
        prompt_logprobs=_count_of_alternatives(body, "prompt_logprobs", max_logprobs),
        tokens_as_ids=bool_field(body, "return_tokens_as_token_ids", False),
    )


def check_prompt_lengths(kind: str, prompts: list[list[int]], max_model_len: int) -> None:
    name = "messages" if kind == CHAT else "prompt"
    for i, prompt in enumerate(prompts):
        if len(prompt) >= max_model_len:
            which = f"{name}[{i}]" if len(prompts) > 1 else name
            raise RequestError(
                f"{which}: the prompt has {len(prompt)} tokens, the server's max_model_len is "
                f"{max_model_len}",
                param=name,
            )


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


def template_options(body: dict) -> dict:
    """The chat template's options: vLLM's add_generation_prompt (default: true, false when
    continue_final_message), continue_final_message (the last message, the assistant's, is
    continued rather than a new turn opened), add_special_tokens (default false: the template
    writes its own) and chat_template_kwargs (more variables for the template, e.g.
    {"enable_thinking": false})."""
    continue_final = bool_field(body, "continue_final_message", False)
    add_generation = bool_field(body, "add_generation_prompt", not continue_final)
    if continue_final and add_generation:
        raise RequestError(
            "continue_final_message and add_generation_prompt cannot both be true: the first continues "
            "the last message, the second opens a new turn after it",
            param="continue_final_message",
        )
    extra = body.get("chat_template_kwargs")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise RequestError(
            f"chat_template_kwargs must be an object of template variables, got {extra!r}",
            param="chat_template_kwargs",
        )
    taken = [key for key in extra if key in TEMPLATE_ARGUMENTS]
    if taken:
        raise RequestError(
            f"chat_template_kwargs[{taken[0]!r}] is an argument of the template call, not a variable "
            f"(not allowed: {', '.join(TEMPLATE_ARGUMENTS)})",
            param="chat_template_kwargs",
        )
    return dict(
        add_generation_prompt=add_generation,
        continue_final_message=continue_final,
        add_special_tokens=bool_field(body, "add_special_tokens", False),
        template_kwargs=extra,
    )


def chat_prompt(
    tokenizer, messages, options: dict | None = None, tools: ToolCalls | None = None
) -> list[int]:
    """The prompt token ids of a chat request: the chat template over the messages with the
    assistant's turn opened (`specjax.chat_prompt_ids`, which `generate` uses too), or as the
    `template_options` say; with `tools`, which the template must render."""
    if not has_chat_template(tokenizer):
        raise RequestError("the served model's tokenizer has no chat template: use /v1/completions")
    if isinstance(messages, list):
        messages = [
            {**m, "content": _message_text(m, i)} if isinstance(m, dict) else m
            for i, m in enumerate(messages)
        ]
    options = dict(options or {})
    add_special_tokens = options.pop("add_special_tokens", False)
    try:
        text = chat_text(tokenizer, messages, **options, tools=None if tools is None else tools.tools)
    except ValueError as error:  # 'messages[1]["content"] must be a str ...': it names the message
        name = re.match(r"messages(\[\d+\])?", str(error))
        raise RequestError(str(error), param=name.group(0) if name else "messages") from None
    except Exception as error:  # the template's own checks (jinja2's TemplateError: roles, order)
        raise RequestError(f"messages: the chat template refused them: {error}", param="messages") from None
    if tools is not None:
        try:
            check_rendered(tools, text)
        except ConstraintFieldError as error:
            raise RequestError(str(error), param=error.param) from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def completion_prompts(tokenizer, prompt, vocab_size: int, max_model_len: int, add_special_tokens=True):
    """The prompts of a completions request, as OpenAI takes them: a string, a list of token ids,
    or a list of strings or of token-id lists (a prompt each). Token ids are checked against the
    vocabulary and the context before any text is tokenized."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(
            "prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id "
            f"lists, got {str(prompt)[:80]!r}",
            param="prompt",
        )
    if all(isinstance(p, list) for p in prompt):
        named = ["prompt" if len(prompt) == 1 else f"prompt[{i}]" for i in range(len(prompt))]
        prompts = [token_ids(p, name, vocab_size) for p, name in zip(prompt, named, strict=True)]
        check_prompt_lengths(COMPLETION, prompts, max_model_len)
    elif all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in prompt]
    else:
        raise RequestError(
            f"prompt: a list of prompts must be all strings or all token-id lists, got {str(prompt)[:80]!r}",
            param="prompt",
        )
    for i, ids in enumerate(prompts):
        if not ids:
            which = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise RequestError(f"{which} is empty: it needs at least one token", param="prompt")
    return [list(ids) for ids in prompts]


def parse_request(
    body: Any, kind: str, tokenizer, vocab_size: int, max_model_len: int, max_logprobs: int | None = None
) -> GenerationRequest:
    """A chat (kind CHAT) or completions (COMPLETION) request body, checked and turned into what
    the engine takes; RequestError names the first bad field. `max_logprobs`: the most
    alternatives per token the server computes (None: no logprobs)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    ignored = _check_fields(body, kind)
    _min_tokens(body)
    logprobs = _logprobs_options(body, kind, max_logprobs)
    scores = logprobs["prompt_logprobs"] is not None or logprobs["echo"]
    try:
        tools = tool_request(body) if kind == CHAT else None
    except ConstraintFieldError as error:
        raise RequestError(str(error), param=error.param) from None
    sampling, constraint_field = _sampling(body, vocab_size, tools)  # (before the prompts: cheap)
    samplings = _choices(body, sampling)
    stream = bool_field(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    if kind == CHAT:
        prompts = [chat_prompt(tokenizer, body.get("messages"), template_options(body), tools)]
    else:
        if "prompt" not in body:
            raise RequestError("prompt is required", param="prompt")
        add_special = bool_field(body, "add_special_tokens", True)
        prompts = completion_prompts(tokenizer, body["prompt"], vocab_size, max_model_len, add_special)
    return GenerationRequest(
        kind=kind,
        prompts=prompts,
        samplings=samplings,
        max_new_tokens=_max_tokens(body, kind, prompts, max_model_len, scores),
        speculate=bool_field(body, "speculative", True),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        ignore_eos=bool_field(body, "ignore_eos", False),
        include_stop=bool_field(body, "include_stop_str_in_output", False),
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        ignored=ignored,
        constraint_field=constraint_field,
        tool_calls=tools,
        **logprobs,
    )
