"""The server's pieces that need no engine: OpenAI request bodies into engine requests
(specjax/serve/protocol.py) and the Prometheus metrics (specjax/serve/metrics.py)."""

import math

import pytest
from tiny import tiny_tokenizer

import specjax
from specjax.serve.metrics import ServerMetrics
from specjax.serve.protocol import CHAT, COMPLETION, RequestError, parse_request
from specjax.serve.responses import Responder, speculate_metrics

TOKENIZER = tiny_tokenizer()
V = 97


def completion(body, max_model_len=64):
    return parse_request(body, COMPLETION, TOKENIZER, V, max_model_len)


def test_a_completion_request_with_openais_defaults():
    request = completion({"model": "m", "prompt": "hello"})
    assert request.prompt == TOKENIZER("hello")["input_ids"] and len(request.prompt) == 5
    assert request.max_new_tokens == 16  # OpenAI's default for completions
    assert request.sampling.temperature == 1.0 and request.sampling.seed is not None  # a fresh seed
    assert request.speculate and not request.stream and not request.include_usage
    # token ids, and a list holding one prompt
    assert completion({"prompt": [3, 4, 5]}).prompt == [3, 4, 5]
    assert completion({"prompt": ["hello"]}).prompt == request.prompt
    assert completion({"prompt": [[7]]}).prompt == [7]


def test_sampling_fields_map_onto_specjax_sampling():
    body = {
        "prompt": "x",
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"3": -100, "10": 2.5},
        "seed": 11,
        "stop": "ab",
        "stop_token_ids": [96],
        "max_tokens": 7,
        "speculative": False,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
        "logprobs": None,
        "user": "someone",
    }
    request = completion(body)
    assert request.sampling == specjax.Sampling(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={3: -100.0, 10: 2.5},
        seed=11,
        stop=("ab",),
        stop_token_ids=(96,),
    )
    assert (request.max_new_tokens, request.speculate, request.stream, request.include_usage) == (
        7,
        False,
        True,
        True,
    )
    greedy = completion({"prompt": "x", "temperature": 0, "top_k": -1, "stop": ["a", "b"]}).sampling
    assert greedy == specjax.Sampling(stop=("a", "b"))  # vLLM's top_k -1 is off; greedy needs no seed


