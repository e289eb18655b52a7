"""Prefill and decode apart (specjax/serve/handoff.py): a prefill engine on one set of devices makes
each request's row (the target's cache, its proposer's state, its first token), a decode engine on
other devices admits it without prefilling and speculates; in one process (two meshes, rows moved
by jax.device_put) and across two (rows as bytes over HTTP). Every request gets the tokens and
accepted drafts of the colocated engine; a transfer that fails is tried again or ends its request
with an error, never a wrong answer, and the others are served throughout."""

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings

import jax
import numpy as np
import pytest
from test_engine import TARGET, drive
from test_engine_mesh import CASES, OPTIONS, _requests

import specjax
from specjax import sharding
from specjax.serve import Engine, Request
from specjax.serve.handoff import (
    HandoffError,
    LocalPrefiller,
    RemotePrefiller,
    can_hand_over,
    decode_row,
    encode_row,
    request_from_json,
    request_to_json,
)
from specjax.speculate.sampling import Sampling

if jax.device_count() < 6:  # conftest.py sets the flag; a jax imported earlier would miss it
    raise RuntimeError(
        f"tests/test_handoff.py needs 6 devices, found {jax.device_count()}: XLA_FLAGS="
        "--xla_force_host_platform_device_count=8 must be set before jax is imported (tests/conftest.py)"
    )

PREFILL_DEVICES, DECODE_DEVICES = jax.devices()[:2], jax.devices()[2:6]
LOGPROB_OPTIONS = dict(OPTIONS, logprobs=2)


class Prefilling:
    """A decode engine whose every request's row comes from `prefiller`: Engine.add with it."""

    def __init__(self, engine, prefiller):
        self.engine, self.prefiller = engine, prefiller

    def add(self, request):
        return self.engine.add(request, prefiller=self.prefiller)

    def __getattr__(self, name):  # (step, has_work, ... as the engine's)
        return getattr(self.engine, name)


def _outputs(engine, requests):
    tokens, finals = drive(engine, requests, seed=2)
    accepted = {i: np.asarray(u.metrics.accepted_at).tolist() for i, u in finals.items() if u.metrics}
    return tokens, accepted, finals


@functools.cache
def _colocated(name: str) -> tuple[dict, dict]:
    """(tokens, accepted drafts by position) of the colocated engine on one device for CASES[name]
    over `_requests`: what every split of that case is held to, computed once for the tests that
    share it (a case's target and proposer are built the same each time)."""
    target, proposer = CASES[name]()
    return _outputs(Engine(target, proposer, **OPTIONS), _requests(target.config.vocab_size))[:2]


def _split(target, proposer, through_bytes=False):
    """(the decode engine, a prefiller): prefill on a model-2 mesh, decode on data 2 x model 2."""
    prefill_mesh = sharding.make_mesh(model=2, data=1, devices=PREFILL_DEVICES)
    decode_mesh = sharding.make_mesh(model=2, data=2, devices=DECODE_DEVICES)
    prefill = Engine(target, proposer, mesh=prefill_mesh, **OPTIONS)
    decode = Engine(target, proposer, mesh=decode_mesh, **OPTIONS)
    if not through_bytes:
        return decode, LocalPrefiller(prefill)
    one_at_a_time = threading.Lock()  # (the handoff's workers share the prefill engine)

    def through(request, like):  # the host path of two processes, in one (the filled slots sent)
        with one_at_a_time:
            return decode_row(prefill.prefill_bytes(request), like)

    return decode, through


# The default set's here: a proposer with a history only, and a draft model with its own cache.
# Plain runs through the split in the failed-transfer test below (tokens against the colocated
# engine's), eagle-tree (a head's features) in the two tests after this one, through bytes and
# into pages; the rest in make test-all.
SPLIT_FAST = ("ngram", "draft-tensor-parallel")


