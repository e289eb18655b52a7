"""The server's routes besides generation, in vLLM's shapes:

    GET  /v1/models              the served model, OpenAI's list
    GET  /v1/models/{id}         its card; any other id a 404 (code "model_not_found")
    POST /tokenize               {"prompt": str, "add_special_tokens": true} or a chat's
                                 {"messages": [...], "add_generation_prompt", "continue_final_message",
                                 "chat_template_kwargs", "add_special_tokens"}; "return_token_strs"
                                 -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize             {"tokens": [ids]} -> {"prompt": str}
    GET  /tokenizer_info         the tokenizer's class and configuration (what tokenizer_config.json
                                 holds): its special tokens, model_max_length, chat_template
    GET  /version                {"version": specjax's}

Tokenizing runs the same code as the generation routes (protocol.py), so /tokenize's ids are the
prompt ids a request with the same fields is answered from.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request

from specjax._version import __version__
from specjax.serve.protocol import (
    RequestError,
    bool_field,
    chat_prompt,
    template_options,
    token_ids,
)
from specjax.serve.responses import CHAT, COMPLETION

TOKENIZE_FIELDS = {
    COMPLETION: {"model", "prompt", "add_special_tokens", "return_token_strs"},
    CHAT: {
        "model",
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "add_special_tokens",
        "return_token_strs",
    },
}
# Settings every transformers tokenizer has as attributes (PreTrainedTokenizerBase).
BASE_SETTINGS = frozenset(
    {"name_or_path", "model_max_length", "padding_side", "truncation_side", "bos_token_id", "eos_token_id"}
    | {"pad_token_id", "clean_up_tokenization_spaces"}
)
# The tokenizer's settings /tokenizer_info gives, where the tokenizer has them.
TOKENIZER_SETTINGS = (
    "name_or_path",
    "model_max_length",
    "padding_side",
    "truncation_side",
    "clean_up_tokenization_spaces",
    "add_bos_token",
    "add_eos_token",
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "additional_special_tokens",
)


async def json_body(http_request: Request):
    try:
        return await http_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON ({error})") from None


def check_model(body, name: str) -> None:
    if isinstance(body, dict) and body.get("model") not in (None, name):
        raise RequestError(
            f"the model {body['model']!r} does not exist; this server serves {name!r}",
            param="model",
            status=404,
            code="model_not_found",
        )


def _check_known(body: dict, allowed: set, route: str) -> None:
    for name in body:
        if name not in allowed:
            raise RequestError(
                f"unknown field {name!r} for {route} (allowed: {', '.join(sorted(allowed))})", name
            )


def tokenize(body, tokenizer, max_model_len: int) -> dict:
    """/tokenize's answer: the prompt's or the chat's token ids, as generation would build them."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    kind = CHAT if "messages" in body else COMPLETION
    _check_known(body, TOKENIZE_FIELDS[kind], "/tokenize")
    if kind == CHAT:
        ids = chat_prompt(tokenizer, body["messages"], template_options(body))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError(
                f"prompt must be a string (or send messages, a chat), got {str(prompt)[:80]!r}", "prompt"
            )
        ids = list(
            tokenizer(prompt, add_special_tokens=bool_field(body, "add_special_tokens", True))["input_ids"]
        )
    strings = None
    if bool_field(body, "return_token_strs", False):
        strings = tokenizer.convert_ids_to_tokens(ids)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strings}


def detokenize(body, tokenizer, vocab_size: int) -> dict:
    """/detokenize's answer: the text of token ids, special tokens kept (a round trip of /tokenize)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_known(body, {"model", "tokens"}, "/detokenize")
    if "tokens" not in body:
        raise RequestError("tokens is required: a list of token ids", "tokens")
    ids = token_ids(body["tokens"], "tokens", vocab_size)
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)}


def tokenizer_info(tokenizer) -> dict:
    """The tokenizer's class, settings and chat template: enough for a client (lm-eval's remote
    tokenizer) to know what the server's tokenizer does."""
    info = {"tokenizer_class": type(tokenizer).__name__}
    # Every tokenizer has the base class's attributes; the optional settings are what it was
    # made with (init_kwargs), not probed for.
    declared = {**tokenizer.init_kwargs, **tokenizer.special_tokens_map}
    for name in TOKENIZER_SETTINGS:
        value = getattr(tokenizer, name) if name in BASE_SETTINGS else declared.get(name)
        if value is not None and isinstance(value, str | int | float | bool | list):
            info[name] = value if not isinstance(value, list) else [str(v) for v in value]
    info["vocab_size"] = len(tokenizer)
    info["chat_template"] = tokenizer.chat_template
    return info


def add_routes(app: FastAPI, name: str, engine, started: int) -> None:
    """The routes above, for the engine's model served as `name`."""
    tokenizer, vocab_size, max_model_len = (
        engine.model.tokenizer,
        engine.model.config.vocab_size,
        engine.max_model_len,
    )
    card = {
        "id": name,
        "object": "model",
        "created": started,
        "owned_by": "specjax",
        "max_model_len": max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != name:
            raise RequestError(
                f"the model {model_id!r} does not exist; this server serves {name!r}",
                param="model",
                status=404,
                code="model_not_found",
            )
        return card

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        body = await json_body(request)
        check_model(body, name)
        return tokenize(body, tokenizer, max_model_len)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        body = await json_body(request)
        check_model(body, name)
        return detokenize(body, tokenizer, vocab_size)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict:
        return tokenizer_info(tokenizer)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}
