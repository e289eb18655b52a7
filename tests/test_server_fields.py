"""The server's vLLM and OpenAI extras (specjax/serve/protocol.py, app.py, routes.py, guard.py),
through the openai client and raw HTTP: ignore_eos, include_stop_str_in_output,
skip_special_tokens, the chat template's options, continuous usage, n choices and lists of
prompts, the fields ignored and the fields refused, the tokenizer routes, X-Request-Id, and the
guard (API key, CORS, the body limit) and the error shape of every refusal.

One server for the module: a tiny random model with the character tokenizer of tests/tiny.py and a
chat template, whose EOS is a token its greedy answer to PROMPT holds early (so that ignore_eos
changes the answer), speculating with a DraftModel that is the target itself. The guard's tests
run a second app, with a key, CORS and a small body limit, whose requests never reach its engine.
"""

import concurrent.futures
import dataclasses
import http.client
import json
import logging

import openai
import pytest
from test_server import Running, fetch
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax.serve import make_app
from specjax.serve.engine import Engine

PROMPT = "Hello, world"
# Messages end with "|"; `note` is a variable the template reads (chat_template_kwargs).
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if note is defined %}({{ note }}){% endif %}"
)


def plain_model():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return dataclasses.replace(tiny_model(seed=3), tokenizer=tokenizer, name="tiny")


PLAIN = plain_model()  # EOS: the tokenizer's <eos> (96), which its greedy answers do not reach


def reference(model, prompt, max_new_tokens, proposer=None, **sampling):
    """(text, tokens) of `generate` on the prompt alone."""
    sampling = specjax.Sampling(**({"temperature": 0} | sampling))
    result = specjax.generate(model, [prompt], proposer, sampling=sampling, max_new_tokens=max_new_tokens)
    return result.texts[0], result.tokens[0]


def early_eos_model():
    """PLAIN with an EOS that its greedy answer to PROMPT reaches at its fourth token."""
    _, tokens = reference(PLAIN, PROMPT, 24)
    config = dataclasses.replace(PLAIN.config, eos_token_ids=(tokens[3],))
    return dataclasses.replace(PLAIN, config=config)


EOS_MODEL = early_eos_model()


@pytest.fixture(scope="module")
def server():
    engine = Engine(
        EOS_MODEL, specjax.DraftModel(EOS_MODEL, k=2), max_batch=4, max_model_len=96, chunk_steps=2
    )
    running = Running(make_app(engine, max_waiting=4))
    yield running
    running.close()


def complete(server, stream=False, **options):
    """(texts by index, finish reasons by index, usage, chunks) of a completions request."""
    options = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0} | options
    if not stream:
        response = server.client.completions.create(**options)
        choices = sorted(response.choices, key=lambda c: c.index)
        return [c.text for c in choices], [c.finish_reason for c in choices], response.usage, [response]
    options["stream_options"] = {"include_usage": True} | options.get("stream_options", {})
    chunks = list(server.client.completions.create(stream=True, **options))
    texts, reasons = {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    assert chunks[-1].choices == []
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)], chunks[-1].usage, chunks