@pytest.mark.parametrize(
    "name", [n if n in SPLIT_FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_every_proposer_through_the_split_equals_the_colocated_engine(name):
    """Greedy and seeded sampled requests, one with a 40-token prompt (in chunks on the prefill
    side), added at random moments: tokens and accepted drafts by position equal the colocated
    engine's on one device, with the draft model's and the heads' state made on the prefill side;
    the decode engine never prefills a prompt."""
    target, proposer = CASES[name]()
    requests = _requests(target.config.vocab_size)
    assert all(can_hand_over(r) for r in requests)
    colocated = _colocated(name)
    decode, prefiller = _split(target, proposer)
    split = _outputs(Prefilling(decode, prefiller), requests)
    assert split[:2] == colocated
    if proposer is not None:  # accepted part of the time, not all: rollbacks ran too
        accepted = sum(int(np.sum(u.metrics.accepted)) for u in split[2].values())
        assert 0 < accepted < sum(int(np.sum(u.metrics.drafted)) for u in split[2].values())
    assert {bucket for kind, bucket in decode.compiled if kind == "prefill"} == {specjax.planner.MIN_BUCKET}
    assert not any(kind in ("prompt_chunk", "finish_prompt") for kind, _ in decode.compiled)
    if proposer is not None:
        assert 0 < sum(np.sum(a) for a in colocated[1].values())


@pytest.mark.parametrize(
    "name",
    ["eagle-tree", *(pytest.param(n, marks=pytest.mark.slow) for n in ("draft-model", "mtp", "dflash"))],
)
def test_rows_through_bytes_equal_the_colocated_engine(name):
    """The host path (`Engine.prefill_bytes` / `decode_row`, what crosses between processes),
    which sends only the slots the prompt filled (the rest padded again on arrival), gives the
    colocated engine's tokens and accepted drafts, a draft model's cache and a head's features
    included; and it sends less than the whole row."""
    target, proposer = CASES[name]()
    requests = _requests(target.config.vocab_size)
    colocated = _colocated(name)
    decode, prefiller = _split(target, proposer, through_bytes=True)
    assert _outputs(Prefilling(decode, prefiller), requests)[:2] == colocated
    short = Engine(target, proposer, **OPTIONS)
    assert len(short.prefill_bytes(requests[1])) < len(encode_row(short.prefill(requests[1]))) / 2


@pytest.mark.parametrize(
    "name", ["eagle-tree", *(pytest.param(n, marks=pytest.mark.slow) for n in ("ngram", "draft-model"))]
)
def test_a_paged_decode_engine_admits_handed_over_rows_into_its_pages(name):
    """A decode engine on pages on data 2 x model 2 takes each handed-over row's cache into pages of
    its slot's data group's pool, no cached pages shared (the row brings its whole cache): the
    colocated engine's tokens and accepted drafts, and every page back at the end; a follow-up
    request that shares the prompt's pages hits them where the proposer reads no features."""
    target, proposer = CASES[name]()
    requests = _requests(target.config.vocab_size)
    colocated = _colocated(name)
    prefill_mesh = sharding.make_mesh(model=2, data=1, devices=PREFILL_DEVICES)
    prefill = Engine(target, proposer, mesh=prefill_mesh, **OPTIONS)
    decode_mesh = sharding.make_mesh(model=2, data=2, devices=DECODE_DEVICES)
    decode = Engine(target, proposer, mesh=decode_mesh, page_size=16, **OPTIONS)
    assert _outputs(Prefilling(decode, LocalPrefiller(prefill)), requests)[:2] == colocated
    assert len(decode.kv_cache.pools) == 2
    for pool in decode.kv_cache.pools:
        pool.check()
        assert pool.available_pages == pool.usable_pages
    again = decode.run([Request(requests[4].prompt, max_new_tokens=4)])  # prefilled here: a hit or not
    assert list(again.values())[0] == colocated[0][4][:4]
    hits = decode.kv_cache.prefix_counts[1]
    assert (hits > 0) == (not decode.spec.proposer_reads_features)


def test_a_failed_transfer_is_tried_again_or_fails_its_request_alone():
    """A prefiller that fails once is tried again (the answers are right); one whose bytes come
    cut short, or from an engine of other shapes, ends that request with finish_reason "error" and
    a warning naming why, while the other requests get their answers."""
    target = TARGET
    requests = _requests(target.config.vocab_size)
    colocated = _outputs(Engine(target, None, **OPTIONS), requests)[0]
    decode, prefiller = _split(target, None)
    calls = []

    def flaky(request, like):  # the first try of every request fails
        calls.append(len(request.prompt))
        if calls.count(len(request.prompt)) == 1:
            raise HandoffError("connection reset")
        return prefiller(request, like)

    assert _outputs(Prefilling(decode, flaky), requests)[0] == colocated
    other = Engine(target, None, **dict(OPTIONS, max_model_len=200))  # rows of another capacity

    def broken(request, like):
        if len(request.prompt) == len(requests[1].prompt):
            return decode_row(encode_row(prefiller(request, like))[:-100], like)  # cut short
        if len(request.prompt) == len(requests[2].prompt):
            return other.prefill(request)
        return prefiller(request, like)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, _, finals = _outputs(Prefilling(decode, broken), requests)
    reasons = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("do not match their checksum" in r for r in reasons)
    assert any("the prefill side has another model, proposer or max_model_len" in r for r in reasons)
    for i in range(len(requests)):
        if len(requests[i].prompt) in (len(requests[1].prompt), len(requests[2].prompt)):
            assert finals[i].finish_reason == "error" and tokens[i] == []
        else:
            assert tokens[i] == colocated[i]


def test_what_a_row_cannot_carry_is_prefilled_by_the_decode_side():
    """Stop strings, constraints and prompt_logprobs are the decode engine's own: such a request
    is prefilled where it decodes (`can_hand_over`), and `Engine.prefill` refuses it naming why."""
    assert not can_hand_over(Request([1, 2, 3], Sampling(stop=("x",))))
    engine = Engine(TARGET, None, **LOGPROB_OPTIONS)
    with pytest.raises(ValueError, match="carries no stop strings, constraint or prompt_logprobs"):
        engine.prefill(Request([1, 2, 3], max_new_tokens=8, prompt_logprobs=1))


def test_a_request_crosses_as_json_unchanged():
    """What the decode side sends the prefill side (and process 0 the others, lockstep.py): every
    sampling field, the key, the options, as they were."""
    sampling = Sampling(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.3,
        logit_bias={3: -1.5, 7: 2.0},
        stop="END",
        stop_token_ids=(4, 9),
        seed=11,
        choice=("yes", "no"),
    )
    request = Request(
        [1, 2, 3], sampling, 17, speculate=False, key=jax.random.key(5), ignore_eos=True, logprobs=2
    )
    back = request_from_json(json.loads(json.dumps(request_to_json(request))))
    assert back.sampling == dataclasses.replace(sampling, stop=("END",))
    assert (back.prompt, back.max_new_tokens, back.speculate, back.ignore_eos, back.logprobs) == (
        [1, 2, 3],
        17,
        False,
        True,
        2,
    )
    assert np.array_equal(jax.random.key_data(back.key), jax.random.key_data(request.key))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PREFILL_SERVER = """
import sys, uvicorn
sys.path.insert(0, {tests!r})
from test_engine import TARGET
import specjax
from specjax.serve import Engine
from specjax.serve.app import make_prefill_app
engine = Engine(TARGET, specjax.NGram(k=3), **{options!r})
app = make_prefill_app(engine, max_request_bytes=4096)  # (a request's JSON: under 1 KiB here)
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning")
"""


def test_two_processes_prefill_and_decode_apart_and_a_dead_prefill_side_fails_requests_cleanly():
    """A prefill server in its own process (`make_prefill_app`, as `specjax serve --role prefill`
    runs it) and a decode engine here pulling rows from it over HTTP (`RemotePrefiller`): answers
    equal the colocated engine's, after a body too large (413), one without the request's fields
    and one not JSON (400) were refused without disturbing it. With the prefill process gone, a
    new request is tried again and then ends with an error, while a request prefilled here
    (prompt_logprobs) is still served."""
    port = _free_port()
    code = PREFILL_SERVER.format(tests=os.path.dirname(__file__), options=LOGPROB_OPTIONS, port=port)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    server = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, "the prefill server did not start"
                time.sleep(0.5)
        for body, code in ((b"x" * (16 << 10), 413), (b'{"prompt": [1]}', 400), (b"not json", 400)):
            bad = urllib.request.Request(url + "/specjax/prefill", body, {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:  # (and the server serves on)
                urllib.request.urlopen(bad, timeout=60)
            assert refused.value.code == code, refused.value.read()
        proposer = specjax.NGram(k=3)
        requests = _requests(TARGET.config.vocab_size)
        colocated = _outputs(Engine(TARGET, proposer, **LOGPROB_OPTIONS), requests)[0]
        decode = Engine(TARGET, proposer, **LOGPROB_OPTIONS)
        remote = RemotePrefiller(url, timeout=60)
        assert _outputs(Prefilling(decode, remote), requests)[0] == colocated
        server.kill()
        server.wait()
        lost = decode.add(requests[0], prefiller=remote)
        here = decode.add(Request(requests[1].prompt, max_new_tokens=8, prompt_logprobs=1), prefiller=remote)
        finals = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while decode.has_work:
                for update in decode.step():
                    if update.finished:
                        finals[update.request_id] = update
        assert finals[lost].finish_reason == "error"
        assert any("no row from the prefill server" in str(w.message) for w in caught)
        assert finals[here].finish_reason == "length"
    finally:
        server.kill()
