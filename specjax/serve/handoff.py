"""Prefill and decode apart (disaggregated serving): a prefill engine computes a request's row and
a decode engine admits it without prefilling, and speculates.

A row is the `DecodeState` of a batch of one that the prefill made (`Engine.prefill`): the
target's KV cache for the prompt, everything the proposer needs to go on (the features an
EAGLE / EAGLE-3 / MTP / DFlash head reads, a draft model's own KV cache, the n-gram history, which
is the row's tokens), and the first token. Handing over the whole row, rather than the target's
pages alone, is what keeps the split lossless: a decode side that had only the target's KV would
draft from a proposer state that never saw the prompt (SGLang's disaggregation lost the draft
model's state this way, sglang#23539).

The decode side pulls: `Engine.add(request, prefiller=...)` asks a prefiller for the row, off the
thread that steps the engine (`Handoffs`), and admits the request when its row has arrived, its
running rows stepping meanwhile. Two prefillers:

- `LocalPrefiller(engine)`: another Engine in this process, on other devices (its own mesh); its
  row moves to the decode engine's devices by `jax.device_put`.
- `RemotePrefiller(url)`: a prefill server in another process (`specjax serve --role prefill`,
  `make_prefill_app`), over HTTP: the row crosses as bytes (`encode_row`: its leaves with their
  shapes, dtypes and a SHA-256 of the payload) through the host, a documented host path rather
  than a device-to-device transfer.

A transfer that fails (the prefill side gone, a body cut short, a checksum that does not match) is
tried again `retries` times, then the request ends with finish_reason "error" and a warning that
names the cause; the decode engine serves the others throughout, and a row that does not check is
never decoded. A request the row cannot carry (stop strings or a constraint, whose automaton
states are the prefill engine's own; prompt_logprobs) is prefilled by the decode engine itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from specjax.serve.engine_config import Request
from specjax.speculate.sampling import Sampling

MAGIC = b"specjax-row-1\n"  # a row's bytes begin with it, then one JSON line, then the leaves
PREFILL_ROUTE = "/specjax/prefill"
RETRIES = 1  # a failed transfer is tried again this many times before the request fails


class HandoffError(RuntimeError):
    """A row that did not arrive, or arrived broken: the request it was for ends with an error."""


def can_hand_over(request: Request) -> bool:
    """Whether a prefill engine's row carries everything the request needs (module docstring)."""
    sampling = request.sampling
    return not sampling.stop and sampling.constraint is None and request.prompt_logprobs is None


# ----- a row as bytes (the host path between processes) -------------------------------------------


