"""OpenAI's tools through the server (specjax/serve/tool_calls.py): tool_choice "required", a
named function and "none", whole and streamed, with the openai client. Each greedy call is
`generate`'s answer on the prompt the chat template renders with the tools, constrained to the
call's schema, and its arguments validate against the function's parameters; every bad tools
request is a 400 naming its field. The tiny character-tokenizer model of test_structured.py,
with a chat template that writes the tools' names into the prompt, speculating with n-gram drafts."""

import json

import openai
import pytest
from test_server_structured import NGRAM, start_server, with_template
from test_structured import SCHEMA, output_text

import specjax
from specjax.serve.protocol import CHAT, COMPLETION, RequestError, parse_request
from specjax.serve.tool_calls import ToolCalls
from specjax.text import chat_prompt_ids

jsonschema = pytest.importorskip("jsonschema")

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}|{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}{{ c['function']['name'] }}({{ c['function']['arguments'] }})"
    "{% endfor %}|{% endfor %}<assistant>"
)
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}<assistant>"
COUNT = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_pet", "description": "a pet", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "count", "parameters": COUNT}},
]
PARAMETERS = {"get_pet": SCHEMA, "count": COUNT}
MESSAGES = [{"role": "user", "content": "a pet?"}]
GET_PET = {"type": "function", "function": {"name": "get_pet"}}


MODEL = with_template(TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def server():
    running = start_server(MODEL, constraint_states=4096)
    yield running
    running.close()


def reference(messages, schema: dict | None, new_tokens: int) -> str:
    """generate's greedy answer to the messages rendered with the tools, under `schema`."""
    prompt = chat_prompt_ids(MODEL.tokenizer, messages, tools=TOOLS)
    sampling = specjax.Sampling(json_schema=schema)
    tokens = specjax.generate(MODEL, [prompt], NGRAM, sampling, max_new_tokens=new_tokens).tokens[0]
    return output_text(tokens)[0]


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """A streamed answer's tool calls joined by index, as OpenAI's clients join them; its finish
    reason; its text content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


def test_a_named_function_is_called_with_arguments_its_schema_allows(server):
    options = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, tools=TOOLS)
    reply = server.client.chat.completions.create(**options, tool_choice=GET_PET)
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_pet"
    assert call.function.arguments == reference(MESSAGES, SCHEMA, 60)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    stream = server.client.chat.completions.create(**options, tool_choice=GET_PET, stream=True)
    calls, reason, content = streamed_calls(stream)
    assert calls == [{"name": "get_pet", "arguments": call.function.arguments}]
    assert reason == "stop" and content == ""


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_are_the_constrained_answer(server, parallel):
    schema = ToolCalls(TOOLS, "required", parallel=parallel).schema
    expected = json.loads(reference(MESSAGES, schema, 80))
    reply = server.client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=80,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
    )
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    calls = reply.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (e["name"], e["parameters"]) for e in expected
    ]
    assert len({c.id for c in calls}) == len(calls) and (parallel or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_call_cut_short_by_max_tokens_comes_back_as_text(server):
    schema = ToolCalls(TOOLS, "required").schema
    reply = server.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, tools=TOOLS, tool_choice="required"
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == reference(MESSAGES, schema, 6)


def test_a_conversation_with_calls_and_their_results(server):
    """An assistant's earlier call (content null) and the tool's answer render into the prompt;
    tool_choice "none" answers in free text, as generate does on that prompt."""
    arguments = json.dumps({"name": "cat", "ok": True})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_pet", "arguments": arguments}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
    ]
    reply = server.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, tools=TOOLS, tool_choice="none"
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == reference(messages, None, 12)
    assert reply.usage.prompt_tokens == len(chat_prompt_ids(MODEL.tokenizer, messages, tools=TOOLS))


def parse(body: dict, model: specjax.Model = MODEL, kind: str = CHAT):
    return parse_request({"messages": MESSAGES, **body}, kind, model.tokenizer, 97, 160)


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"tools": TOOLS}, "tool_choice", "tool_choice='auto' .* does not parse"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", r"it serves tool_choice \"required\""),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
            "fly",
        ),
        ({"tools": TOOLS, "tool_choice": {"function": "get_pet"}}, "tool_choice", "tool_choice must be"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0]", "must be"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "'get_pet' is given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
            "tools[0].function.name",
            "letters, digits",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
                "tool_choice": "none",
            },
            "tools[0].function.parameters",
            "must be a JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}
            | {"tool_choice": "required"},
            "tools",
            "Unsupported type: foo",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": 1},
            "parallel_tool_calls",
            "true or",
        ),
        (
            {"tools": TOOLS, "tool_choice": GET_PET, "response_format": {"type": "json_object"}},
            "response_format",
            "both constrain the answer",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_field(body, param, match):
    with pytest.raises(RequestError, match=match) as error:
        parse(body)
    assert error.value.param == param and error.value.status == 400


def test_a_template_that_does_not_render_tools_is_refused():
    with pytest.raises(RequestError, match="does not render tools .*'get_pet'") as error:
        parse({"tools": TOOLS, "tool_choice": "required"}, model=with_template(PLAIN_TEMPLATE))
    assert error.value.param == "tools"
    with pytest.raises(RequestError, match="unknown field 'tools'"):
        parse_request({"prompt": "x", "tools": TOOLS}, COMPLETION, MODEL.tokenizer, 97, 160)


def test_the_server_answers_a_bad_tools_request_with_400(server):
    with pytest.raises(openai.BadRequestError, match="does not parse") as error:
        server.client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS)
    assert error.value.body["param"] == "tool_choice"
