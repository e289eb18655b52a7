"""Generation and loading on meshes that span processes, with real processes on this machine.

Each launch starts N copies of tests/multihost_worker.py, each faking D CPU devices, joined by
`jax.distributed.initialize` on a free loopback port with gloo collectives: a mesh over the N * D
global devices then spans processes exactly as one over several hosts does. Each worker runs a list
of cases and prints one JSON line per case. The reference is the same worker alone (one process,
N * D fake devices, the same mesh shape): every process's whole result (tokens, texts, metrics
counters) must equal it token for token, greedy and sampled (with the same key
(the threefry bits do not depend on the layout). Only the float metric `expected_accept_at` (a
sum of probabilities) is compared to a relative 1e-5: an all-reduce across processes (gloo) adds
the model group's partial sums in another order than one within a process, so logits differ in the
last bits, as tests/test_sharding.py explains for a mesh against one device (tokens can then only
differ at an argmax near-tie or a uniform draw within rounding of a boundary, far below one in the
draws here). tests/test_sharding.py shows that a one-process mesh equals one device.

Every launch has a hard time limit; on a timeout or a failure its process groups are killed and
the test fails with each process's output. The default set is one launch of 2 processes x 2
devices (data x model, model-only and data-only meshes; plain, NGram and a replicated DraftModel;
greedy and sampled; loading with bytes counted; a mismatched call); `make test-all` adds 4
processes x 2 devices with every proposer, and the built-in model at model degree 3 x data 2
over 2 processes of 3 devices.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hf_export import save_hf_folder
from tiny import tiny_model

WORKER = Path(__file__).with_name("multihost_worker.py")
LAUNCH_TIMEOUT_S = 300  # per launch (all its processes); a hang fails the test, it never blocks it
SLOW_LAUNCH_TIMEOUT_S = 1200  # the larger grids (about 5 minutes on 2 busy cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(num_processes: int, devices: int, cases: list[dict], env: dict) -> list[subprocess.Popen]:
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", **env)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    args = [str(num_processes), str(port), str(devices), json.dumps(cases)]
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: killed whole on failure
        )
        for i in range(num_processes)
    ]


def finish(processes: list[subprocess.Popen], deadline: float) -> list[str]:
    """Each process's output; every process killed (its group) if any is still running at the
    deadline or one failed."""
    outputs = [""] * len(processes)
    try:
        for i, process in enumerate(processes):
            try:
                outputs[i], _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    failed = [i for i, p in enumerate(processes) if p.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- process {i} (exit {processes[i].returncode}):\n{outputs[i][-3000:]}" for i in failed
        )
        pytest.fail(f"a launch of {len(processes)} processes failed or ran past its time limit:\n{tails}")
    return outputs


def results(output: str) -> dict[str, dict]:
    lines = [json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")]
    return {r.pop("case"): r for r in lines}


def run(
    num_processes: int, devices: int, cases: list[dict], timeout_s: float = LAUNCH_TIMEOUT_S, **env
) -> tuple[list[dict], dict]:
    """(each process's results by case, the one-process reference's), launched side by side."""
    deadline = time.monotonic() + timeout_s
    group = start(num_processes, devices, cases, env)
    alone = start(1, num_processes * devices, cases, env)
    try:
        outputs = finish(group, deadline)
    finally:
        reference = finish(alone, deadline)
    return [results(o) for o in outputs], results(reference[0])


def check_same(per_process: list[dict], reference: dict, cases: list[dict]) -> None:
    for case in cases:
        if case.get("mismatch") or case.get("kind") == "load":
            continue
        name = case["name"]
        expected = reference[name]
        assert "error" not in expected, f"{name}: the one-process reference failed: {expected['error']}"
        for p, got in enumerate(per_process):
            assert "error" not in got[name], f"{name}: process {p} failed: {got[name]['error']}"
            assert got[name]["tokens"] == expected["tokens"], f"{name}: process {p}'s tokens differ"
            assert got[name]["texts"] == expected["texts"], f"{name}: process {p}'s texts differ"
            counts, sums = split_counters(got[name]["counters"])
            expected_counts, expected_sums = split_counters(expected["counters"])
            assert counts == expected_counts, f"{name}: process {p}'s metric counts differ"
            for field, values in sums.items():  # float sums: the all-reduce order differs (see top)
                np.testing.assert_allclose(values, expected_sums[field], rtol=1e-5, atol=1e-6, err_msg=name)
        assert any(len(row) for row in expected["tokens"]), f"{name}: generated nothing"


def split_counters(counters: dict) -> tuple[dict, dict]:
    """(the integer counters, the float ones: expected_accept_at, sums of probabilities)."""
    flat = {name: v for name, v in counters.items() if name != "proposer"}
    flat |= {f"proposer.{name}": v for name, v in counters["proposer"].items()}
    floats = {name for name, v in flat.items() if np.asarray(v).dtype.kind == "f"}
    return {n: v for n, v in flat.items() if n not in floats}, {n: v for n, v in flat.items() if n in floats}


def check_load(per_process: list[dict], case: dict, spans_model_axis: bool) -> None:
    """Each process read exactly the bytes of the distinct slices its devices hold, and those equal
    a load without a mesh; when the model axis spans processes that is less than the checkpoint."""
    for p, got in enumerate(per_process):
        got = got[case["name"]]
        assert "error" not in got, f"{case['name']}: process {p} failed: {got['error']}"
        assert got["equal"], f"{case['name']}: process {p}'s slices differ from a load without a mesh"
        assert got["bytes_read"] == got["bytes_held"], (case["name"], p, got)
        if spans_model_axis:
            assert got["bytes_held"] < case["full_bytes"], (case["name"], p, got)


def check_mismatch(per_process: list[dict], name: str, part: str) -> None:
    """Every process raised the same clear error, naming the last process and what differs."""
    last = len(per_process) - 1
    for p, got in enumerate(per_process):
        error = got[name].get("error", "")
        assert error.startswith("ValueError: generate: the processes did not make the same call"), (p, error)
        named = re.search(rf"process {last}: ([^;)]*)", error)
        assert named and part in named.group(1).split(", "), (p, error)


def generation_cases(layouts, proposers, samplings=("greedy", "sampled"), **extra) -> list[dict]:
    return [
        {
            "name": f"{proposer}-{sampling}-d{data}m{model}" + "".join(f"-{v}" for v in extra.values()),
            "data": data,
            "model": model,
            "proposer": proposer,
            "sampled": sampling == "sampled",
            **extra,
        }
        for data, model in layouts
        for proposer in proposers
        for sampling in samplings
    ]


def load_case(data: int, model: int, source: str, full_bytes: int | None = None) -> dict:
    name = f"load-{Path(source).name}-d{data}m{model}"
    return {
        "name": name,
        "kind": "load",
        "data": data,
        "model": model,
        "source": source,
        "full_bytes": full_bytes,
    }


def tiny_folder(tmp_path_factory) -> tuple[str, int]:
    """A tiny model (the workers' target shape) saved as an HF folder, and its bytes."""
    folder = tmp_path_factory.mktemp("multihost") / "tiny"
    model = tiny_model(seed=3, num_heads=8, num_kv_heads=4)  # head_dim 8: splits over degrees 1, 2, 4
    save_hf_folder(model, folder)
    return str(folder), (folder / "model.safetensors").stat().st_size


# ---------------------------------------------------------------------------------------------
# Default: 2 processes x 2 devices


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    folder, size = tiny_folder(tmp_path_factory)
    cases = (
        generation_cases([(2, 2)], ["none", "ngram", "draft"])  # data across processes, model within
        + generation_cases([(1, 4)], ["ngram"], ["greedy"])  # model across processes
        + [
            load_case(2, 2, folder, size),
            load_case(1, 4, folder, size),
            {"name": "mismatch-prompts", "data": 2, "model": 2, "mismatch": "prompts"},
            {"name": "mismatch-mesh", "data": 2, "model": 2, "mismatch": "mesh"},
            {"name": "after-mismatch", "data": 2, "model": 2, "proposer": "ngram"},  # all still in step
        ]
    )
    per_process, reference = run(2, 2, cases)
    return cases, per_process, reference


@pytest.mark.slow  # two processes compiling on 2 cores: minutes; make test-all
def test_generate_across_two_processes(two_by_two):
    cases, per_process, reference = two_by_two
    check_same(per_process, reference, cases)


@pytest.mark.slow  # two processes compiling on 2 cores: minutes; make test-all
def test_load_reads_only_own_slices(two_by_two):
    cases, per_process, _ = two_by_two
    by_name = {c["name"]: c for c in cases}
    check_load(per_process, by_name["load-tiny-d2m2"], spans_model_axis=False)
    check_load(per_process, by_name["load-tiny-d1m4"], spans_model_axis=True)


@pytest.mark.slow  # two processes compiling on 2 cores: minutes; make test-all
def test_mismatched_call_is_an_error_not_a_hang(two_by_two):
    _, per_process, _ = two_by_two
    check_mismatch(per_process, "mismatch-prompts", "prompts")
    check_mismatch(per_process, "mismatch-mesh", "mesh")


# ---------------------------------------------------------------------------------------------
# make test-all: 4 processes x 2 devices, every proposer; the built-in model over 2 processes

EVERY_PROPOSER = ["none", "ngram", "draft", "draft-tp", "self", "medusa", "eagle"]


@pytest.mark.slow
def test_four_processes_every_proposer(tmp_path_factory):
    folder, size = tiny_folder(tmp_path_factory)
    cases = (
        generation_cases([(2, 4)], EVERY_PROPOSER)  # model groups span 2 processes, data spans pairs
        + generation_cases([(1, 8)], ["none", "draft-tp"], ["sampled"])
        + generation_cases([(8, 1)], ["ngram", "draft"], ["greedy"])  # data only
        + [
            load_case(2, 4, folder, size),
            {"name": "mismatch-options", "data": 2, "model": 4, "mismatch": "options"},
        ]
    )
    per_process, reference = run(4, 2, cases, SLOW_LAUNCH_TIMEOUT_S)
    check_same(per_process, reference, cases)
    check_load(per_process, cases[-2], spans_model_axis=True)
    check_mismatch(per_process, "mismatch-options", "options")


@pytest.mark.slow
def test_builtin_model_degree_3_over_two_processes(smollm2, smollm2_cache_dir):
    # smollm2 converted the GGUF into this session's cache: the workers read it from there.
    cases = generation_cases(
        [(2, 3)], ["none", "ngram", "self"], ["greedy"], target="builtin", new_tokens=8
    ) + generation_cases([(2, 3)], ["ngram"], ["sampled"], target="builtin", new_tokens=8)
    cases.append(load_case(2, 3, "smollm2-135m"))
    per_process, reference = run(2, 3, cases, SLOW_LAUNCH_TIMEOUT_S, SPECJAX_CACHE=str(smollm2_cache_dir))
    check_same(per_process, reference, cases)
    check_load(per_process, cases[-1], spans_model_axis=False)


# ---------------------------------------------------------------------------------------------
# The serving engine across processes (make test-all)


@pytest.mark.slow  # two processes compiling on 2 cores: minutes; make test-all
def test_the_engine_across_two_processes_equals_one_process():
    """The engine on a mesh over 2 processes x 2 devices (data 2 across them x model 2 within, and
    model 4 across them; dense, and on pages, each process's data group its own part of the pool):
    process 0 adds requests (greedy and seeded sampled, one in chunks) and steps, process 1 follows
    in lockstep (serve/lockstep.py); process 0's tokens and accepted drafts equal the same engine's
    in one process with all 4 devices."""
    cases = [
        {"name": f"engine-{p}-d{d}m{m}-{pages}", "kind": "engine", "data": d, "model": m, "proposer": p}
        | ({} if pages == "dense" else {"page_size": 16})
        for d, m, p, pages in (
            (2, 2, "ngram", "dense"),
            (2, 2, "draft-tp", "dense"),
            (1, 4, "eagle", "dense"),
            (2, 2, "ngram", "pages"),
        )
    ]
    per_process, reference = run(2, 2, cases)
    for case in cases:
        name = case["name"]
        assert "error" not in reference[name], reference[name]
        assert per_process[1][name] == {"process": 1, "followed": True}, per_process[1][name]
        got = per_process[0][name]
        assert got["tokens"] == reference[name]["tokens"], name
        assert got["accepted"] == reference[name]["accepted"], name
        assert any(got["tokens"]) and any(np.sum(a) for a in got["accepted"]), name


@pytest.mark.slow  # two server processes compiling on 2 cores: minutes; make test-all
def test_serve_across_two_processes_answers_from_process_0(tmp_path_factory):
    """`specjax serve --coordinator-address ... -tp 2 -dp 2` started in 2 processes of 2 devices:
    process 0 serves HTTP and leads, process 1 follows; the openai client's greedy completions equal
    `generate` alone, and when process 0 stops, process 1 returns too."""
    import openai
    from tiny import tiny_tokenizer

    import specjax

    folder, _ = tiny_folder(tmp_path_factory)
    tiny_tokenizer().save_pretrained(folder)
    coordinator, http = free_port(), free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    command = [sys.executable, "-m", "specjax.cli", "serve", folder, "--coordinator-address"]
    command += [f"127.0.0.1:{coordinator}", "--num-processes", "2", "-tp", "2", "-dp", "2"]
    command += ["--max-batch", "4", "--max-model-len", "64", "--precompile", "-1", "--port", str(http)]
    command += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    processes = [
        subprocess.Popen(
            [*command, "--process-id", str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        url, deadline = f"http://127.0.0.1:{http}", time.monotonic() + LAUNCH_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                assert all(p.poll() is None for p in processes), "a server process exited"
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        model = specjax.load(folder)
        for prompt in ("abcabcab", "the cat the cat", "xy"):
            answer = client.completions.create(model=folder, prompt=prompt, max_tokens=8, temperature=0)
            expected = specjax.generate(model, [prompt], max_new_tokens=8).texts[0]
            assert answer.choices[0].text == expected, prompt
        os.killpg(processes[0].pid, signal.SIGINT)  # uvicorn stops; the engine tells process 1
        assert processes[1].wait(timeout=120) == 0, processes[1].communicate()[0][-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
