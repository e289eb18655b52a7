"""The server under real clients nobody here wrote: lm-evaluation-harness 0.4.13 (local-completions
for loglikelihood and generation, local-chat-completions for generation), guidellm 0.8.1 and
aiperf 0.13.0, each run as its own command from `.venv-clients` (tests/clients.py), against one
server on a local port.

What each client reports is checked against an independent computation, not just its exit code:
lm-eval's loglikelihoods are the log-probabilities transformers computes from its logits for the
same tokens on the same weights, its answers are `generate`'s greedy answers; guidellm finished
every request with the tokens it asked for; aiperf read the per-request speculative-decoding
figures (metrics.speculative_decoding), and its totals are the server's own Prometheus counters
over the run.

The server: a tiny random model with SmolLM2's vocabulary and tokenizer (so the clients load a
real tokenizer from a folder the test writes), speculating with a SelfDraft that is accepted
part of the time (tests/drafters.py: its first layer drafts the next token right about a quarter
of the time), two slots, computing one alternative per token (what lm-eval asks)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from clients import client_program, run_client
from drafters import layered_target
from hf_export import save_hf_folder
from test_server import Running

import specjax
from specjax.models.gguf_loader import read_tokenizer
from specjax.models.loading import builtin_path
from specjax.serve import make_app
from specjax.serve.engine import Engine

NAME = "tiny"
K = 3  # drafts per step
MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": ["green", "blue", "red"], "answer": 1},
]
GEN_DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What is two plus two?", "answer": "four"},
]
GEN_TOKENS = 8  # the generation task's max_gen_toks
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    tokenizer = read_tokenizer(builtin_path("smollm2-135m"))
    target = layered_target(
        seed=11, late_scale=0.3, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48
    )
    return dataclasses.replace(target, tokenizer=tokenizer, name=NAME)


@pytest.fixture(scope="module")
def server(model):
    client_program("lm_eval")  # fail before compiling anything when the clients are missing
    engine = Engine(
        model, specjax.SelfDraft(layers=1, k=K), max_batch=2, max_model_len=256, chunk_steps=4, logprobs=1
    )
    engine.precompile([16, 48])
    running = Running(make_app(engine, served_model_name=NAME))
    yield running
    running.close()


@pytest.fixture(scope="module")
def tokenizer_folder(model, tmp_path_factory):
    """The model's tokenizer saved as a Hugging Face folder, for the clients that count tokens."""
    folder = tmp_path_factory.mktemp("tokenizer")
    model.tokenizer.save_pretrained(str(folder))
    return folder