@pytest.mark.parametrize(
    "body, param, match",
    [
        ({"prompt": "x", "n": 0}, "n", "n must be an integer >= 1, got 0"),
        ({"prompt": "x", "n": 2, "seed": 2**32 - 1}, "seed", r"seed \+ j, which must stay below 2\*\*32"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be a finite number >= 0"),
        ({"prompt": "x", "top_p": 0}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", r"in \[-2, 2\]"),
        ({"prompt": "x", "seed": -1}, "seed", "seed must be None or an integer"),
        ({"prompt": "x", "logit_bias": {"word": 1}}, "logit_bias", r"keys must be token ids in \[0, 97\)"),
        ({"prompt": "x", "logit_bias": {"500": 1}}, "logit_bias", "got '500'"),
        (
            {"prompt": "x", "stop": ""},
            "stop",
            "stop must be a non-empty string or a list of non-empty strings",
        ),
        ({"prompt": "x", "stop": [1]}, "stop", "stop must be"),
        ({"prompt": "x", "stop_token_ids": [200]}, "stop_token_ids", "token id 200 outside the vocabulary"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0 asks for no token"),
        (
            {"prompt": "x", "max_tokens": 64},
            "max_tokens",
            "max_tokens=64: with a prompt of 1 tokens it exceeds",
        ),
        ({"prompt": "x" * 60}, "max_tokens", "max_tokens=16: with a prompt of 60 tokens"),
        ({"prompt": "x" * 64}, "prompt", "the prompt has 64 tokens, the server's max_model_len is 64"),
        ({"prompt": "x", "stream": "yes"}, "stream", "stream must be true or false"),
        ({"prompt": "x", "speculative": 1}, "speculative", "speculative must be true or false"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed with stream",
        ),
        ({"prompt": "x", "logprobs": 2}, "logprobs", "logprobs=2: this server computes no logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo", "echo must be true or false, got 'yes'"),
        ({"prompt": "x", "best_of": 3}, "best_of", "best_of=3 is not supported"),
        ({"prompt": "x", "guided_grammar": "root ::= x"}, "guided_grammar", "is not supported"),
        ({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one constraint"),
        ({"prompt": "x", "temprature": 0}, "temprature", "unknown field 'temprature' for /v1/completions"),
        ({"prompt": "x", "messages": []}, "messages", "unknown field 'messages'"),
        ({}, "prompt", "prompt is required"),
        ({"prompt": ""}, "prompt", "prompt is empty"),
        ({"prompt": [1, 200]}, "prompt", r"token id 200 outside the vocabulary \[0, 97\)"),
        ({"prompt": ["a", [1]]}, "prompt", "must be all strings or all token-id lists"),
        ({"prompt": []}, "prompt", "prompt must be a string, a list of token ids, or a non-empty list"),
        ({"prompt": [[1], "x" * 64]}, "prompt", "must be all strings"),
        ({"prompt": [[1], [2] * 64]}, "prompt", r"prompt\[1\]: the prompt has 64 tokens"),
        ({"prompt": 5}, "prompt", "prompt must be a string, a list of token ids"),
    ],
)
def test_bad_fields_are_named(body, param, match):
    with pytest.raises(RequestError, match=match) as error:
        completion(body)
    assert error.value.param == param and error.value.status == 400
    assert error.value.body()["error"] | {"message": None} == {
        "message": None,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


def test_chat_requests_apply_the_chat_template(smollm2):
    tokenizer = smollm2.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    request = parse_request({"messages": messages, "temperature": 0}, CHAT, tokenizer, 49152, 100)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert request.prompt == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert request.max_new_tokens == 100 - len(request.prompt)  # a chat answer may fill the context
    # generate(chat=True) builds the same ids for one user message
    one = [{"role": "user", "content": "Hi there"}]
    expected = specjax.planner.tokenize(smollm2, ["Hi there"], chat=True)[0]
    assert parse_request({"messages": one}, CHAT, tokenizer, 49152, 100).prompt == expected
    # OpenAI's content parts; max_completion_tokens over max_tokens
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    both = {"messages": parts, "max_tokens": 5, "max_completion_tokens": 3}
    request = parse_request(both, CHAT, tokenizer, 49152, 100)
    assert request.prompt == expected and request.max_new_tokens == 3
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": one, "prompt": "x"}, "prompt"),
        ({"messages": one, "max_completion_tokens": -1}, "max_completion_tokens"),
    ]:
        with pytest.raises(RequestError) as error:
            parse_request(body, CHAT, tokenizer, 49152, 100)
        assert error.value.param == param


def test_response_bodies_have_openais_shape():
    chat = Responder.new(CHAT, "m")
    assert chat.id.startswith("chatcmpl-") and chat.created > 0
    body = chat.response("hi", "stop", {"prompt_tokens": 1}, None)
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat.chunk("", first=True)["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk("x")["choices"][0]["delta"] == {"content": "x"}
    last = chat.chunk("", finish_reason="length", spec={"num_drafts": 1}, include_usage=True)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["speculate_metrics"] == {"num_drafts": 1} and last["usage"] is None
    assert chat.usage_chunk({"total_tokens": 3})["choices"] == []
    text = Responder.new(COMPLETION, "m")
    assert text.id.startswith("cmpl-") and text.chunk("x")["object"] == "text_completion"
    assert text.response("x", "stop", {}, None)["choices"][0]["text"] == "x"


def test_speculate_metrics_are_json_numbers():
    from tiny import tiny_model

    target = tiny_model(seed=0)
    run = specjax.generate(target, [[1, 2, 3]], proposer=specjax.DraftModel(target, k=2), max_new_tokens=6)
    figures, summary = speculate_metrics(run.metrics), run.metrics.summary()
    assert figures["acceptance_rate"] == 1.0  # a draft model that is the target accepts everything
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_per_position"):
        assert figures[key] == summary[key] and summary[key]
    plain = specjax.generate(target, [[1, 2]], max_new_tokens=2).metrics
    assert math.isnan(plain.summary()["acceptance_rate"])
    assert speculate_metrics(plain)["acceptance_rate"] is None  # JSON has no NaN
    assert speculate_metrics(None) is None


# ---------------------------------------------------------------------------------------------
# metrics


def test_metrics_are_named_like_vllms_in_a_registry_of_their_own():
    first, second = ServerMetrics("m"), ServerMetrics("m")  # two apps in one process do not clash
    first.admitted(5)
    first.observe_tokens(3, since_arrival=0.5, since_last=None)
    first.observe_tokens(2, since_arrival=0.9, since_last=0.4)
    first.speculated(2, 6, 4, [2, 1, 1])
    first.finished("stop", 1.0)
    first.set_queue(running=1, waiting=2)
    first.rejected()
    text = first.exposition()[0].decode()
    for line in [
        'specjax:prompt_tokens_total{model_name="m"} 5.0',
        'specjax:generation_tokens_total{model_name="m"} 5.0',
        'specjax:spec_decode_num_drafts_total{model_name="m"} 2.0',
        'specjax:spec_decode_num_draft_tokens_total{model_name="m"} 6.0',
        'specjax:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0',
        'specjax:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
        'specjax:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0',
        'specjax:request_success_total{finished_reason="stop",model_name="m"} 1.0',
        'specjax:num_requests_running{model_name="m"} 1.0',
        'specjax:num_requests_waiting{model_name="m"} 2.0',
        'specjax:request_overloaded_total{model_name="m"} 1.0',
        'specjax:time_to_first_token_seconds_count{model_name="m"} 1.0',
        'specjax:time_to_first_token_seconds_sum{model_name="m"} 0.5',
        # 4 gaps: 2 after the first token of the first Update (0.5 s / 3 each), 2 at 0.4 s / 2
        'specjax:inter_token_latency_seconds_count{model_name="m"} 4.0',
        'specjax:e2e_request_latency_seconds_count{model_name="m"} 1.0',
    ]:
        assert line in text, line
    assert 'specjax:inter_token_latency_seconds_sum{model_name="m"} 0.7333' in text
    assert 'specjax:prompt_tokens_total{model_name="m"} 0.0' in second.exposition()[0].decode()
    vllm = ServerMetrics("m", prefix="vllm:").exposition()[0].decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 0.0' in vllm


def test_n_choices_seeds_and_prompt_lists():
    seeded = completion({"prompt": ["ab", "c"], "n": 3, "seed": 7, "temperature": 0.5})
    assert seeded.prompts == [TOKENIZER("ab")["input_ids"], TOKENIZER("c")["input_ids"]]
    assert [s.seed for s in seeded.samplings] == [7, 8, 9]  # choice j: seed + j, as vLLM
    assert [(i, p) for i, p, _ in seeded.choices()] == [(i, seeded.prompts[i // 3]) for i in range(6)]
    unseeded = completion({"prompt": "x", "n": 4, "temperature": 1.0}).samplings
    assert all(s.seed is not None for s in unseeded) and len({s.seed for s in unseeded}) == 4
    greedy = completion({"prompt": "x", "n": 2, "temperature": 0}).samplings
    assert greedy == [specjax.Sampling()] * 2
    assert completion({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]


def test_the_extras_and_the_fields_policy():
    body = {
        "prompt": "x",
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "min_tokens": 0,
        "store": True,
        "user": "u",
        "priority": 2,
        "logprobs": None,
        "echo": False,
    }
    request = completion(body)
    assert (request.include_usage, request.continuous_usage) == (False, True)
    assert (request.ignore_eos, request.include_stop, request.skip_special_tokens) == (True, True, False)
    assert request.ignored == ("store", "user", "priority")
    assert completion({"prompt": "x", "add_special_tokens": False}).prompt == TOKENIZER("x")["input_ids"]
    # 0 is not false: logprobs=0 asks for the sampled token's logprob (of a server computing none);
    # top_logprobs is chat's
    for body, param in [
        ({"prompt": "x", "logprobs": 0}, "logprobs"),
        ({"prompt": "x", "logprobs": False, "top_logprobs": False}, "top_logprobs"),
        ({"prompt": "x", "priority": 1.5}, "priority"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}}, None),
    ]:
        with pytest.raises(RequestError) as error:
            completion(body)
        assert error.value.param == (param or "stream_options.continuous_usage_stats")
