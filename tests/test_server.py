"""The OpenAI-compatible server (specjax/serve/app.py) over the real engine, queried with the
openai client: a request's text, tokens and finish reason are what `generate` gives its prompt
alone (greedy), streamed or not, one request at a time or several at once, and under load.

Servers run on local ports for the whole module: a completions server over a tiny random
model with the character tokenizer of tests/tiny.py, speculating with a DraftModel that is the
target itself (every draft is accepted, so the acceptance counters are known exactly); a chat
server, plain decoding, over a tiny random model with SmolLM2's vocabulary and chat template; a
load server with fewer slots than the requests sent at once, speculating with a SelfDraft that is
accepted part of the time (tests/drafters.py); and a server over an engine the tests hold in
their hand (`Controlled`: its steps wait for a gate, and a marked request makes a step fail), for
the overload bound and the recovery from a failed step."""

import asyncio
import concurrent.futures
import dataclasses
import functools
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import jax
import openai
import pytest
import uvicorn
from drafters import layered_target
from hf_export import save_hf_folder
from prometheus_client.parser import text_string_to_metric_families
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax.serve import make_app
from specjax.serve.engine import Engine

TEXT_MODEL = dataclasses.replace(tiny_model(seed=3), tokenizer=tiny_tokenizer(), name="tiny")
PROMPTS = ["Hello, world", "To be or not", "abcabcabc", "x"]
# The load server's target: its first layer with the head drafts its next token part of the time.
LOAD_MODEL = dataclasses.replace(
    layered_target(seed=11, late_scale=0.3), tokenizer=tiny_tokenizer(), name="tiny"
)
# Sixteen requests of 1 to 30 characters (prompt buckets 16 and 32: two prefill programs) and
# 3 to 39 new tokens, every third one streamed.
LOAD_JOBS = [
    ("The quick brown fox jumps over the lazy dog."[: 1 + (13 * i) % 31], 3 + (7 * i) % 37, i % 3 == 0)
    for i in range(16)
]


def fetch(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of a plain HTTP request (the standard library's client)."""
    request = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class Running:
    """A uvicorn server for `app` on a free local port, on a background thread."""

    def __init__(self, app):
        self.app = app
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listening]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=300)

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def metrics(self) -> dict:
        """/metrics as {(sample name, sorted labels but model_name): value}."""
        text = fetch("GET", f"{self.url}/metrics")[1].decode()
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def close(self):
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def text_server():
    # chunk_steps=2: a request's tokens come back over several Updates (several streamed deltas)
    engine = Engine(
        TEXT_MODEL, specjax.DraftModel(TEXT_MODEL, k=3), max_batch=2, max_model_len=96, chunk_steps=2
    )
    server = Running(make_app(engine))
    yield server
    server.close()


@pytest.fixture(scope="module")
def chat_model(smollm2):
    return dataclasses.replace(
        tiny_model(seed=5, vocab_size=smollm2.config.vocab_size, hidden_size=32, intermediate_size=48),
        tokenizer=smollm2.tokenizer,
        name="tiny-chat",
    )


@pytest.fixture(scope="module")
def chat_server(chat_model):
    engine = Engine(chat_model, None, max_batch=2, max_model_len=320, chunk_steps=2)
    server = Running(make_app(engine, served_model_name="chat"))
    yield server
    server.close()


def generated(model, prompt, max_new_tokens, chat=False, **sampling):
    """(text, tokens, finish reason) of `generate` on the prompt alone, greedy."""
    result = specjax.generate(
        model, [prompt], sampling=specjax.Sampling(**sampling), max_new_tokens=max_new_tokens, chat=chat
    )
    tokens = result.tokens[0]
    stopped = len(tokens) < max_new_tokens or tokens[-1] in specjax.planner.eos_ids(model)
    return result.texts[0], tokens, "stop" if stopped else "length"


