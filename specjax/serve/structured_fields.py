"""The request fields that constrain an answer's text (protocol.py), as `Sampling`'s options
(`json_schema`, `regex` or `choice`; specjax/speculate/grammar.py compiles them).

    response_format       OpenAI's {"type": "text"} (none), {"type": "json_object"} (any JSON
                          object), {"type": "json_schema", "json_schema": {"name", "schema",
                          "strict"}} (what `client.chat.completions.parse` sends for a pydantic
                          model)
    structured_outputs    vLLM's {"json": schema, "regex": ..., "choice": [...], "json_object":
                          true}, with "disable_any_whitespace": true for compact JSON
                          (Sampling.compact_json); "grammar" (EBNF) and "structural_tag" are
                          refused
    guided_json, guided_regex, guided_choice
                          vLLM's older fields; guided_grammar is refused

At most one constraint per request: two are a 400 naming both. A schema the compiler cannot take
(a feature outlines-core does not implement, or one that is not a schema) is a 400 naming the
field and outlines-core's reason.
"""

from __future__ import annotations

from typing import Any

# What {"type": "json_object"} allows: any JSON object (outlines-core bounds its nesting).
JSON_OBJECT = {"type": "object"}
FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
VLLM_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice"}
REFUSED_KEYS = ("grammar", "structural_tag")  # vLLM's, not served (a full grammar, tags)


class ConstraintFieldError(ValueError):
    """A constraint field's bad value (tool_calls.py's tools fields too); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def constraint_options(body: dict) -> tuple[dict[str, Any], str | None]:
    """(the Sampling options of the request's constraint, {} for none; the field that gave it)."""
    found: list[tuple[str, dict]] = []
    for name in FIELDS:
        value = body.get(name)
        if value is None:
            continue
        options = _READERS[name](value, name)
        if options:
            found.append((name, options))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise ConstraintFieldError(f"{names}: a request takes one constraint at most", param=found[1][0])
    return (found[0][1], found[0][0]) if found else ({}, None)


def _response_format(value, name: str) -> dict:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConstraintFieldError(f'{name} must be an object with a "type", got {value!r}', param=name)
    kind = value["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintFieldError(
                f'{name}.json_schema must be an object {{"name", "schema", "strict"}}, got {spec!r}',
                param=f"{name}.json_schema",
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ConstraintFieldError(
                f"{name}.json_schema.schema must be a JSON schema (an object), got {schema!r}",
                param=f"{name}.json_schema.schema",
            )
        return {"json_schema": schema}
    raise ConstraintFieldError(
        f'{name} type {kind!r} is not supported (allowed: "text", "json_object", "json_schema")', param=name
    )


def _structured_outputs(value, name: str) -> dict:
    if not isinstance(value, dict):
        raise ConstraintFieldError(f"{name} must be an object, got {value!r}", param=name)
    for key in REFUSED_KEYS:
        if value.get(key) is not None:
            raise ConstraintFieldError(
                f"{name}.{key} is not supported by this server (allowed: json, regex, choice, json_object)",
                param=f"{name}.{key}",
            )
    known = {*VLLM_KEYS, *REFUSED_KEYS, "json_object", "disable_any_whitespace", "disable_fallback"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConstraintFieldError(f"{name}: unknown key {unknown[0]!r}", param=f"{name}.{unknown[0]}")
    options = {VLLM_KEYS[key]: value[key] for key in VLLM_KEYS if value.get(key) is not None}
    if value.get("json_object") is True:
        options["json_schema"] = JSON_OBJECT if "json_schema" not in options else None
    if len(options) > 1 or None in options.values():
        raise ConstraintFieldError(f"{name}: give one of json, regex, choice and json_object", param=name)
    compact = value.get("disable_any_whitespace", False)
    if not isinstance(compact, bool):
        raise ConstraintFieldError(
            f"{name}.disable_any_whitespace must be true or false, got {compact!r}",
            param=f"{name}.disable_any_whitespace",
        )
    if compact and "json_schema" not in options:
        raise ConstraintFieldError(
            f"{name}.disable_any_whitespace shapes JSON's whitespace: give it with json or json_object",
            param=f"{name}.disable_any_whitespace",
        )
    if compact:
        options["compact_json"] = True
    return options


def _one(option: str):
    def read(value, name: str) -> dict:
        return {option: value}

    return read


def _refused(value, name: str) -> dict:
    raise ConstraintFieldError(
        f"{name} is not supported by this server (allowed: guided_json, guided_regex, guided_choice)",
        param=name,
    )


_READERS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": _one("json_schema"),
    "guided_regex": _one("regex"),
    "guided_choice": _one("choice"),
    "guided_grammar": _refused,
}
