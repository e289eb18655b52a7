"""Shared fixtures: the built-in model (loaded once per session), its transformers reference,
and the prompt data sets in ../shared/data."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# Eight fake CPU devices for the sharding tests (tests/test_sharding.py). XLA reads the flag once,
# when jax first initializes, so it is set here, before any test module imports jax, and for the
# whole suite rather than in a subprocess: the sharding tests then share this session's fixtures
# (the built-in model is loaded once) and report their failures like any other test. Everything
# else still runs on device 0; with and without the flag the other tests' times matched within
# the machine's noise (built-in model, 48 tokens, batch 2: 6.8-10.1 s against 7.4-7.9 s).
FAKE_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={FAKE_DEVICES}"
    ).strip()

# The suite compiles hundreds of small programs and runs each for a few steps, so it spends more
# time in XLA's LLVM code generation than in the code it generates: LLVM's level 0 cut the time
# of the loop tests by about 30% here (test_eagle, test_hybrid and test_eagle3_loop: 3 min 13 s
# -> 2 min 14 s) with the same results. It changes how XLA:CPU compiles, not what it computes
# (no fast-math at any level). Benchmarks, the demo and users keep XLA's default.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# For the same reason, XLA:CPU's older elemental emitters instead of its MLIR fusion emitters: they
# compile the suite's programs in about half the time (test_eagle, test_hybrid, test_speculative
# and test_dynamic on 2 workers: 165 s -> 88 s; one generate program of each kind 12.9-14.4 s
# -> 6.5-7.0 s), with the same results. XLA aborts the process on a flag it does not know, and a
# later jaxlib may drop this one, so a short child process asks first (once: pytest-xdist's
# workers inherit the controller's environment).
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"{os.environ['XLA_FLAGS']} {flag}", JAX_PLATFORMS="cpu")
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
        env=env,
        capture_output=True,
    )
    return probe.returncode == 0


if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _xla_accepts(FAST_COMPILE_FLAG):
    os.environ["XLA_FLAGS"] += f" {FAST_COMPILE_FLAG}"

# Under pytest-xdist, each worker's OpenMP (torch's CPU threads, for the transformers references;
# numpy's OpenBLAS reads the same variable) gets its share of the cores. torch starts one thread
# per core in every worker; on 2 cores with 2 workers its threads spun against the other
# worker's and HF's references ran 4 to 7 times slower than alone (a 64-token greedy batch
# 8 -> 60 s, the logit check 13 -> 53 s).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """Where the prompt sets live: $SPECJAX_DATA, else <repo>/../shared/data."""
    return Path(os.environ.get("SPECJAX_DATA") or REPO.parent / "shared" / "data")


def data_file(name: str) -> Path:
    """The path of a prompt set, or skip the test saying where it was looked for."""
    path = data_dir() / name
    if not path.is_file():
        pytest.skip(f"prompt set {name} not found in {path.parent} (set SPECJAX_DATA to its folder)")
    return path


def pytest_runtest_setup(item):
    """A test marked `data` skips before its fixtures load anything (the built-in model and its
    transformers twin take a minute) when the prompt sets' folder is missing altogether."""
    if item.get_closest_marker("data") is not None and not data_dir().is_dir():
        pytest.skip(f"the prompt sets' folder {data_dir()} is missing (set SPECJAX_DATA to it)")


def read_jsonl(name: str) -> list[dict]:
    with open(data_file(name)) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def spec_bench() -> list[dict]:
    """The Spec-Bench questions (480 records with 1-2 user turns each). List it before other
    fixtures in a test's arguments, so a missing file skips before any model loads."""
    return read_jsonl("spec_bench_question.jsonl")


@pytest.fixture(scope="session")
def humaneval() -> list[dict]:
    """The HumanEval problems (164 records; the "prompt" field is the model input)."""
    return read_jsonl("humaneval.jsonl")


@pytest.fixture(scope="session")
def smollm2_cache_dir(tmp_path_factory) -> Path:
    """A fresh cache folder, so each session tests the GGUF conversion as well as the cache."""
    return tmp_path_factory.mktemp("specjax-cache")


@pytest.fixture(scope="session")
def smollm2_load(smollm2_cache_dir):
    """(model, seconds) of the first load of the built-in model, which converts the GGUF."""
    from specjax.models import load

    start = time.perf_counter()
    model = load("smollm2-135m", cache_dir=smollm2_cache_dir)
    return model, time.perf_counter() - start


@pytest.fixture(scope="session")
def smollm2(smollm2_load):
    """The built-in SmolLM2-135M-Instruct as a specjax Model (float32)."""
    return smollm2_load[0]


@pytest.fixture(scope="session")
def smollm2_gguf():
    """(folder, file name) of the built-in model's GGUF, as transformers' gguf_file wants them."""
    from specjax.models.loading import builtin_path

    path = builtin_path("smollm2-135m")
    return str(path.parent), path.name


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own float32 load of the same GGUF: the logits reference."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = smollm2_gguf
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the same GGUF: the tokenizer reference."""
    from transformers import AutoTokenizer

    folder, name = smollm2_gguf
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test module, drop its compiled programs and jax's caches. Every XLA:CPU
    executable holds memory maps of its code; the whole suite compiles hundreds of programs, and a
    process that kept them all ran out of the kernel's 65,530 maps and aborted mid-suite."""
    yield
    import jax

    from specjax.programs import clear_compiled_programs

    clear_compiled_programs()
    jax.clear_caches()