# ---------------------------------------------------------------------------------------------
# vLLM's output fields


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_runs_past_eos_to_max_tokens(server, stream):
    stopped_text, stopped_tokens = reference(EOS_MODEL, PROMPT, 24)
    assert len(stopped_tokens) <= 4  # the model's EOS ends its answer early
    texts, reasons, usage, _ = complete(server, stream)
    assert (texts, reasons, usage.completion_tokens) == ([stopped_text], ["stop"], len(stopped_tokens))
    # ignoring EOS, the answer is the one of the same weights without that EOS, to the budget
    full_text, full_tokens = reference(PLAIN, PROMPT, 24)
    assert len(full_tokens) == 24
    texts, reasons, usage, _ = complete(server, stream, extra_body={"ignore_eos": True})
    assert (texts, reasons, usage.completion_tokens) == ([full_text], ["length"], 24)
    # a stop token id still ends it
    _, tokens = reference(PLAIN, PROMPT, 24, stop_token_ids=[full_tokens[9]])
    extra = {"ignore_eos": True, "stop_token_ids": [full_tokens[9]]}
    _, reasons, usage, _ = complete(server, stream, extra_body=extra)
    assert (reasons, usage.completion_tokens) == (["stop"], len(tokens))


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(server, stream):
    full_text, _ = reference(PLAIN, PROMPT, 24)
    stop = full_text[6:8]
    at = full_text.find(stop)
    common = {"stop": [stop], "extra_body": {"ignore_eos": True}}
    texts, reasons, _, _ = complete(server, stream, **common)
    assert (texts, reasons) == ([full_text[:at]], ["stop"])
    kept = dict(common, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    texts, reasons, _, _ = complete(server, stream, **kept)
    assert (texts, reasons) == ([full_text[: at + len(stop)]], ["stop"])


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_the_eos_text(server, stream):
    # a bias that makes <eos> (a special token, and EOS) the first token
    forced = {"logit_bias": {"96": 100}, "max_tokens": 4}
    texts, reasons, usage, _ = complete(server, stream, **forced)
    assert (texts, reasons, usage.completion_tokens) == ([""], ["stop"], 1)
    texts, _, _, _ = complete(server, stream, **forced, extra_body={"skip_special_tokens": False})
    assert texts == ["<eos>"]


def test_continuous_usage_stats_put_the_usage_in_every_chunk(server):
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    texts, _, usage, chunks = complete(server, True, **options, extra_body={"ignore_eos": True})
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == usage.prompt_tokens for c in chunks)
    assert counts == sorted(counts) and counts[-1] == usage.completion_tokens == 24 and len(counts) > 2
    # without include_usage: the usage in every chunk all the same, no usage chunk at the end
    only = {"continuous_usage_stats": True}
    chunks = list(
        server.client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options=only
        )
    )
    assert all(c.choices for c in chunks) and chunks[-1].usage.completion_tokens <= 6


# ---------------------------------------------------------------------------------------------
# n choices and lists of prompts


def test_n_seeded_choices_draw_with_seed_plus_j(server):
    options = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    texts, _, usage, _ = complete(server, n=3, seed=5, **options)
    # (a sampled answer's tokens depend on the proposer: the server's drafts for itself)
    drafts = specjax.DraftModel(PLAIN, k=2)
    expected = [reference(PLAIN, PROMPT, 12, drafts, temperature=1.0, seed=5 + j)[0] for j in range(3)]
    assert texts == expected and len(set(texts)) > 1
    assert usage.completion_tokens == 36 and usage.prompt_tokens == len(PROMPT)  # the prompt once
    streamed, reasons, usage, _ = complete(server, True, n=3, seed=5, **options)
    assert streamed == expected and reasons == ["length"] * 3 and usage.completion_tokens == 36
    # without a seed, each choice draws its own (four alike would be a bug, or a 97**-44 chance)
    texts, _, _, _ = complete(server, n=4, **options)
    assert len(set(texts)) > 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gets_n_choices_each_in_order(server, stream):
    prompts = [PROMPT, "To be or not"]
    options = {"n": 2, "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    texts, _, usage, _ = complete(server, stream, prompt=prompts, **options)
    expected = [reference(PLAIN, p, 10)[0] for p in prompts]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]  # choice i * n + j
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[0]) + len(prompts[1]), 40)
    ids = [PLAIN.tokenizer(p)["input_ids"] for p in prompts]
    texts, _, _, _ = complete(server, stream, prompt=ids, **options)
    assert texts == [expected[0], expected[0], expected[1], expected[1]]


def test_chat_n_and_the_harmless_fields(server, caplog):
    messages = [{"role": "user", "content": "hi"}]
    ids = PLAIN.tokenizer("<user>hi|<assistant>", add_special_tokens=False)["input_ids"]
    text, tokens = reference(PLAIN, ids, 8)
    with caplog.at_level(logging.WARNING, logger="specjax.serve"):
        response = server.client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
            n=2,
            store=False,
            metadata={"run": "test"},
            service_tier="auto",
            parallel_tool_calls=False,
            user="someone",
            extra_body={"ignore_eos": True},
        )
    assert [c.message.content for c in response.choices] == [text, text]
    assert [c.index for c in response.choices] == [0, 1] and response.usage.prompt_tokens == len(ids)
    logged = " ".join(r.getMessage() for r in caplog.records)
    for name in ("store", "metadata", "service_tier", "user"):
        assert f"field {name!r} is ignored" in logged
    stream = server.client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        n=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            got[choice.index] += choice.delta.content or ""
    assert got == {0: text, 1: text}


