"""OpenAI's response bodies for /v1/chat/completions and /v1/completions: the whole answer, its
streamed chunks, the usage and the per-request acceptance figures, and the error body."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

CHAT, COMPLETION = "chat", "completion"

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


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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


def spec_decode_metrics(summaries: list[dict]) -> dict:
    """vLLM's per-request acceptance (its --per-request-spec-decode-metrics summary), which AIPerf
    reads: the response's top-level "metrics": {"speculative_decoding": this}, over the request's
    choices (SpecMetrics.summary()'s). acceptance_histogram[j]: the drafting steps that accepted
    exactly j drafts."""
    drafts = sum(s["num_drafts"] for s in summaries)
    drafted = sum(s["num_draft_tokens"] for s in summaries)
    accepted = sum(s["num_accepted_tokens"] for s in summaries)
    histogram = [
        sum(column) for column in zip(*(s["acceptance_length_histogram"] for s in summaries), strict=True)
    ]
    return {
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "acceptance_histogram": histogram,
        "num_spec_steps": drafts,
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": summaries[0]["num_speculative_tokens"],
    }


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
    """Builds one request's response bodies: the whole answer, or its streamed chunks. A
    request of several choices (n > 1, or a list of prompts) numbers them with `index`."""

    kind: str
    model: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: str, model: str, id: str | None = None) -> Responder:
        """`id`: the client's X-Request-Id, if it sent one; else a fresh one."""
        return cls(kind, model, id or new_id(kind), int(time.time()))

    def _body(self, object: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def choice(
        self,
        text: str,
        finish_reason: str | None,
        spec: dict | None,
        index: int = 0,
        logprobs=None,
        message: dict | None = None,
    ) -> dict:
        """One finished choice of a whole (not streamed) answer; `logprobs`: its logprobs body
        (logprob_bodies.py), or None; `message`: a chat answer's other than its text (tool calls)."""
        if self.kind == CHAT:
            content = {"message": message or {"role": "assistant", "content": text}}
        else:
            content = {"text": text}
        return {
            "index": index,
            **content,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "speculate_metrics": spec,
        }

    def response(self, text: str, finish_reason: str | None, usage: dict, spec: dict | None) -> dict:
        """The whole answer of one choice."""
        return self.responses([self.choice(text, finish_reason, spec)], usage)

    def responses(self, choices: list[dict], usage: dict, spec: dict | None = None) -> dict:
        """The whole answer of several choices (`choice`'s), in the order of their indices;
        `spec`: the request's `spec_decode_metrics`, or None where it did not speculate."""
        object = "chat.completion" if self.kind == CHAT else "text_completion"
        extra = {} if spec is None else {"metrics": {"speculative_decoding": spec}}
        return self._body(object, sorted(choices, key=lambda c: c["index"]), usage=usage, **extra)

    def chunk(
        self,
        text: str,
        *,
        index: int = 0,
        first: bool = False,
        finish_reason: str | None = None,
        spec: dict | None = None,
        include_usage: bool = False,
        usage: dict | None = None,
        logprobs: dict | None = None,
        delta: dict | None = None,
    ) -> dict:
        """A streamed chunk with a text delta; the first chat chunk also says the role, the last
        one gives the finish reason and the acceptance figures; `logprobs`: the logprobs body of
        the chunk's tokens (logprob_bodies.py), or None. `usage`: the choice's usage so
        far (vLLM's stream_options.continuous_usage_stats); else with `include_usage` the chunk
        says "usage": null, as OpenAI's do until the usage chunk. `delta`: a chat chunk's other
        than its text (tool calls)."""
        if self.kind == CHAT:
            if delta is None:
                delta = ({"role": "assistant"} if first else {}) | (
                    {"content": text} if text or first else {}
                )
            content = {"delta": delta}
        else:
            content = {"text": text}
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["speculate_metrics"] = spec
        extra = {"usage": usage} if usage is not None or include_usage else {}
        return self._body(self._chunk_object, [choice], **extra)

    def usage_chunk(self, usage: dict, spec: dict | None = None) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the whole usage (and the
        request's `spec_decode_metrics`, where vLLM sends them)."""
        extra = {} if spec is None else {"metrics": {"speculative_decoding": spec}}
        return self._body(self._chunk_object, [], usage=usage, **extra)

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == CHAT else "text_completion"
