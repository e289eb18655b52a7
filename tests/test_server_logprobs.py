"""The server's logprobs (specjax/serve/logprob_bodies.py, protocol.py, app.py), through the openai
client and raw HTTP: completions' logprobs=N in OpenAI's legacy shape, echo (the prompt's
logprobs first) and max_tokens=0, chat's logprobs and top_logprobs, vLLM's prompt_logprobs and
return_tokens_as_token_ids, streamed and whole, n choices, and the refusals.

The reference is `generate(..., logprobs=N, prompt_logprobs=N)` on the prompt alone, whose
logprobs test_logprobs.py checks against transformers' logits and plain decoding. One server
for the module: a tiny random model with the character tokenizer of tests/tiny.py, speculating
with a DraftModel that is the target itself (so drafts are accepted and the verify passes' logprobs
are the ones reported), computing at most MAX alternatives per token.
"""

import dataclasses
import json

import numpy as np
import pytest
from test_server import Running, fetch
from tiny import tiny_model, tiny_tokenizer

import specjax
from specjax.serve import make_app
from specjax.serve.engine import Engine

MAX = 3  # the server's most alternatives per token (EngineConfig.logprobs, --max-logprobs)
PROMPT = "Hello, world"
TOL = 1e-5
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}<assistant>"


def model():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return dataclasses.replace(tiny_model(seed=3), tokenizer=tokenizer, name="tiny")


MODEL = model()


@pytest.fixture(scope="module")
def server():
    engine = Engine(
        MODEL, specjax.DraftModel(MODEL, k=2), max_batch=4, max_model_len=96, chunk_steps=2, logprobs=MAX
    )
    running = Running(make_app(engine, max_waiting=4))
    yield running
    running.close()


def reference(prompt_ids, new_tokens, n, sampling=None):
    """generate's result on the prompt alone with logprobs=n and prompt_logprobs=n, drafting as
    the server does (a sampled answer's tokens depend on the proposer)."""
    sampling = sampling or specjax.Sampling(temperature=0)
    drafts = specjax.DraftModel(MODEL, k=2)
    return specjax.generate(
        MODEL, [prompt_ids], drafts, sampling, max_new_tokens=new_tokens, logprobs=n, prompt_logprobs=n
    )


def ids_of(text):
    return MODEL.tokenizer(text)["input_ids"]


def piece(token_id):
    return MODEL.tokenizer.decode([token_id])


def post(server, path, body):
    status, answer = fetch("POST", f"{server.url}{path}", json.dumps(body).encode())
    assert status == 200, answer
    return json.loads(answer)


