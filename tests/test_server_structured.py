"""Constrained answers through the server (specjax/serve/structured_fields.py, Engine.prepare):
OpenAI's response_format (json_object, json_schema, and `client.chat.completions.parse` with a
pydantic model), vLLM's structured_outputs and guided_* fields, streamed and whole; each greedy
answer is `generate`'s with the same constraint on the prompt alone, and every bad constraint is a
400 naming its field. One server for the module: the tiny character-tokenizer model of
test_structured.py, speculating with n-gram drafts."""

import dataclasses
import json
import re
from typing import Literal

import openai
import pydantic
import pytest
from test_server import Running
from test_structured import REGEX, SCHEMA, TARGET, output_text
from tiny import tiny_tokenizer

import specjax
from specjax.serve import make_app
from specjax.serve.engine import Engine
from specjax.text import chat_prompt_ids

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "a pet?"}]


def with_template(template: str) -> specjax.Model:
    """test_structured's tiny model, served as "tiny", with this chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    return dataclasses.replace(TARGET, tokenizer=tokenizer, name="tiny")


MODEL = with_template(TEMPLATE)
NGRAM = specjax.NGram(k=3, n_max=3, n_min=1)


def start_server(model: specjax.Model, constraint_states: int) -> Running:
    """The model served speculating with NGRAM, two slots, constraint tables of that many states."""
    engine = Engine(
        model, NGRAM, max_batch=2, max_model_len=160, chunk_steps=3, constraint_states=constraint_states
    )
    return Running(make_app(engine, max_waiting=4))


@pytest.fixture(scope="module")
def server():
    running = start_server(MODEL, constraint_states=2048)
    yield running
    running.close()


def reference(prompt_ids, sampling: specjax.Sampling, new_tokens: int) -> str:
    """generate's greedy answer on the prompt alone, as text (EOS left out)."""
    tokens = specjax.generate(MODEL, [prompt_ids], NGRAM, sampling, max_new_tokens=new_tokens).tokens[0]
    return output_text(tokens)[0]


def chat_ids():
    return chat_prompt_ids(MODEL.tokenizer, MESSAGES)


def test_response_format_json_schema_equals_generate(server):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
    }
    reply = server.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, response_format=response_format
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert text == reference(chat_ids(), specjax.Sampling(json_schema=SCHEMA), 60)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(text), SCHEMA)
    streamed = server.client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format=response_format,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=3)
    kind: Literal["cat", "dog"]
    ok: bool


def test_the_openai_client_parses_a_pydantic_model(server):
    """`client.chat.completions.parse(response_format=Pet)`: the client sends Pet's strict JSON
    schema and validates the answer into a Pet; sampled answers too."""
    for temperature in (0, 1.0):
        reply = server.client.chat.completions.parse(
            model="tiny",
            messages=MESSAGES,
            max_tokens=80,
            temperature=temperature,
            seed=3,
            response_format=Pet,
        )
        pet = reply.choices[0].message.parsed
        assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and len(pet.name) <= 3


def test_json_object_gives_a_json_object(server):
    reply = server.client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # (an object may be longer than the budget)
        assert isinstance(json.loads(choice.text), dict)
    else:
        assert choice.text.startswith("{")


@pytest.mark.parametrize(
    "fields, sampling",
    [
        ({"guided_regex": REGEX}, specjax.Sampling(regex=REGEX)),
        ({"guided_choice": ["yes", "no"]}, specjax.Sampling(choice=["yes", "no"])),
        ({"guided_json": json.dumps(SCHEMA)}, specjax.Sampling(json_schema=SCHEMA)),
        ({"structured_outputs": {"regex": REGEX}}, specjax.Sampling(regex=REGEX)),
        ({"structured_outputs": {"choice": ["maybe", "no"]}}, specjax.Sampling(choice=["maybe", "no"])),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            specjax.Sampling(json_schema=SCHEMA, compact_json=True),
        ),
    ],
)
def test_vllm_fields_equal_generate(server, fields, sampling):
    reply = server.client.completions.create(
        model="tiny", prompt="12 cats", max_tokens=40, temperature=0, extra_body=fields
    )
    text = reply.choices[0].text
    prompt_ids = MODEL.tokenizer("12 cats")["input_ids"]
    assert text == reference(prompt_ids, sampling, 40)
    if sampling.regex is not None:
        assert re.fullmatch(sampling.regex, text)
    elif sampling.choice is not None:
        assert text in sampling.choice


@pytest.mark.parametrize(
    "fields, param, message",
    [
        (
            {"guided_regex": "[0-9]+", "guided_choice": ["a"]},
            "guided_choice",
            "guided_regex and guided_choice: a request takes one constraint at most",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            None,
            "must be a JSON schema",
        ),
        ({"response_format": {"type": "grammar"}}, "response_format", "type 'grammar' is not supported"),
        ({"response_format": "json"}, "response_format", 'must be an object with a "type"'),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", "guided_grammar is not supported"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar", "not supported"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown key 'jsn'"),
        (
            {"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            "give it with json or json_object",
        ),
        (
            {"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": "yes"}},
            "structured_outputs.disable_any_whitespace",
            "must be true or false",
        ),
        ({"guided_choice": []}, "guided_choice", "choice must be a non-empty list"),
        ({"guided_json": {"type": "strnig"}}, "guided_json", "not a schema specjax can compile"),
        ({"guided_regex": "[0-9]{9000}"}, "guided_regex", r"tables hold 2048 states"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(server, fields, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as error:
        server.client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=fields)
    expected = param or "response_format.json_schema.schema"
    assert error.value.body["param"] == expected
    # the server serves the next request
    assert server.client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).choices