def test_the_chat_templates_options(server):
    def tokenize(**body):
        status, answer = fetch("POST", f"{server.url}/tokenize", json.dumps(body).encode())
        assert status == 200, answer
        return json.loads(answer)["tokens"]

    def ids(text):
        return PLAIN.tokenizer(text, add_special_tokens=False)["input_ids"]

    user = [{"role": "user", "content": "hi"}]
    started = user + [{"role": "assistant", "content": "Once"}]
    assert tokenize(messages=user) == ids("<user>hi|<assistant>")
    assert tokenize(messages=user, chat_template_kwargs={"note": "x"}) == ids("<user>hi|<assistant>(x)")
    assert tokenize(messages=user, add_generation_prompt=False) == ids("<user>hi|")
    assert tokenize(messages=started, continue_final_message=True) == ids("<user>hi|<assistant>Once")
    # the chat route builds the same prompt, and answers generate's for it
    prompt = ids("<user>hi|<assistant>Once")
    text, _ = reference(PLAIN, prompt, 6)
    response = server.client.chat.completions.create(
        model="tiny",
        messages=started,
        max_tokens=6,
        temperature=0,
        extra_body={"continue_final_message": True, "ignore_eos": True},
    )
    assert response.choices[0].message.content == text and response.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    "options, param, match",
    [
        ({"logprobs": True}, "logprobs", "logprobs=true: this server computes no logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs", "top_logprobs=2: this server computes no"),
        ({"response_format": {"type": "json_object"}}, "response_format", "without constraint tables"),
        (
            {"extra_body": {"prompt_logprobs": 1}},
            "prompt_logprobs",
            "prompt_logprobs=1: this server computes",
        ),
        ({"extra_body": {"echo": True}}, "echo", "echo=true is not supported for chat completions"),
        ({"extra_body": {"min_tokens": 2}}, "min_tokens", "min_tokens=2 is not supported"),
        ({"extra_body": {"temprature": 0.5}}, "temprature", "unknown field 'temprature'"),
        ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos", "ignore_eos must be true or false"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs", "tokenize"),
        (
            {"extra_body": {"continue_final_message": True, "add_generation_prompt": True}},
            "continue_final_message",
            "cannot both be true",
        ),
        ({"store": "no"}, "store", "store must be a bool"),
        ({"metadata": {"a": 1}}, "metadata", "metadata must map strings to strings"),
    ],
)
def test_refused_chat_fields_are_400_naming_them(server, options, param, match):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match=match) as error:
        server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **options)
    assert error.value.body["param"] == param and error.value.body["type"] == "invalid_request_error"