def events(server, path, body):
    """The data of a streamed request's events, [DONE] left out."""
    status, answer = fetch("POST", f"{server.url}{path}", json.dumps(body | {"stream": True}).encode())
    assert status == 200, answer
    lines = [line.removeprefix("data: ") for line in answer.decode().split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def assert_legacy_equal(body, tokens, logprobs, tops, n):
    """A completions logprobs body holds these tokens, their logprobs and top n (each top entry:
    the n most likely and the token itself)."""
    assert body["tokens"] == [piece(t) for t in tokens]
    np.testing.assert_allclose(body["token_logprobs"], logprobs, atol=TOL)
    for entry, top, token, value in zip(body["top_logprobs"], tops, tokens, logprobs, strict=True):
        expected = {piece(t): v for t, v in top.items()} | {}
        expected.setdefault(piece(token), value)
        assert entry.keys() == expected.keys() and len(top) == n
        np.testing.assert_allclose([entry[k] for k in expected], list(expected.values()), atol=TOL)
    offsets = np.cumsum([0] + [len(t) for t in body["tokens"][:-1]])
    assert body["text_offset"] == offsets.tolist()


def rows(logprobs):
    """(token ids, logprobs, top dicts) of a Logprobs."""
    return (
        logprobs.token_ids.tolist(),
        logprobs.logprobs.tolist(),
        [logprobs.top(i) for i in range(len(logprobs))],
    )


def test_completion_logprobs_equal_generates_whole_and_streamed(server):
    expected = reference(ids_of(PROMPT), 12, 2)
    tokens, values, tops = rows(expected.logprobs[0])
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    answer = post(server, "/v1/completions", body)
    choice = answer["choices"][0]
    assert choice["text"] == expected.texts[0]
    assert_legacy_equal(choice["logprobs"], tokens, values, tops, 2)
    assert choice["speculate_metrics"]["num_accepted_tokens"] > 0  # the verify passes' logprobs
    # Streamed: the chunks' logprobs joined are the whole answer's, offsets continuing.
    chunks = [c for c in events(server, "/v1/completions", body) if c["choices"]]
    joined = {key: [] for key in choice["logprobs"]}
    for chunk in chunks:
        for key, values_ in chunk["choices"][0]["logprobs"].items():
            joined[key] += values_
    assert joined == choice["logprobs"] and len(chunks) > 1
    # Through the openai client
    response = server.client.completions.create(**body)
    assert response.choices[0].logprobs.tokens == choice["logprobs"]["tokens"]


def test_echo_scores_the_prompt_as_lm_eval_asks(server):
    """lm-eval's loglikelihood: echo with logprobs and max_tokens 1 or 0. The prompt's tokens come
    first (the first with null), then the answer's; with max_tokens=0 the prompt alone."""
    prompt = ids_of(PROMPT)
    expected = reference(prompt, 1, 1)
    scored_tokens, scored_values, scored_tops = rows(expected.prompt_logprobs[0])
    tokens, values, tops = rows(expected.logprobs[0])
    for max_tokens in (1, 0):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        answer = post(server, "/v1/completions", body | {"echo": True, "logprobs": 1})
        choice = answer["choices"][0]
        assert choice["text"] == PROMPT + expected.texts[0][:max_tokens]
        logprobs = choice["logprobs"]
        assert logprobs["tokens"][0] == piece(prompt[0]) and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None
        rest = {key: values_[1:] for key, values_ in logprobs.items()}
        rest["text_offset"] = [o - len(piece(prompt[0])) for o in rest["text_offset"]]
        kept = max_tokens  # the answer's tokens after the prompt's
        assert_legacy_equal(
            rest, scored_tokens + tokens[:kept], scored_values + values[:kept], scored_tops + tops[:kept], 1
        )
        assert answer["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": max_tokens,
            "total_tokens": len(prompt) + max_tokens,
        }
        assert choice["finish_reason"] == "length"
    # Streamed: the first chunk holds the prompt and its logprobs.
    chunks = events(server, "/v1/completions", body | {"max_tokens": 3, "echo": True, "logprobs": 1})
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(prompt)
    # echo without logprobs: the prompt's text, then the answer's
    answer = post(
        server, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 0, "echo": True}
    )
    assert answer["choices"][0]["text"] == PROMPT and answer["choices"][0]["logprobs"] is None