def completion(server, prompt, max_tokens, stream=False, **options):
    """(text, finish reason, usage, speculate_metrics, chunks with text) of a completions request,
    streamed or not."""
    create = server.client.completions.create
    if not stream:
        response = create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, **options)
        choice = response.choices[0]
        return choice.text, choice.finish_reason, response.usage, choice.speculate_metrics, 1
    chunks = list(
        create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **options,
        )
    )
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    last = chunks[-2].choices[0]
    assert last.finish_reason is not None and all(c.choices[0].finish_reason is None for c in chunks[:-2])
    texts = [c.choices[0].text for c in chunks[:-1]]
    return "".join(texts), last.finish_reason, chunks[-1].usage, last.speculate_metrics, sum(map(bool, texts))


# ---------------------------------------------------------------------------------------------
# completions


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(text_server, stream):
    for prompt in PROMPTS[:2]:
        text, tokens, reason = generated(TEXT_MODEL, prompt, 24)
        got, finish_reason, usage, spec, pieces = completion(text_server, prompt, 24, stream=stream)
        assert (got, finish_reason) == (text, reason)
        assert pieces >= (2 if stream else 1)  # streamed, the text comes in several deltas
        prompt_tokens = len(TEXT_MODEL.tokenizer(prompt)["input_ids"])
        assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, len(tokens))
        assert usage.total_tokens == prompt_tokens + len(tokens)
        # the target drafting for itself: every draft accepted
        assert spec["acceptance_rate"] == 1.0 and spec["num_drafts"] > 0
        assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] == 3 * spec["num_drafts"]


def test_finish_reasons_stop_and_length(text_server):
    text, plain_tokens, reason = generated(TEXT_MODEL, PROMPTS[0], 24)
    assert reason == "length" and len(text) >= 12
    stop = text[8:10]  # ends the answer at its first occurrence, at the latest after 10 characters
    expected, tokens, _ = generated(TEXT_MODEL, PROMPTS[0], 24, stop=[stop])
    assert len(expected) <= 8
    for stream in (False, True):
        got, finish_reason, usage, _, _ = completion(text_server, PROMPTS[0], 24, stream=stream, stop=stop)
        assert (got, finish_reason, usage.completion_tokens) == (expected, "stop", len(tokens))
    # a stop token id ends it too, the token counted
    stop_id = plain_tokens[4]
    _, tokens, _ = generated(TEXT_MODEL, PROMPTS[0], 24, stop_token_ids=[stop_id])
    response = text_server.client.completions.create(
        model="tiny",
        prompt=PROMPTS[0],
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert response.choices[0].finish_reason == "stop" and response.usage.completion_tokens == len(tokens)


def test_concurrent_requests_each_equal_generate_alone(text_server):
    """Five requests at once on two slots: they wait, join and leave the batch in any order."""
    jobs = [(prompt, 8 + 5 * i, i % 2 == 1) for i, prompt in enumerate(PROMPTS + ["Once upon a time"])]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: completion(text_server, job[0], job[1], job[2])[:2], jobs))
    for (prompt, max_tokens, _), answer in zip(jobs, answers, strict=True):
        text, _, reason = generated(TEXT_MODEL, prompt, max_tokens)
        assert answer == (text, reason)