def write_tasks(folder):
    """Two lm-eval tasks over local JSONL files: multiple choice (loglikelihood, acc) and
    generation until a blank line (exact_match). `--include_path folder` finds them."""
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (folder / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "specjax_mc.yaml").write_text(
        f"task: specjax_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    (folder / "specjax_gen.yaml").write_text(
        f"task: specjax_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        "doc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def lm_eval(server, tmp_path, model_type: str, route: str, tasks: str, *extra: str) -> dict:
    """Run lm_eval against the server; its results and per-task samples."""
    write_tasks(tmp_path)
    out = tmp_path / "out"
    args = [
        "--model", model_type,
        "--model_args", f"model={NAME},base_url={server.url}{route},{extra[0]}",
        "--tasks", tasks,
        "--include_path", str(tmp_path),
        "--output_path", str(out),
        "--log_samples",
        *extra[1:],
    ]  # fmt: skip
    run_client("lm_eval", args, tmp_path)
    (results,) = out.glob("*/results_*.json")
    samples = {
        task: [
            json.loads(line) for line in next(out.glob(f"*/samples_{task}_*.jsonl")).read_text().splitlines()
        ]
        for task in tasks.split(",")
    }
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a context and its continuation into tokens: the whole encoded, the
    context's tokens first (no special tokens, as its remote tokenizer asks /tokenize)."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids) :]


def transformers_loglikelihoods(model, folder, pairs) -> list[float]:
    """Each (context, continuation)'s log-probability under transformers' logits for the model's
    weights (saved as an HF folder): the sum over the continuation's tokens, in float64."""
    import torch
    import transformers

    save_hf_folder(model, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    scores = []
    for context, continuation in pairs:
        with torch.no_grad():
            logits = hf(torch.tensor([context + continuation])).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)
        positions = range(len(context) - 1, len(context) + len(continuation) - 1)
        scores.append(sum(float(logprobs[p, t]) for p, t in zip(positions, continuation, strict=True)))
    return scores


def greedy_answer(model, prompt_ids: list[int]) -> str:
    """The target's greedy answer of GEN_TOKENS tokens, cut where lm-eval's stop strings cut it."""
    text = specjax.generate(model, [prompt_ids], max_new_tokens=GEN_TOKENS).texts[0]
    for stop in ("\n\n", model.tokenizer.eos_token):
        text = text.split(stop)[0]
    return text


def test_lm_eval_completions_loglikelihood_and_generation(server, model, tmp_path):
    """local-completions with the server's own tokenizer (tokenizer_backend=remote: /tokenizer_info,
    /tokenize, /detokenize), two prompts a request (--batch_size 2: lists of token-id prompts):
    each choice's loglikelihood (echo, logprobs=1, max_tokens=1) is transformers' for it within 1e-4,
    acc is the share of questions whose best choice is the answer, and the answers are the greedy ones."""
    run = lm_eval(
        server, tmp_path, "local-completions", "/v1/completions", "specjax_mc,specjax_gen",
        "tokenizer_backend=remote", "--batch_size", "2",
    )  # fmt: skip
    tokenizer = model.tokenizer
    mc = run["samples"]["specjax_mc"]
    assert [s["doc"] for s in mc] == MC_DOCS
    pairs, reported = [], []
    for sample in mc:
        arguments = [sample["arguments"][f"gen_args_{i}"] for i in range(len(sample["doc"]["choices"]))]
        pairs += [encode_pair(tokenizer, a["arg_0"], a["arg_1"]) for a in arguments]
        reported += [float(logprob) for logprob, _ in sample["filtered_resps"]]
    expected = transformers_loglikelihoods(model, tmp_path / "hf", pairs)
    assert all(math.isfinite(v) and v < 0 for v in reported)
    np.testing.assert_allclose(reported, expected, atol=TOL)
    start, correct = 0, 0
    for sample in mc:
        n = len(sample["doc"]["choices"])
        best = int(np.argmax(expected[start : start + n]))
        assert sample["acc"] == float(best == sample["doc"]["answer"])
        correct, start = correct + (best == sample["doc"]["answer"]), start + n
    result = run["results"]["specjax_mc"]
    assert result["sample_len"] == len(MC_DOCS) and result["acc,none"] == pytest.approx(
        correct / len(MC_DOCS)
    )
    # Generation: the prompts go as token ids; each answer is the target's greedy one, cut at "\n\n".
    gen = run["samples"]["specjax_gen"]
    assert len(gen) == len(GEN_DOCS) and "exact_match,none" in run["results"]["specjax_gen"]
    for sample in gen:
        (answer,) = sample["filtered_resps"]
        prompt = tokenizer(sample["arguments"]["gen_args_0"]["arg_0"], add_special_tokens=False)["input_ids"]
        assert answer and answer == greedy_answer(model, prompt)


def test_lm_eval_chat_completions_generation(server, model, tmp_path):
    """local-chat-completions with --apply_chat_template: lm-eval sends the question as a user
    message; the answer is the target's greedy answer to that chat prompt."""
    run = lm_eval(
        server, tmp_path, "local-chat-completions", "/v1/chat/completions", "specjax_gen",
        "tokenizer_backend=none", "--apply_chat_template",
    )  # fmt: skip
    gen = run["samples"]["specjax_gen"]
    assert [s["doc"] for s in gen] == GEN_DOCS and "exact_match,none" in run["results"]["specjax_gen"]
    for sample in gen:
        (answer,) = sample["filtered_resps"]
        (chat,) = sample["arguments"]["gen_args_0"]["arg_0"]  # the chat lm-eval sent, as JSON
        messages = json.loads(chat)
        assert messages[-1] == {"role": "user", "content": f"Question: {sample['doc']['question']}\nAnswer:"}
        prompt = specjax.chat_prompt_ids(model.tokenizer, messages)
        assert answer and answer == greedy_answer(model, prompt)


def test_guidellm_synthetic_run_has_no_errors(server, tokenizer_folder, tmp_path):
    """guidellm's default kind of run (synthetic prompts, streamed chat completions with
    ignore_eos, its own token counts from the tokenizer), two streams at once: every request
    succeeded and returned the tokens it asked for."""
    requests, output_tokens = 6, 8
    out = tmp_path / "benchmarks.json"
    args = [
        "--backend", f"kind=openai_http,target={server.url},model={NAME}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_folder}",
        "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={output_tokens}",
        "--profile", "kind=concurrent,streams=2",
        "--constraint", f"kind=max_requests,count={requests}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    run_client("guidellm", ["run", *args], tmp_path)
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": requests, "errored": 0, "incomplete": 0, "total": requests}
    assert benchmark["metrics"]["output_token_count"]["successful"]["total_sum"] == requests * output_tokens
    sent = [json.loads(r["request_args"])["body"] for r in benchmark["requests"]["successful"]]
    assert all(body["ignore_eos"] is True and body["stream"] is True for body in sent)


def spec_counters(server) -> dict:
    """The server's speculative-decoding counters (Prometheus), summed over positions."""
    counters = {}
    for (name, _), value in server.metrics().items():
        if name.startswith("specjax:spec_decode_num_") and name.endswith("_total") and "per_pos" not in name:
            counters[name] = counters.get(name, 0) + value
    return counters


def test_aiperf_reads_the_per_request_acceptance(server, tokenizer_folder, tmp_path):
    """aiperf's profile of streamed chat completions: it parsed metrics.speculative_decoding of
    every request (vLLM's per-request shape, on the usage chunk), and its totals are the
    server's own counters over the run."""
    requests = 4
    before = spec_counters(server)
    args = [
        "profile",
        "--model", NAME,
        "--url", server.url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer_folder),
        "--prompt-input-tokens-mean", "16", "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", "12", "--prompt-output-tokens-stddev", "0",
        "--request-count", str(requests),
        "--concurrency", "2",
        "--random-seed", "7",
        "--output-artifact-dir", str(tmp_path / "out"),
        "--no-auto-plot",
    ]  # fmt: skip
    # aiperf 0.13.0 under HF_HUB_OFFLINE looks a local tokenizer folder up in the hub's cache and
    # fails; without it, a folder is read as it is. An unreachable hub address proves it asks none.
    run_client(
        "aiperf", args, tmp_path, offline={"HF_DATASETS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    )
    after = spec_counters(server)
    report = json.loads((tmp_path / "out" / "profile_export_aiperf.json").read_text())
    assert report["completed_request_count"]["avg"] == requests and report["error_summary"] == []
    steps = after["specjax:spec_decode_num_drafts_total"] - before["specjax:spec_decode_num_drafts_total"]
    drafted = (
        after["specjax:spec_decode_num_draft_tokens_total"]
        - before["specjax:spec_decode_num_draft_tokens_total"]
    )
    accepted = (
        after["specjax:spec_decode_num_accepted_tokens_total"]
        - before["specjax:spec_decode_num_accepted_tokens_total"]
    )
    assert 0 < accepted < drafted  # drafts accepted in part
    assert report["total_spec_decode_steps"]["avg"] == steps
    assert report["total_draft_tokens"]["avg"] == drafted
    assert report["total_accepted_draft_tokens"]["avg"] == accepted
    rate = report["spec_decode_overall_draft_acceptance_rate"]
    assert rate["unit"] == "%" and rate["avg"] == pytest.approx(100 * accepted / drafted)
    records = [
        json.loads(line) for line in (tmp_path / "out" / "profile_export.jsonl").read_text().splitlines()
    ]
    assert len(records) == requests
    for record in records:  # every request's own figures: 1 + accepted / steps, within 1 and K + 1
        metrics = record["metrics"]
        length = metrics["spec_decode_acceptance_length"]["value"]
        own = metrics["spec_decode_accepted_draft_tokens"]["value"] / metrics["spec_decode_steps"]["value"]
        assert length == pytest.approx(1 + own) and 1 <= length <= K + 1
