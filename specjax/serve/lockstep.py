"""An engine on a mesh that spans processes: every process runs the same programs, one of them
decides.

Each process of a multi-process mesh (after `jax.distributed.initialize`) builds the same Engine
(same model, proposer, config and mesh). Process 0 is the leader: its caller (the server's
scheduler, or a script) adds requests, aborts them and steps the engine as on one process. Before
each step the leader sends every other process what changed since the last one (the requests
added, as JSON, and the ids aborted); each follower (`Engine.follow`) makes the same calls in the
same order, then steps. The engine's host side is deterministic given those calls (admissions,
slots, buckets and chunks depend on the queue and the requests alone, never on a clock), so every
process runs the same programs on the same global arrays, and the collectives inside them meet.

The messages go over a TCP connection from each follower to the leader (`address`, "host:port":
the leader listens there), one JSON line per step, not through a device collective: a leader that
waits for requests for an hour keeps its followers waiting on a socket, where a collective would
time out. A follower whose leader goes away (the connection closed) returns from `follow`.
"""

from __future__ import annotations

import json
import socket
import time

import jax

from specjax.serve.engine_config import Request
from specjax.serve.handoff import request_from_json, request_to_json

CONNECT_TIMEOUT_S = 300.0  # a follower keeps trying to reach the leader this long


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"lockstep_address={address!r}: give host:port, e.g. 10.0.0.1:12400")
    return host, int(port)


class Leader:
    """Process 0's side: the changes since the last step, sent to every follower before it."""

    def __init__(self, address: str, followers: int):
        host, port = _host_port(address)
        self._server = socket.create_server((host, port))
        self._server.settimeout(CONNECT_TIMEOUT_S)
        self._connections = []
        for i in range(followers):  # each follower connects once, at its engine's start
            try:
                connection, _ = self._server.accept()
            except TimeoutError:
                self._server.close()
                raise RuntimeError(
                    f"lockstep: {i} of the {followers} other processes reached {address} in "
                    f"{CONNECT_TIMEOUT_S:.0f} s; each builds the same engine with the same lockstep_address"
                ) from None
            connection.settimeout(None)
            self._connections.append(connection.makefile("w"))
        self._changes: list = []

    def added(self, request: Request) -> None:
        self._changes.append(["add", request_to_json(request)])

    def aborted(self, request_id: int) -> None:
        self._changes.append(["abort", request_id])

    def step(self) -> None:
        """Send the changes and a step (the leader steps after this returns)."""
        self._send([*self._changes, ["step"]])
        self._changes = []

    def close(self) -> None:
        """Tell the followers to return from `follow`."""
        self._send([["stop"]])
        for connection in self._connections:
            connection.close()
        self._server.close()

    def _send(self, message: list) -> None:
        line = json.dumps(message) + "\n"
        for connection in self._connections:
            connection.write(line)
            connection.flush()


class Follower:
    """Another process's side: the leader's messages, one per step."""

    def __init__(self, address: str):
        host, port = _host_port(address)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                self._connection = socket.create_connection((host, port), timeout=None)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._lines = self._connection.makefile("r")

    def messages(self):
        """Each step's changes, as [kind, value] pairs ending with ["step"], until the leader
        stops or goes away."""
        for line in self._lines:
            message = json.loads(line)
            if message == [["stop"]]:
                return
            yield message

    def apply(self, engine, message) -> None:
        """Make the leader's calls: its adds and aborts, then the step."""
        for kind, *value in message:
            if kind == "add":
                engine.add(request_from_json(value[0]))
            elif kind == "abort":
                engine.abort(value[0])
            elif kind == "step":
                engine.step()


def lockstep_for(mesh, address: str | None):
    """The engine's side of the lockstep on `mesh` (None off a mesh spanning processes): Leader on
    process 0, Follower elsewhere. ValueError without an address."""
    from specjax.sharding import spans_processes

    if not spans_processes(mesh):
        return None
    if address is None:
        raise ValueError(
            "lockstep_address: on a mesh that spans processes, the engine's process 0 leads the "
            "others over TCP; give host:port (process 0 listens there)"
        )
    if jax.process_index() == 0:
        return Leader(address, jax.process_count() - 1)
    return Follower(address)