def test_chat_logprobs_and_top_logprobs(server):
    messages = [{"role": "user", "content": "hi there"}]
    prompt = specjax.chat_prompt_ids(MODEL.tokenizer, messages)
    expected = reference(prompt, 8, 3)
    tokens, values, tops = rows(expected.logprobs[0])
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    answer = post(server, "/v1/chat/completions", body | {"logprobs": True, "top_logprobs": 3})
    content = answer["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [piece(t) for t in tokens]
    np.testing.assert_allclose([c["logprob"] for c in content], values, atol=TOL)
    for entry, top in zip(content, tops, strict=True):
        assert [e["token"] for e in entry["top_logprobs"]] == [piece(t) for t in top]
        np.testing.assert_allclose(
            [e["logprob"] for e in entry["top_logprobs"]], list(top.values()), atol=TOL
        )
        assert entry["bytes"] == list(entry["token"].encode())
    # logprobs without top_logprobs: the tokens' own, no alternatives
    answer = post(server, "/v1/chat/completions", body | {"logprobs": True})
    assert all(c["top_logprobs"] == [] for c in answer["choices"][0]["logprobs"]["content"])
    # Streamed, through the openai client: the deltas' logprobs joined are the whole answer's
    stream = server.client.chat.completions.create(stream=True, logprobs=True, top_logprobs=3, **body)
    streamed = [
        c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
    ]
    assert [c.token for c in streamed] == [c["token"] for c in content]
    np.testing.assert_allclose([c.logprob for c in streamed], values, atol=TOL)
    # Without logprobs, none
    answer = post(server, "/v1/chat/completions", body)
    assert answer["choices"][0]["logprobs"] is None


def test_prompt_logprobs_and_tokens_as_ids(server):
    """vLLM's prompt_logprobs: [null, {token id: {logprob, rank, decoded_token}}, ...] holding each
    prompt token and the N most likely there; return_tokens_as_token_ids names tokens by id."""
    prompt = ids_of(PROMPT)
    expected = reference(prompt, 2, 2)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    answer = post(server, "/v1/completions", body | {"prompt_logprobs": 2})
    scored = answer["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    reference_rows = expected.prompt_logprobs[0]
    for i, entry in enumerate(scored[1:]):
        top = reference_rows.top(i)
        for rank, (t, v) in enumerate(top.items(), start=1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["decoded_token"] == piece(t)
            assert abs(entry[str(t)]["logprob"] - v) < TOL
        own = entry[str(prompt[i + 1])]
        assert abs(own["logprob"] - reference_rows.logprobs[i]) < TOL
        assert own["rank"] == (list(top).index(prompt[i + 1]) + 1 if prompt[i + 1] in top else None)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert len(post(server, "/v1/chat/completions", chat | {"prompt_logprobs": 0})["prompt_logprobs"]) > 1
    answer = post(server, "/v1/completions", body | {"logprobs": 1, "return_tokens_as_token_ids": True})
    assert answer["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected.tokens[0]]


def test_each_seeded_choice_has_its_own_logprobs(server):
    """n=2 sampled with a seed: choice j draws with seed + j, and its logprobs are generate's for it."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "seed": 11}
    answer = post(server, "/v1/completions", body | {"n": 2, "logprobs": 1})
    for j, choice in enumerate(sorted(answer["choices"], key=lambda c: c["index"])):
        expected = reference(ids_of(PROMPT), 6, 1, specjax.Sampling(temperature=0.8, seed=11 + j))
        tokens, values, tops = rows(expected.logprobs[0])
        assert choice["text"] == expected.texts[0]
        assert_legacy_equal(choice["logprobs"], tokens, values, tops, 1)


@pytest.mark.parametrize(
    "path, body, param, match",
    [
        ("/v1/completions", {"logprobs": MAX + 1}, "logprobs", "logprobs=4: this server computes at most 3"),
        ("/v1/completions", {"logprobs": True}, "logprobs", "logprobs must be an integer >= 0 for /v1/comp"),
        ("/v1/completions", {"logprobs": -1}, "logprobs", "logprobs must be an integer >= 0, got -1"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 asks for no token"),
        ("/v1/completions", {"prompt_logprobs": 9}, "prompt_logprobs", "prompt_logprobs=9: this server"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 4}, "top_logprobs", "at most 3"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs=true"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "logprobs must be true or false"),
        ("/v1/chat/completions", {"echo": True}, "echo", "echo=true is not supported for chat"),
    ],
)
def test_bad_logprobs_fields_are_400_naming_them(server, path, body, param, match):
    base = {"model": "tiny", "max_tokens": 2}
    base |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    status, answer = fetch("POST", f"{server.url}{path}", json.dumps(base | body).encode())
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == param and match in error["message"], error


def test_per_request_acceptance_in_vllms_shape(server):
    """The response's metrics.speculative_decoding (vLLM's per-request shape, which AIPerf reads)
    sums its choices' speculate_metrics; streamed, it comes with the usage chunk."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "n": 2}
    answer = post(server, "/v1/completions", body)
    spec = answer["metrics"]["speculative_decoding"]
    per_choice = [c["speculate_metrics"] for c in answer["choices"]]
    assert spec["num_spec_steps"] == sum(c["num_drafts"] for c in per_choice) > 0
    assert spec["num_draft_tokens"] == sum(c["num_draft_tokens"] for c in per_choice)
    assert spec["num_accepted_draft_tokens"] == sum(c["num_accepted_tokens"] for c in per_choice)
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] and spec["num_spec_tokens"] == 2
    accepted = sum(j * count for j, count in enumerate(spec["acceptance_histogram"]))
    assert accepted == spec["num_accepted_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / spec["num_spec_steps"])
    chunks = events(server, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["metrics"]["speculative_decoding"] == spec
    plain = post(server, "/v1/completions", body | {"speculative": False})
    assert "metrics" not in plain