def encode_row(row, slot_axes=None, slots: int | None = None) -> bytes:
    """A row (a DecodeState of a batch of one, on any devices) as bytes: MAGIC, a JSON line (each
    leaf's shape and dtype, PRNG keys by their key data, and the payload's SHA-256), the leaves'
    bytes. With `slot_axes` (per leaf, its cache slots' axis or -1: `EngineBatch.slot_axes`) and
    `slots`, only the first `slots` of each (the prompt's and its first token's: the rest is never
    read before it is written) are sent, the others padded again by `decode_row`."""
    leaves = []
    host = jax.device_get(row)
    if slot_axes is not None and slots is not None:
        host = jax.tree.map(
            lambda x, axis: x if axis < 0 else np.asarray(x).take(range(min(slots, x.shape[axis])), axis),
            host,
            slot_axes,
        )
    for leaf in jax.tree.leaves(host):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaves.append(("key", np.asarray(jax.random.key_data(leaf))))
        else:
            leaves.append(("array", np.asarray(leaf)))
    payload = b"".join(np.ascontiguousarray(array).tobytes() for _, array in leaves)
    header = {
        "leaves": [[kind, list(array.shape), array.dtype.str] for kind, array in leaves],
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    return MAGIC + json.dumps(header).encode() + b"\n" + payload


def check_row(row, like) -> None:
    """HandoffError unless `row` has the structure, shapes and dtypes of `like` (this engine's own
    row): a row from an engine with another model, proposer or max_model_len."""
    leaves, treedef = jax.tree.flatten(row)
    mine, my_treedef = jax.tree.flatten(like)
    if treedef != my_treedef:
        raise HandoffError(
            "a row of another structure: the prefill side has another model, proposer or max_model_len"
        )
    for i, (leaf, expected) in enumerate(zip(leaves, mine, strict=True)):
        if tuple(leaf.shape) != tuple(expected.shape) or leaf.dtype != expected.dtype:
            raise HandoffError(
                f"a row's array {i} is {leaf.dtype}{list(leaf.shape)}, this engine's "
                f"{expected.dtype}{list(expected.shape)}: the prefill side has another model, "
                "proposer or max_model_len"
            )


def decode_row(data: bytes, like):
    """The row of `encode_row`'s bytes, as numpy leaves in the structure of `like` (the decode
    engine's own row, or its shapes: `EngineBatch.row_like`, whose shapes and dtypes it must
    have). HandoffError naming what is wrong for bytes cut short, altered, or from an engine with
    other shapes (another model, proposer or max_model_len)."""
    if not data.startswith(MAGIC) or b"\n" not in data[len(MAGIC) :]:
        raise HandoffError(f"a row's bytes begin with {MAGIC!r}; got {data[:32]!r} ({len(data)} bytes)")
    line, payload = data[len(MAGIC) :].split(b"\n", 1)
    header = json.loads(line)
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise HandoffError(f"a row's {len(payload)} bytes do not match their checksum (cut short or altered)")
    expected, treedef = jax.tree.flatten(like)
    if len(header["leaves"]) != len(expected):
        raise HandoffError(
            f"a row of {len(header['leaves'])} arrays, this engine's rows have {len(expected)}: the "
            "prefill side has another model, proposer or max_model_len"
        )
    leaves, offset = [], 0
    for (kind, shape, dtype), mine in zip(header["leaves"], expected, strict=True):
        array = np.frombuffer(payload, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)
        offset += array.nbytes
        if kind == "array" and len(shape) == len(mine.shape) and tuple(shape) != tuple(mine.shape):
            # (sent in part: its slots past those sent as zeros, never read before written)
            padding = [(0, max(0, b - a)) for a, b in zip(shape, mine.shape, strict=True)]
            array = np.pad(array, padding)
        if kind == "key":  # (the engine's keys are jax.random.key's, of the default implementation)
            array = jax.random.wrap_key_data(array)
        leaves.append(array)
    if offset != len(payload):
        raise HandoffError(f"a row's {len(payload)} bytes hold {offset} of its arrays' bytes")
    row = jax.tree.unflatten(treedef, leaves)
    check_row(row, like)
    return row


# ----- a request as JSON (what the decode side sends the prefill side) -----------------------------


def request_to_json(request: Request) -> dict:
    """What a prefill server needs of a request to make its row (its key as key data)."""
    sampling = {f.name: getattr(request.sampling, f.name) for f in dataclasses.fields(Sampling)}
    if sampling["logit_bias"] is not None:
        sampling["logit_bias"] = {str(t): float(b) for t, b in sampling["logit_bias"].items()}
    sampling["stop_token_ids"] = [int(t) for t in sampling["stop_token_ids"]]
    stop = sampling["stop"]
    sampling["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if sampling["choice"] is not None:
        sampling["choice"] = list(sampling["choice"])
    key = None if request.key is None else np.asarray(jax.random.key_data(request.key)).tolist()
    return {
        "prompt": [int(t) for t in request.prompt],
        "max_new_tokens": request.max_new_tokens,
        "speculate": request.speculate,
        "ignore_eos": request.ignore_eos,
        "logprobs": request.logprobs,
        "sampling": sampling,
        "key": key,
    }


def request_from_json(body: dict) -> Request:
    sampling = dict(body["sampling"])
    if sampling.get("logit_bias") is not None:
        sampling["logit_bias"] = {int(t): b for t, b in sampling["logit_bias"].items()}
    sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids", ()))
    sampling["stop"] = tuple(sampling.get("stop", ()))
    if sampling.get("choice") is not None:
        sampling["choice"] = tuple(sampling["choice"])
    key = body.get("key")
    return Request(
        prompt=list(body["prompt"]),
        sampling=Sampling(**sampling),
        max_new_tokens=body["max_new_tokens"],
        speculate=body["speculate"],
        key=None if key is None else jax.random.wrap_key_data(np.asarray(key, np.uint32)),
        ignore_eos=body["ignore_eos"],
        logprobs=body["logprobs"],
    )


# ----- prefillers ---------------------------------------------------------------------------------


class LocalPrefiller:
    """Rows from another Engine in this process (on devices of its own): `engine.prefill`, one at
    a time (the engine is driven from one thread)."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()

    def __call__(self, request: Request, like):
        with self._lock:
            return self.engine.prefill(request)


class RemotePrefiller:
    """Rows from a prefill server (`make_prefill_app`) at `url`, as bytes over HTTP (sending
    `api_key` where the server wants one)."""

    def __init__(self, url: str, timeout: float = 600.0, api_key: str | None = None):
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key

    def __call__(self, request: Request, like):
        body = json.dumps(request_to_json(request)).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        call = urllib.request.Request(self.url + PREFILL_ROUTE, body, headers, method="POST")
        try:
            with urllib.request.urlopen(call, timeout=self.timeout) as response:
                data = response.read()
        except urllib.error.HTTPError as error:  # the prefill side refused it: not worth a retry
            raise ValueError(f"the prefill server refused the request: {error.read().decode()}") from None
        except (OSError, http.client.HTTPException) as error:
            raise HandoffError(f"no row from the prefill server at {self.url}: {error}") from None
        return decode_row(data, like)


class Handoffs:
    """The rows a decode engine waits for, by request id: each asked of its prefiller on a worker
    thread, tried again `retries` times where the transfer failed (HandoffError), then a failure
    (the error kept for the request's final Update)."""

    def __init__(self, workers: int = 4, retries: int = RETRIES):
        self.retries = retries
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="specjax-handoff")
        self._futures: dict[int, concurrent.futures.Future] = {}

    def ask(self, request_id: int, request: Request, prefiller: Callable[..., Any], like) -> None:
        self._futures[request_id] = self._pool.submit(self._fetch, prefiller, request, like)

    def _fetch(self, prefiller, request: Request, like):
        for _ in range(self.retries):
            try:
                return prefiller(request, like)
            except HandoffError:
                pass  # (tried again)
        return prefiller(request, like)

    def waits_for(self, request_id: int) -> bool:
        """Whether the request's row is asked for and has not arrived (nor failed) yet."""
        future = self._futures.get(request_id)
        return future is not None and not future.done()

    def has(self, request_id: int) -> bool:
        return request_id in self._futures

    def take(self, request_id: int):
        """The row that arrived (its future's result: raises what the transfer raised)."""
        return self._futures.pop(request_id).result()

    def drop(self, request_id: int) -> None:
        future = self._futures.pop(request_id, None)
        if future is not None:
            future.cancel()
