"""One process of a multi-process specjax run on this machine (tests/test_multihost.py starts it).

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES CASES_JSON

Each process fakes DEVICES CPU devices, joins the others through `jax.distributed.initialize` on
127.0.0.1:PORT (gloo collectives over loopback; with NUM_PROCESSES 1 it runs alone, the reference),
then runs every case of CASES_JSON (a JSON list) in order and prints one line per case:
`RESULT {json}` with the case's name, this process's id and what it got (tokens, texts, metrics
counters; or the error it raised). The tokenizer and prompts are read in every process, as on a
real cluster.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

PROCESS_ID, NUM_PROCESSES, PORT, DEVICES = (int(a) for a in sys.argv[1:5])
CASES = json.loads(sys.argv[5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
if NUM_PROCESSES > 1:
    jax.distributed.initialize(
        f"127.0.0.1:{PORT}",
        num_processes=NUM_PROCESSES,
        process_id=PROCESS_ID,
        coordinator_bind_address=f"127.0.0.1:{PORT}",  # loopback only (the default binds every interface)
        initialization_timeout=60,
    )

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402

import specjax  # noqa: E402
from specjax import sharding  # noqa: E402
from specjax.models import tensors  # noqa: E402
from specjax.models.checkpoint import flatten  # noqa: E402

# 16 query / 8 kv heads of dim 8 (the draft: 8 and 8 of dim 4): both split over model degrees 1, 2, 4, 8.
TARGET = dataclasses.replace(
    tiny_model(seed=11, num_heads=16, num_kv_heads=8, head_dim=8), tokenizer=tiny_tokenizer()
)
DRAFT = tiny_model(seed=12, num_layers=1, hidden_size=32, num_heads=8, num_kv_heads=8, intermediate_size=48)
PROMPTS = [  # text, tokenized in every process; repeats for n-gram matches; 8 rows for data degree 8
    "abcdabcdab",
    "xy",
    "the cat the cat the",
    "0123401234",
    "hello hello",
    "q",
    "zzzzzz",
    "jax jax",
]
BUILTIN_PROMPTS = ["The capital of France is", "def add(a, b):"]


def proposer(name: str, target):
    tree = specjax.TokenTree.top_k((3, 2))
    if name == "medusa":
        head = specjax.models.MedusaHead.init(target, num_heads=2, key=jax.random.key(0), scale=0.5)
        return specjax.Medusa(head, tree=tree)
    if name == "eagle":
        return specjax.Eagle(specjax.models.EagleHead.init(target, jax.random.key(0)), tree=tree)
    return {
        "none": lambda: None,
        "ngram": lambda: specjax.NGram(k=3, n_max=3, n_min=1),
        "draft": lambda: specjax.DraftModel(DRAFT, k=3),
        "draft-tp": lambda: specjax.DraftModel(DRAFT, k=3, tensor_parallel=True),
        "self": lambda: specjax.SelfDraft(layers=1, k=3),
    }[name]()


_BUILTIN = {}


def builtin(mesh):
    key = None if mesh is None else sharding.mesh_fingerprint(mesh)
    if key not in _BUILTIN:
        _BUILTIN[key] = specjax.load("smollm2-135m", mesh=mesh)
    return _BUILTIN[key]


def last_process() -> bool:
    return PROCESS_ID == NUM_PROCESSES - 1 and NUM_PROCESSES > 1


def run_generate(case: dict) -> dict:
    data, model_degree = case["data"], case["model"]
    mismatch = case.get("mismatch") if last_process() else None
    if mismatch == "mesh":  # the same devices, another shape
        data, model_degree = data * model_degree, 1
    mesh = sharding.make_mesh(model=model_degree, data=data)
    target = builtin(mesh) if case.get("target") == "builtin" else TARGET
    prompts = list(BUILTIN_PROMPTS if case.get("target") == "builtin" else PROMPTS)
    if mismatch == "prompts":
        prompts[0] = prompts[0] + "!"
    new_tokens = case.get("new_tokens", 12) + (1 if mismatch == "options" else 0)
    kwargs = {}
    if case.get("sampled"):
        kwargs = dict(sampling=specjax.Sampling(temperature=1.0, top_k=20), key=jax.random.key(7))
    result = specjax.generate(
        target,
        prompts,
        proposer=proposer(case.get("proposer", "none"), target),
        max_new_tokens=new_tokens,
        mesh=mesh,
        **kwargs,
    )
    metrics = result.metrics
    counters = {
        f.name: np.asarray(getattr(metrics, f.name)).tolist()
        for f in dataclasses.fields(metrics)
        if isinstance(getattr(metrics, f.name), np.ndarray)
    }
    counters["proposer"] = {name: np.asarray(v).tolist() for name, v in metrics.proposer.items()}
    return {"tokens": result.tokens, "texts": result.texts, "counters": counters}


def run_engine(case: dict) -> dict:
    """The serving engine on the case's mesh: process 0 adds the requests and steps (the others
    follow it in lockstep); its tokens and accepted drafts per request."""
    from specjax.serve import Engine, Request

    mesh = sharding.make_mesh(model=case["model"], data=case["data"])
    address = f"127.0.0.1:{PORT + 1}"
    engine = Engine(
        TARGET,
        proposer(case.get("proposer", "none"), TARGET),
        mesh=mesh,
        lockstep_address=address,
        max_batch=4,
        max_model_len=64,
        chunk_steps=4,
        prefill_chunk=16,
        page_size=case.get("page_size"),
    )
    if PROCESS_ID != 0:
        engine.follow()
        return {"followed": True}
    sampled = specjax.Sampling(temperature=1.0, top_k=20, seed=5)
    requests = [Request(TARGET.tokenizer.encode(p), max_new_tokens=10) for p in PROMPTS[:5]]
    requests.append(Request(TARGET.tokenizer.encode(PROMPTS[2] * 2), max_new_tokens=8, sampling=sampled))
    ids = [engine.add(r) for r in requests]
    tokens, accepted = {i: [] for i in ids}, {}
    while engine.has_work:
        for update in engine.step():
            tokens[update.request_id] += update.tokens
            if update.finished:
                accepted[update.request_id] = np.asarray(update.metrics.accepted_at).tolist()
    engine.close()
    return {"tokens": [tokens[i] for i in ids], "accepted": [accepted[i] for i in ids]}


def run_load(case: dict) -> dict:
    """Load a model (an HF folder, or the built-in model's converted cache) onto a mesh: the bytes
    this process read, what its devices hold, and whether every weight's slices equal a load
    without a mesh."""
    mesh = sharding.make_mesh(model=case["model"], data=case["data"])
    reference = flatten(specjax.load(case["source"]).params)  # (converts a GGUF first, if not cached)
    before = tensors.bytes_read()
    model = specjax.load(case["source"], mesh=mesh)
    read = tensors.bytes_read() - before
    held, equal = 0, True
    for name, array in flatten(model.params).items():
        whole = np.asarray(reference[name])
        indices = {}
        for shard in array.addressable_shards:
            indices[tuple((s.start, s.stop) for s in _slices(shard.index, array.shape))] = shard
        for shard in indices.values():
            part = np.asarray(shard.data)
            held += part.size * 4  # both sources are float32 on disk
            equal = equal and np.array_equal(part, whole[shard.index])
    return {"bytes_read": read, "bytes_held": held, "equal": bool(equal)}


def _slices(index, shape):
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def main() -> None:
    for case in CASES:
        if NUM_PROCESSES == 1 and case.get("mismatch"):
            continue  # one process cannot disagree with itself
        try:
            kind = case.get("kind")
            out = (
                run_load(case)
                if kind == "load"
                else run_engine(case)
                if kind == "engine"
                else run_generate(case)
            )
        except Exception as error:  # reported, then the next case: every process raised here
            out = {"error": f"{type(error).__name__}: {error}"}
            if not case.get("mismatch"):
                traceback.print_exc()
        print("RESULT " + json.dumps({"case": case["name"], "process": PROCESS_ID, **out}), flush=True)


if __name__ == "__main__":
    main()