def test_spec_decode_counters_rise_and_the_opt_out_keeps_them(text_server):
    before = text_server.metrics()
    _, _, usage, spec, _ = completion(text_server, PROMPTS[1], 20)
    after = text_server.metrics()

    def rise(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert rise("specjax:spec_decode_num_drafts_total") == spec["num_drafts"] > 0
    assert rise("specjax:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert rise("specjax:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    for position in range(3):  # every draft accepted: each position once per drafting step
        assert (
            rise("specjax:spec_decode_num_accepted_tokens_per_pos_total", position=str(position))
            == (spec["num_drafts"])
        )
    assert rise("specjax:request_success_total", finished_reason="length") == 1
    assert rise("specjax:prompt_tokens_total") == usage.prompt_tokens
    assert rise("specjax:generation_tokens_total") == usage.completion_tokens
    assert rise("specjax:time_to_first_token_seconds_count") == 1
    assert rise("specjax:inter_token_latency_seconds_count") == usage.completion_tokens - 1
    assert rise("specjax:e2e_request_latency_seconds_count") == 1
    assert after[("specjax:num_requests_running", ())] == 0

    # "speculative": false decodes the request plainly: same text, no drafts, no figures
    text, _, _ = generated(TEXT_MODEL, PROMPTS[1], 20)
    response = text_server.client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=0, extra_body={"speculative": False}
    )
    assert response.choices[0].text == text and response.choices[0].speculate_metrics is None
    again = text_server.metrics()
    assert (
        again[("specjax:spec_decode_num_drafts_total", ())]
        == after[("specjax:spec_decode_num_drafts_total", ())]
    )


@pytest.mark.parametrize(
    "options, param, match",
    [
        ({"temperature": -1}, "temperature", "temperature must be a finite number >= 0"),
        ({"n": 0}, "n", "n must be an integer >= 1, got 0"),
        ({"n": 40}, "n", r"n=40 choices of 1 prompts make 40 engine requests; this server holds at most 10"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens=0 asks for no token: allowed only where the prompt"),
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be an integer >= 0, got -1"),
        ({"max_tokens": 500}, "max_tokens", "exceeds the server's max_model_len of 96"),
        ({"prompt": "x" * 100}, "prompt", "the prompt has 100 tokens, the server's max_model_len is 96"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ({"extra_body": {"speculative": "no"}}, "speculative", "speculative must be true or false"),
        ({"extra_body": {"min_tokens": 3}}, "min_tokens", "min_tokens=3 is not supported by this server"),
        ({"logprobs": 0}, "logprobs", r"logprobs=0: this server computes no logprobs \(it was started with"),
        # refused by the engine's own checks (engine.add's ValueError), the message its own
        ({"extra_body": {"stop_token_ids": list(range(20))}}, None, "at most 16 per request"),
    ],
)
def test_bad_requests_are_400_naming_the_field(text_server, options, param, match):
    options = {"prompt": "x", "max_tokens": 4} | options
    with pytest.raises(openai.BadRequestError, match=match) as error:
        text_server.client.completions.create(model="tiny", **options)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param and error.value.body["type"] == "invalid_request_error"


def test_other_errors_and_routes(text_server):
    # an unknown model is a 404, as OpenAI and vLLM answer it
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist") as error:
        text_server.client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    status, body = fetch("POST", f"{text_server.url}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="the served model's tokenizer has no chat template"):
        text_server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in text_server.client.models.list().data] == ["tiny"]
    assert fetch("GET", f"{text_server.url}/health") == (200, b"")
    # after the refused requests (these and test_bad_requests'), the server answers as before
    assert completion(text_server, PROMPTS[3], 8)[:2] == generated(TEXT_MODEL, PROMPTS[3], 8)[::2]
    assert text_server.scheduler.num_open == 0


# ---------------------------------------------------------------------------------------------
# chat


def chat(server, content, max_tokens, stream=False):
    messages = [{"role": "user", "content": content}]
    create = server.client.chat.completions.create
    if not stream:
        response = create(model="chat", messages=messages, max_tokens=max_tokens, temperature=0)
        choice = response.choices[0]
        assert choice.message.role == "assistant"
        return choice.message.content, choice.finish_reason, response.usage, choice.speculate_metrics
    chunks = list(create(model="chat", messages=messages, max_tokens=max_tokens, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # without stream_options.include_usage, as OpenAI
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason, None, chunks[-1].choices[0].speculate_metrics


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_generate(chat_model, chat_server, stream):
    for content in ["What is the capital of France?", "Write a haiku."]:
        text, tokens, reason = generated(chat_model, content, 16, chat=True)
        got, finish_reason, usage, spec = chat(chat_server, content, 16, stream=stream)
        assert (got, finish_reason, spec) == (text, reason, None)  # plain decoding: no figures
        if usage is not None:
            prompt = specjax.planner.tokenize(chat_model, [content], chat=True)[0]
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(tokens))


def test_a_disconnected_stream_is_aborted_and_disturbs_nothing(chat_model, chat_server):
    """A client that goes away mid-stream: its request is aborted and its slot freed, while a
    request beside it in the other slot runs on to generate's answer."""
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 280,
        "temperature": 0,
        "stream": True,
    }
    aborted = ("specjax:request_success_total", (("finished_reason", "abort"),))
    before = chat_server.metrics().get(aborted, 0)
    connection = http.client.HTTPConnection(*chat_server.url.removeprefix("http://").split(":"))
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first = response.readline()  # the first event: the role
    assert json.loads(first.removeprefix(b"data: "))["choices"][0]["delta"]["role"] == "assistant"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(chat, chat_server, "Write a haiku.", 48)
        engine = chat_server.app.state.engine  # (a haiku may be done before a look sees it there)
        wait_until(lambda: engine.num_running == 2 or beside.done(), "both requests run")
        connection.close()
        deadline = time.monotonic() + 30  # the client is gone: the engine drops its request
        while chat_server.metrics().get(aborted, 0) == before:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.05)
        text, _, reason = generated(chat_model, "Write a haiku.", 48, chat=True)
        assert beside.result()[:2] == (text, reason)
    wait_until(lambda: chat_server.scheduler.num_open == 0, "the requests are closed")
    assert engine.num_running == 0 and chat_server.metrics()[("specjax:num_requests_running", ())] == 0


# ---------------------------------------------------------------------------------------------
# under load: more requests than slots, a proposer accepted part of the time


@pytest.fixture(scope="module")
def load_server():
    # 4 slots for 16 requests at once; chunk_steps=3: rows join and leave between short chunks
    proposer = specjax.SelfDraft(layers=1, k=3)
    engine = Engine(LOAD_MODEL, proposer, max_batch=4, max_model_len=96, chunk_steps=3)
    server = Running(make_app(engine))
    yield server
    server.close()


@functools.cache
def load_reference(prompt: str, max_tokens: int) -> tuple[str, str, int]:
    """(text, finish reason, number of tokens) of `generate` on the prompt alone."""
    text, tokens, reason = generated(LOAD_MODEL, prompt, max_tokens)
    return text, reason, len(tokens)


def check_load(server, answers, before: dict) -> None:
    """Each answer (text, finish reason, usage) is generate's for its prompt alone, and the
    drafts were accepted part of the time (so rejections and rollbacks happened under load)."""
    for (prompt, max_tokens, stream), (text, reason, usage) in zip(LOAD_JOBS, answers, strict=True):
        expected = load_reference(prompt, max_tokens)
        assert (text, reason, usage.completion_tokens) == expected, (prompt, max_tokens, stream)
    after = server.metrics()

    def rise(name):
        return after[(name, ())] - before[(name, ())]

    drafted = rise("specjax:spec_decode_num_draft_tokens_total")
    assert 0 < rise("specjax:spec_decode_num_accepted_tokens_total") < drafted
    assert after[("specjax:num_requests_running", ())] == 0 and server.scheduler.num_open == 0


def test_sixteen_threads_on_four_slots_each_equal_generate_alone(load_server):
    """The sync client from 16 threads at once: 12 requests wait, and each joins the batch as
    a slot frees, beside rows at other positions; a third of them streamed."""
    assert load_server.scheduler.max_waiting == 16  # the default, 4 x max_batch: none is refused
    before = load_server.metrics()
    with concurrent.futures.ThreadPoolExecutor(len(LOAD_JOBS)) as pool:
        answers = list(pool.map(lambda job: completion(load_server, *job)[:3], LOAD_JOBS))
    check_load(load_server, answers, before)


def test_sixteen_threads_on_a_pool_of_pages_too_small_for_them_each_equal_generate_alone():
    """The same 16 requests on a paged engine whose pool holds one request of max_model_len but
    not four at once: rows wait for pages or are preempted and start again (Engine's page_size),
    and each answer is still generate's alone; /metrics counts the preemptions, the prefix cache's
    queries and hits and the cache in use, and every page is back at the end."""
    proposer = specjax.SelfDraft(layers=1, k=3)
    engine = Engine(
        LOAD_MODEL, proposer, max_batch=4, max_model_len=96, chunk_steps=3, page_size=16, num_pages=7
    )
    server = Running(make_app(engine))
    try:
        before = server.metrics()
        assert before[("specjax:kv_cache_usage_perc", ())] == 0
        with concurrent.futures.ThreadPoolExecutor(len(LOAD_JOBS)) as pool:
            answers = list(pool.map(lambda job: completion(server, *job)[:3], LOAD_JOBS))
        check_load(server, answers, before)
        after = server.metrics()
        # (whether rows were preempted depends on when the threads' requests came: the engine's
        # own tests preempt deterministically, tests/test_engine_pages.py)
        assert after[("specjax:num_preemptions_total", ())] == engine.stats.preemptions
        queries, hits = (
            engine.kv_cache.prefix_counts
        )  # (prompts that begin with "The quick brown " share a page)
        assert after[("specjax:prefix_cache_queries_total", ())] == queries > 0
        assert after[("specjax:prefix_cache_hits_total", ())] == hits > 0
        assert after[("specjax:kv_cache_usage_perc", ())] == 0
        assert engine.kv_cache.usage(engine.num_running) == 0
    finally:
        server.close()


def test_sixteen_threads_on_a_tensor_and_data_parallel_engine_each_equal_generate_alone():
    """The same 16 requests on an engine on a mesh of 4 fake devices (model 2 x data 2, as
    `specjax serve --tensor-parallel-size 2 --data-parallel-size 2` builds it) with an n-gram
    proposer: the server sees one engine, and each answer is generate's alone."""
    mesh = specjax.sharding.make_mesh(model=2, data=2, devices=jax.devices()[:4])
    engine = Engine(LOAD_MODEL, specjax.NGram(k=3), max_batch=4, max_model_len=96, chunk_steps=3, mesh=mesh)
    server = Running(make_app(engine))
    try:
        before = server.metrics()
        with concurrent.futures.ThreadPoolExecutor(len(LOAD_JOBS)) as pool:
            answers = list(pool.map(lambda job: completion(server, *job)[:3], LOAD_JOBS))
        check_load(server, answers, before)
    finally:
        server.close()


async def async_completion(client, prompt: str, max_tokens: int, stream: bool):
    """(text, finish reason, usage) of a completions request with the async client."""
    options = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
    if not stream:
        response = await client.completions.create(**options)
        return response.choices[0].text, response.choices[0].finish_reason, response.usage
    chunks = await client.completions.create(**options, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in chunks]
    text = "".join(c.choices[0].text for c in chunks[:-1])
    return text, chunks[-2].choices[0].finish_reason, chunks[-1].usage


def test_sixteen_async_requests_each_equal_generate_alone(load_server):
    """The same 16 requests from one event loop (openai.AsyncOpenAI and asyncio.gather)."""

    async def all_at_once():
        url = f"{load_server.url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(async_completion(client, *job) for job in LOAD_JOBS))

    before = load_server.metrics()
    check_load(load_server, asyncio.run(all_at_once()), before)


# ---------------------------------------------------------------------------------------------
# overload and failures, over an engine held in the test's hand

POISON = "poison"  # the prompt of a request that makes the Controlled engine's next step fail


class Controlled:
    """An Engine that the scheduler drives through Engine's interface as usual, but whose
    `step` waits for the test's permission (`hold`, `allow`, `release`), and fails when a request
    with the prompt POISON is in the engine, taking that request with it, as a step fails whose
    admission of a request fails (e.g. the engine refusing its stop strings)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.poison = engine.model.tokenizer(POISON)["input_ids"]
        self.poisoned: list[int] = []
        self.changed = threading.Condition()
        self.allowed: int | None = None  # steps that may start; None: any number
        self.steps_done = 0

    def __getattr__(self, name):  # max_batch, model, has_work, num_running, ...: the engine's
        return getattr(self.engine, name)

    def hold(self) -> None:
        with self.changed:
            self.allowed = 0

    def allow(self, steps: int) -> None:
        with self.changed:
            self.allowed += steps
            self.changed.notify_all()

    def release(self) -> None:
        with self.changed:
            self.allowed = None
            self.changed.notify_all()

    def add(self, request) -> int:
        request_id = self.engine.add(request)
        if list(request.prompt) == self.poison:
            self.poisoned.append(request_id)
        return request_id

    def step(self):
        with self.changed:
            self.changed.wait_for(lambda: self.allowed is None or self.allowed > 0)
            if self.allowed is not None:
                self.allowed -= 1
        try:
            while self.poisoned:
                if self.engine.abort(self.poisoned.pop()):  # it was in the engine: the step took it
                    raise RuntimeError("the poisoned request broke the step")
            return self.engine.step()
        finally:
            with self.changed:
                self.steps_done += 1
                self.changed.notify_all()

    def step_once(self) -> None:
        """Let one step run, and wait until it has."""
        with self.changed:
            done = self.steps_done
        self.allow(1)
        with self.changed:
            assert self.changed.wait_for(lambda: self.steps_done > done, timeout=60), "no step ran"


def wait_until(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def held_server():
    """Two slots, at most two requests waiting for one."""
    engine = Controlled(Engine(TEXT_MODEL, None, max_batch=2, max_model_len=96, chunk_steps=2))
    server = Running(make_app(engine, max_waiting=2))
    yield server
    engine.release()
    server.close()


def test_past_max_waiting_requests_get_503_and_the_others_are_served(held_server):
    """With the engine held, six requests come at once: two take the slots, two wait, two are
    refused at once with 503 in OpenAI's error shape (a streamed one too); /health answers
    meanwhile, and once the engine goes on the four are served as generate serves them."""
    engine, scheduler = held_server.app.state.engine, held_server.scheduler
    jobs = [(prompt, 10 + 3 * i) for i, prompt in enumerate(PROMPTS + ["Once upon", "zzz"])]
    before = held_server.metrics()
    engine.hold()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(completion, held_server, *job) for job in jobs]
            wait_until(lambda: sum(f.done() for f in futures) == 2, "two requests are refused")
            assert scheduler.num_open == 4
            with pytest.raises(openai.InternalServerError, match="max_waiting=2") as refused:
                completion(held_server, PROMPTS[0], 4, stream=True)
            assert fetch("GET", f"{held_server.url}/health") == (200, b"")
            engine.release()
            outcomes = [f.exception() or f.result() for f in futures]
    finally:
        engine.release()
    error = refused.value
    assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
    assert error.body["type"] == "server_error" and error.body["code"] == "server_overloaded"
    assert "retry later" in error.body["message"] and "--max-waiting" in error.body["message"]
    served = 0
    for (prompt, max_tokens), outcome in zip(jobs, outcomes, strict=True):
        if isinstance(outcome, Exception):
            assert isinstance(outcome, openai.InternalServerError) and outcome.status_code == 503
            assert outcome.body["code"] == "server_overloaded"
        else:
            text, _, reason = generated(TEXT_MODEL, prompt, max_tokens)
            assert outcome[:2] == (text, reason)
            served += 1
    assert served == 4
    after = held_server.metrics()
    key = ("specjax:request_overloaded_total", ())
    assert after[key] - before.get(key, 0) == 3
    # the server goes on as before
    assert completion(held_server, PROMPTS[2], 12)[:2] == generated(TEXT_MODEL, PROMPTS[2], 12)[::2]
    assert fetch("GET", f"{held_server.url}/health") == (200, b"") and scheduler.num_open == 0


def test_a_failed_step_ends_its_request_alone(held_server):
    """Two streams in the slots, one request waiting, then a request whose admission makes the
    step fail: it alone gets an error (500); the streams go on, the waiting request is queued
    again and served, and the server answers the next request."""
    engine, scheduler = held_server.app.state.engine, held_server.scheduler
    streamed = [(PROMPTS[0], 40), (PROMPTS[1], 36)]
    engine.hold()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(completion, held_server, p, m, True) for p, m in streamed]
            wait_until(lambda: scheduler.num_open == 2, "both streams are submitted")
            while engine.num_running < 2:  # step until both are in a slot and have sent tokens
                engine.step_once()
            waiting = pool.submit(completion, held_server, PROMPTS[2], 20)
            poisoned = pool.submit(completion, held_server, POISON, 8)
            wait_until(lambda: scheduler.num_open == 4, "the waiting and the poisoned request are in")
            engine.release()
            with pytest.raises(openai.InternalServerError, match="the poisoned request broke the step"):
                poisoned.result()
            for (prompt, max_tokens), stream in zip(streamed, streams, strict=True):
                assert stream.result()[:2] == generated(TEXT_MODEL, prompt, max_tokens)[::2]
            assert waiting.result()[:2] == generated(TEXT_MODEL, PROMPTS[2], 20)[::2]
    finally:
        engine.release()
    assert completion(held_server, PROMPTS[3], 12)[:2] == generated(TEXT_MODEL, PROMPTS[3], 12)[::2]
    assert fetch("GET", f"{held_server.url}/health") == (200, b"") and scheduler.num_open == 0


def test_stop_strings_past_the_automaton_fail_their_request_alone():
    """A real admission failure (not Controlled's poison): the request alone fails, the one
    beside it runs on, and the server serves the next request."""
    engine = Controlled(Engine(TEXT_MODEL, None, max_batch=2, max_model_len=64, chunk_steps=2))
    server = Running(make_app(engine))
    stops = [f"{i:02d}qwertyuiop" for i in range(20)]  # ~220 automaton states, max_stop_states=64
    try:
        engine.hold()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            beside = pool.submit(completion, server, PROMPTS[0], 40, True)
            wait_until(lambda: server.scheduler.num_open == 1, "the first request is submitted")
            engine.step_once()  # it is in slot 0 and has sent tokens
            refused = pool.submit(completion, server, "x", 8, stop=stops)
            wait_until(lambda: server.scheduler.num_open == 2, "the second request is submitted")
            engine.release()
            with pytest.raises((openai.BadRequestError, openai.InternalServerError), match="sampling.stop"):
                refused.result()
            assert beside.result()[:2] == generated(TEXT_MODEL, PROMPTS[0], 40)[::2]
        # slot 0 is free again, slot 1 was the refused request's
        assert completion(server, PROMPTS[1], 8)[:2] == generated(TEXT_MODEL, PROMPTS[1], 8)[::2]
    finally:
        engine.release()
        server.close()


# ---------------------------------------------------------------------------------------------
# the command


def test_serve_command_passes_max_waiting_and_admission_steps_on(monkeypatch):
    from specjax.cli import main

    with pytest.raises(ValueError, match="serve: max_waiting must be an integer >= 0, got -1"):
        specjax.serve.serve("no-such-model", max_waiting=-1)  # refused before the model loads
    with pytest.raises(ValueError, match="make_app: max_waiting must be an integer >= 0, got 1.5"):
        make_app(types.SimpleNamespace(model=TEXT_MODEL, max_batch=1), max_waiting=1.5)
    calls = []
    monkeypatch.setattr(specjax.serve.app, "serve", lambda model, config, **options: calls.append(options))
    assert main(["serve", "m", "--max-batch", "3", "--max-waiting", "0", "--admission-steps", "2"]) == 0
    assert main(["serve", "m"]) == 0
    # None: 4 x max_batch waiting, and the engine's admission_steps
    options = [(c["max_batch"], c["max_waiting"], c["admission_steps"]) for c in calls]
    assert options == [(3, 0, 2), (8, None, None)]


def test_serve_command_errors_are_one_line(tmp_path, capsys):
    from specjax.cli import main

    save_hf_folder(TEXT_MODEL, tmp_path / "model")
    TEXT_MODEL.tokenizer.save_pretrained(tmp_path / "model")
    assert main(["serve", str(tmp_path / "model"), "--speculative-config", "{no"]) == 2
    assert "--speculative-config: not valid JSON" in capsys.readouterr().err
    config = json.dumps({"method": "suffix"})
    assert main(["serve", str(tmp_path / "model"), "--speculative-config", config]) == 2
    assert "unknown method 'suffix'; allowed: ngram" in capsys.readouterr().err


@pytest.mark.slow
def test_specjax_serve_command(tmp_path):
    """`specjax serve FOLDER --speculative-config ...` in its own process answers like generate."""
    save_hf_folder(TEXT_MODEL, tmp_path / "model")
    TEXT_MODEL.tokenizer.save_pretrained(tmp_path / "model")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    command = [sys.executable, "-m", "specjax.cli", "serve", str(tmp_path / "model"), "--port", str(port)]
    command += ["--speculative-config", config, "--served-model-name", "tiny", "--max-model-len", "64"]
    command += ["--max-waiting", "2"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if fetch("GET", f"http://127.0.0.1:{port}/health")[0] == 200:
                    break
            except OSError:  # not listening yet
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        response = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0)
        assert response.choices[0].text == generated(TEXT_MODEL, PROMPTS[2], 16)[0]
        assert response.choices[0].speculate_metrics["num_drafts"] > 0
    finally:
        process.terminate()
        process.wait(30)
