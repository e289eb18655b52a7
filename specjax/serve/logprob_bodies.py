"""Logprobs in OpenAI's and vLLM's response shapes, from the engine's records
(speculate/logprobs.py `Logprobs`: the tokens, each one's logprob, the N most likely tokens).

- completions (`logprobs=N`, OpenAI's legacy shape): choices[i].logprobs = {"tokens",
  "token_logprobs", "top_logprobs", "text_offset"}, a list entry per token; each top_logprobs
  entry maps the N most likely tokens' texts to their logprobs, and the token itself too (so up
  to N + 1 entries, as OpenAI's and vLLM's); with echo the prompt's tokens come first, the first
  of them with null (nothing comes before it);
- chat (`logprobs=true, top_logprobs=N`): choices[i].logprobs = {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [N of {"token", "logprob", "bytes"}]}]};
- vLLM's `prompt_logprobs=N`: [null, {"token id": {"logprob", "rank", "decoded_token"}}, ...],
  a dict per prompt token from the second on, holding it and the N most likely tokens there. A
  rank is known for the N most likely (1 to N); the prompt's own token, where it is not among
  them, has rank null (the engine does not rank the whole vocabulary).

A token's text is its own decoding (the tokenizer's decode of that token alone); with vLLM's
return_tokens_as_token_ids, "token_id:<id>" instead, which tells apart tokens whose texts are
alike. JSON has no infinity: a logprob of -inf (a token the request's top-k, top-p or min-p
dropped) is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math

INFINITE_LOGPROB = -9999.0  # what a -inf logprob is sent as (vLLM's)


def _value(logprob: float) -> float | None:
    """A logprob as JSON takes it: -inf as INFINITE_LOGPROB, NaN (a non-finite pass) as null."""
    logprob = float(logprob)
    if math.isnan(logprob):
        return None
    return INFINITE_LOGPROB if math.isinf(logprob) else logprob


class TokenTexts:
    """Each token id's text (its decoding alone), decoded once and kept: a response's logprobs
    name N + 1 tokens per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def label(self, token_id: int, as_ids: bool) -> str:
        """How a logprobs body names the token: its text, or "token_id:<id>" (`as_ids`)."""
        return f"token_id:{int(token_id)}" if as_ids else self.text(token_id)


def completion_logprobs(
    texts: TokenTexts, pieces, as_ids: bool, offset: int = 0, first_token: int | None = None
) -> tuple[dict, int]:
    """OpenAI's legacy logprobs of a completion's tokens: `pieces`, Logprobs in order (the
    prompt's and the answer's); `first_token`: a token before them with no logprob (echo's first
    prompt token); `offset`: the text offset of the first token. Returns the body and the text
    offset past its tokens (a streamed answer's next chunk starts there)."""
    body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token_id, logprob, top) -> None:
        nonlocal offset
        label = texts.label(token_id, as_ids)
        body["tokens"].append(label)
        body["token_logprobs"].append(logprob)
        body["top_logprobs"].append(top)
        body["text_offset"].append(offset)
        offset += len(texts.text(token_id))

    if first_token is not None:
        add(first_token, None, None)
    for piece in pieces:
        for i, token_id in enumerate(piece.token_ids):
            top = {texts.label(t, as_ids): _value(v) for t, v in piece.top(i).items()}
            top.setdefault(texts.label(token_id, as_ids), _value(piece.logprobs[i]))
            add(token_id, _value(piece.logprobs[i]), top)
    return body, offset


def chat_logprobs(texts: TokenTexts, pieces, as_ids: bool) -> dict:
    """OpenAI's chat logprobs of an answer's tokens (`pieces`, Logprobs in order)."""

    def entry(token_id, logprob) -> dict:
        label = texts.label(token_id, as_ids)
        return {"token": label, "logprob": _value(logprob), "bytes": list(label.encode("utf-8"))}

    content = []
    for piece in pieces:
        for i, token_id in enumerate(piece.token_ids):
            top = [entry(t, v) for t, v in piece.top(i).items()]
            content.append(entry(token_id, piece.logprobs[i]) | {"top_logprobs": top})
    return {"content": content}


def prompt_logprobs(texts: TokenTexts, scored, num_top: int) -> list:
    """vLLM's prompt_logprobs of a prompt whose tokens from the second on `scored` holds (a
    Logprobs), with its `num_top` most likely tokens at each."""
    body: list = [None]
    for i, token_id in enumerate(scored.token_ids):
        top = list(scored.top(i).items())[:num_top]
        entries = {
            str(t): {"logprob": _value(v), "rank": rank, "decoded_token": texts.text(t)}
            for rank, (t, v) in enumerate(top, start=1)
        }
        entries.setdefault(
            str(int(token_id)),
            {"logprob": _value(scored.logprobs[i]), "rank": None, "decoded_token": texts.text(token_id)},
        )
        body.append(entries)
    return body
