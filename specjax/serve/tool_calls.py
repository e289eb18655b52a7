"""OpenAI's `tools` and `tool_choice` on /v1/chat/completions: the tools rendered into the prompt
by the model's chat template, the answer constrained to a call, and the call returned as
`tool_calls` (protocol.py reads the fields, app.py builds the answer).

    tool_choice "required"    the answer is a JSON array of calls, [{"name": ..., "parameters":
                              {...}}, ...], each a tool's name with arguments its "parameters"
                              schema allows (one call only with parallel_tool_calls false); the
                              finish reason is "tool_calls"
    tool_choice {"type": "function", "function": {"name": N}}
                              the answer is N's arguments, a JSON object its schema allows; the
                              finish reason stays "stop", as OpenAI's does for a named function
    tool_choice "none"        the tools are rendered, the answer is free text

"auto" (OpenAI's default when tools are given) lets the model choose between text and a call in
its own format (Hermes' <tool_call> tags, Llama's python_tag, ...), which needs a parser per model
family; this server has none, so "auto" is a 400 that says which values it serves. A chat template
that does not write the tools into the prompt (SmolLM2's does not) is a 400 too: the model would
be asked to call functions it was never shown.

The constraint is an ordinary JSON-schema constraint (Sampling.json_schema): it runs in the
engine's automaton tables with every proposer, as response_format does.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from specjax.serve.structured_fields import ConstraintFieldError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
NO_PARAMETERS = {"type": "object", "properties": {}}  # a function that takes no arguments
FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
SERVED_CHOICES = '"required", "none" or {"type": "function", "function": {"name": ...}}'


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """A request's tools and what its answer must be: `choice` "required", "function" (`name`)
    or "none"."""

    tools: list[dict]  # as the request gave them: the chat template's `tools`
    choice: str
    name: str | None = None
    parallel: bool = True

    @property
    def schema(self) -> dict | None:
        """The JSON schema the answer must match; None for "none" (free text)."""
        parameters = {
            t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in self.tools
        }
        if self.choice == "function":
            return parameters[self.name]
        if self.choice == "none":
            return None
        call = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in parameters.items()
        ]
        return {"type": "array", "items": {"anyOf": call}, "minItems": 1} | (
            {} if self.parallel else {"maxItems": 1}
        )

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def answer(self, text: str, finish_reason: str | None) -> dict:
        """A finished choice's "message" and "finish_reason" for the answer's `text`. An answer
        cut short by max_tokens is not a whole call: "required"'s comes back as text (content),
        a named function's as the arguments written so far, both with finish reason "length"."""
        if self.choice == "none":
            return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        if self.choice == "function":
            calls = [(self.name, text)]
        else:
            try:
                calls = [
                    (c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)
                ]
            except (ValueError, TypeError, KeyError):  # (only where the budget cut the array short)
                return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        tool_calls = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": n, "arguments": a},
            }
            for n, a in calls
        ]
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls}
        return {"message": message, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None) -> dict:
        """A streamed choice's last chunk: every call whole in one delta (OpenAI's clients join a
        call's deltas by its index, so one delta a call is a complete stream of it)."""
        answer = self.answer(text, finish_reason)
        message = answer["message"]
        if message["content"] is not None:
            return {"delta": {"content": message["content"]}, "finish_reason": answer["finish_reason"]}
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return {"delta": {"tool_calls": calls}, "finish_reason": answer["finish_reason"]}


def tool_request(body: dict) -> ToolCalls | None:
    """The request's tools and tool choice, checked; None when it gives no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ConstraintFieldError(
            f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls"
        )
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ConstraintFieldError(
                f"tool_choice={choice!r} needs tools: the request gives none", "tool_choice"
            )
        return None
    if not isinstance(tools, list):
        raise ConstraintFieldError(f"tools must be a list of functions, got {tools!r:.80}", "tools")
    for i, tool in enumerate(tools):
        _check_tool(tool, i)
    names = [t["function"]["name"] for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConstraintFieldError(f"tools: the function name {twice[0]!r} is given twice", "tools")
    if choice is None or choice == "auto":
        raise ConstraintFieldError(
            f"tool_choice={choice or 'auto'!r} (OpenAI's default with tools) lets the model answer in its "
            f"own tool-call format, which this server does not parse; it serves tool_choice {SERVED_CHOICES}",
            "tool_choice",
        )
    if choice in ("required", "none"):
        return ToolCalls(tools, choice, parallel=parallel is not False)
    function = (
        choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    )
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ConstraintFieldError(f"tool_choice must be {SERVED_CHOICES}, got {choice!r:.80}", "tool_choice")
    if name not in names:
        raise ConstraintFieldError(
            f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice"
        )
    return ToolCalls(tools, "function", name=name)


def _check_tool(tool, i: int) -> None:
    where = f"tools[{i}]"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise ConstraintFieldError(
            f'{where} must be {{"type": "function", "function": {{"name", "parameters", ...}}}}, '
            f"got {tool!r:.80}",
            where,
        )
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConstraintFieldError(
            f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
            f"{where}.function.name",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ConstraintFieldError(
            f"{where}.function.parameters must be a JSON schema (an object), got {parameters!r:.80}",
            f"{where}.function.parameters",
        )


def check_rendered(tools: ToolCalls, prompt_text: str) -> None:
    """Refuse a chat template that did not write every tool into the prompt."""
    missing = [name for name in tools.names() if name not in prompt_text]
    if missing:
        raise ConstraintFieldError(
            f"tools: the served model's chat template does not render tools (its prompt never names "
            f"{missing[0]!r}), so the model would be asked to call a function it was not shown",
            "tools",
        )