def test_logprobs_on_a_server_without_them_and_best_of_are_refused(server):
    for options, match in [
        ({"logprobs": 0}, "logprobs=0: this server computes no logprobs"),
        ({"logprobs": 1, "echo": True}, "logprobs=1: this server computes no logprobs"),
        ({"best_of": 2}, r"best_of=2 is not supported by this server \(accepted: null, or n=1\)"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            server.client.completions.create(model="tiny", prompt="x", max_tokens=1, **options)
    # a token-id prompt past the context is refused by its length
    with pytest.raises(
        openai.BadRequestError, match="the prompt has 5000 tokens, the server's max_model_len is 96"
    ):
        server.client.completions.create(model="tiny", prompt=[1] * 5000, max_tokens=1)


# ---------------------------------------------------------------------------------------------
# routes and errors


def get(server, path, method="GET", body=None, headers=None):
    connection = http.client.HTTPConnection(*server.url.removeprefix("http://").split(":"), timeout=60)
    connection.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    is_json = response.getheader("content-type", "").startswith("application/json")
    return response.status, dict(response.getheaders()), json.loads(answer) if is_json else answer


def check_error(answer, message, code=None):
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert message in answer["error"]["message"] and answer["error"]["code"] == code


def test_the_tokenizer_routes(server):
    tokenizer = PLAIN.tokenizer
    status, _, answer = get(
        server, "/tokenize", "POST", json.dumps({"prompt": "a c", "return_token_strs": True})
    )
    assert status == 200 and answer["tokens"] == tokenizer("a c")["input_ids"] == [65, 0, 67]
    assert answer["count"] == 3 and answer["max_model_len"] == 96 and answer["token_strs"] == ["a", " ", "c"]
    status, _, answer = get(server, "/detokenize", "POST", json.dumps({"tokens": [95, 0, 67, 96]}))
    assert (status, answer) == (200, {"prompt": "ab c<eos>"})
    status, _, info = get(server, "/tokenizer_info")
    assert status == 200 and info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == "<eos>" and info["chat_template"] == TEMPLATE and info["vocab_size"] == 97
    status, _, answer = get(server, "/detokenize", "POST", json.dumps({"tokens": [500]}))
    assert status == 400 and answer["error"]["param"] == "tokens"
    status, _, answer = get(server, "/tokenize", "POST", json.dumps({"prompt": "x", "model": "other"}))
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_models_version_and_errors_in_openais_shape(server):
    assert server.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist") as error:
        server.client.models.retrieve("gpt-4")
    assert error.value.body["code"] == "model_not_found"
    status, _, answer = get(server, "/version")
    assert (status, answer) == (200, {"version": specjax.__version__})
    status, _, answer = get(server, "/v1/nothing", "POST", b"{}")
    assert status == 404
    check_error(answer, "no route POST /v1/nothing", "not_found")
    status, headers, answer = get(server, "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    check_error(answer, "GET is not allowed on /v1/completions (allowed: POST)", "method_not_allowed")


def test_x_request_id_is_echoed_and_names_the_response(server):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0})
    status, headers, answer = get(server, "/v1/completions", "POST", body, {"X-Request-Id": "run-7/42"})
    assert status == 200 and headers["x-request-id"] == "run-7/42" and answer["id"] == "run-7/42"
    status, headers, answer = get(server, "/v1/completions", "POST", body)
    assert answer["id"].startswith("cmpl-") and headers["x-request-id"] == answer["id"]
    status, headers, answer = get(server, "/v1/models", headers={"X-Request-Id": "m-1"})
    assert status == 200 and headers["x-request-id"] == "m-1"
    status, _, answer = get(server, "/v1/models", headers={"X-Request-Id": "x" * 300})
    assert status == 400 and answer["error"]["param"] == "X-Request-Id"


def test_choices_refused_together_leave_the_server_as_it_was(server):
    """A request whose choices pass the engine's slots and queue at once is refused whole (400);
    the server then serves the next request as before."""
    with pytest.raises(openai.BadRequestError, match="holds at most 8 at once"):
        complete(server, n=3, prompt=[PROMPT, "a", "b"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda p: complete(server, prompt=p, max_tokens=8)[0], [PROMPT, "abc"]))
    assert both == [[reference(EOS_MODEL, p, 8)[0]] for p in [PROMPT, "abc"]]
    assert server.scheduler.num_open == 0


# ---------------------------------------------------------------------------------------------
# the guard: an API key, CORS, the body limit


@pytest.fixture(scope="module")
def guarded():
    engine = Engine(PLAIN, None, max_batch=1, max_model_len=64, chunk_steps=2)
    app = make_app(engine, api_key="sekret", allowed_origins=["http://example.com"], max_request_bytes=1000)
    running = Running(app)
    yield running
    running.close()


KEY = {"Authorization": "Bearer sekret"}


def test_the_api_key_is_required_but_for_health_and_metrics(guarded):
    status, headers, answer = get(guarded, "/v1/models")
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    check_error(answer, "the request has no API key", "invalid_api_key")
    status, _, answer = get(guarded, "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401 and "a wrong API key" in answer["error"]["message"]
    assert get(guarded, "/v1/models", headers=KEY)[0] == 200
    assert get(guarded, "/health")[0] == 200 and fetch("GET", f"{guarded.url}/metrics")[0] == 200
    wrong = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sekret", max_retries=0)
    assert (
        right.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).choices[0].text
        == (reference(PLAIN, "x", 2)[0])
    )


def test_monitoring_can_be_protected_and_bad_settings_are_refused():
    engine = Engine(PLAIN, None, max_batch=1, max_model_len=64)
    running = Running(make_app(engine, api_key="k", protect_monitoring=True))
    try:
        assert get(running, "/health")[0] == 401 and get(running, "/metrics")[0] == 401
        assert get(running, "/health", headers={"Authorization": "Bearer k"})[0] == 200
    finally:
        running.close()
    for options, match in [
        ({"api_key": ""}, "api_key must be None"),
        ({"max_request_bytes": 0}, "max_request_bytes must be an integer >= 1"),
        ({"allowed_origins": "http://a"}, "allowed_origins must be a list of origins"),
    ]:
        with pytest.raises(ValueError, match=f"make_app: {match}"):
            make_app(engine, **options)


def test_cors_preflight_and_headers(guarded):
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    status, headers, _ = get(guarded, "/v1/chat/completions", "OPTIONS", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "http://example.com"
    status, headers, _ = get(guarded, "/v1/models", headers={"Origin": "http://example.com", **KEY})
    assert status == 200 and headers["access-control-allow-origin"] == "http://example.com"
    status, headers, _ = get(guarded, "/v1/models", headers={"Origin": "http://example.com"})
    assert status == 401 and headers["access-control-allow-origin"] == "http://example.com"
    status, headers, _ = get(
        guarded,
        "/v1/models",
        "OPTIONS",
        headers={"Origin": "http://evil.com", "Access-Control-Request-Method": "GET"},
    )
    assert status == 400 and "access-control-allow-origin" not in headers


def test_a_body_over_the_limit_is_413_before_it_is_read(guarded):
    big = json.dumps({"model": "tiny", "prompt": "x" * 2000}).encode()
    status, _, answer = get(guarded, "/v1/completions", "POST", big, KEY)
    assert status == 413
    check_error(
        answer, f"its Content-Length is {len(big)} bytes, the server takes at most 1000", "request_too_large"
    )
    # a Content-Length of a gigabyte, and 10 bytes sent: the answer comes without waiting for the rest
    connection = http.client.HTTPConnection(*guarded.url.removeprefix("http://").split(":"), timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {"Content-Length": str(10**9), "Content-Type": "application/json", **KEY}.items():
        connection.putheader(name, value)
    connection.endheaders(b'{"prompt":')
    response = connection.getresponse()
    assert response.status == 413 and b"1000000000 bytes" in response.read()
    connection.close()
    # chunked, no Content-Length: refused once the bytes read pass the limit (4 chunks of 300
    # bytes sent, the upload left unfinished: the answer does not wait for its end)
    connection = http.client.HTTPConnection(*guarded.url.removeprefix("http://").split(":"), timeout=10)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {"Transfer-Encoding": "chunked", "Content-Type": "application/json", **KEY}.items():
        connection.putheader(name, value)
    connection.endheaders()
    for _ in range(4):
        connection.send(b"12c\r\n" + b"x" * 300 + b"\r\n")  # (0x12c = 300)
    response = connection.getresponse()
    assert response.status == 413 and b"over 1000 bytes" in response.read()
    connection.close()
    # and the server answers on
    assert get(guarded, "/v1/models", headers=KEY)[0] == 200


def test_a_failing_route_and_a_validation_error_answer_in_openais_shape(guarded):
    """Routes added for the test: one that raises (500), one whose query FastAPI validates (400)."""

    def boom():
        raise RuntimeError("a bug")

    def count(n: int):
        return {"n": n}

    guarded.app.add_api_route("/test-boom", boom)
    guarded.app.add_api_route("/test-count", count)
    status, _, answer = get(guarded, "/test-boom", headers=KEY)
    assert status == 500 and answer["error"]["type"] == "server_error"
    check_error(answer, "the server failed on the request: RuntimeError('a bug')")
    status, _, answer = get(guarded, "/test-count?n=many", headers=KEY)
    assert (
        status == 400
        and answer["error"]["param"] == "n"
        and answer["error"]["type"] == "invalid_request_error"
    )
    assert get(guarded, "/test-count?n=3", headers=KEY)[2] == {"n": 3}


# ---------------------------------------------------------------------------------------------
# the command


def test_serve_takes_the_key_from_the_environment_and_the_command_passes_the_options(monkeypatch):
    from specjax.cli import main

    monkeypatch.setenv("SPECJAX_API_KEY", " ")
    with pytest.raises(ValueError, match="serve: api_key must be None .* got ' '"):
        specjax.serve.serve("no-such-model")  # refused before the model loads
    calls = []
    monkeypatch.setattr(specjax.serve.app, "serve", lambda model, config, **options: calls.append(options))
    argv = ["serve", "m", "--api-key", "k", "--protect-monitoring", "--allowed-origins", "http://a", "*"]
    assert main([*argv, "--max-request-bytes", "500"]) == 0
    assert main(["serve", "m"]) == 0
    options = [
        (c["api_key"], c["protect_monitoring"], tuple(c["allowed_origins"]), c["max_request_bytes"])
        for c in calls
    ]
    assert options == [("k", True, ("http://a", "*"), 500), (None, False, (), 8 * 1024 * 1024)]
