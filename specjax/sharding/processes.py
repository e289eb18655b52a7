"""Several processes on one mesh: the check that they all make the same call.

On a mesh that spans processes (after `jax.distributed.initialize`), every process runs the same
compiled program and takes part in its collectives. A process that passed other prompts, options
or another mesh would compile another program, or feed the shared one other rows, and the others
would wait for it in a collective that never comes: a hang, or silently wrong rows. So before it
places or compiles anything, `generate` exchanges a cheap fingerprint of its call (a few hashes,
one small `process_allgather`) and every process raises the same clear error when they differ. A
process that failed its own checks before the exchange still takes part in it (`CallAgreement.fail`),
so that the others raise instead of waiting for it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

MAX_PARTS = 8  # parts of a call's fingerprint (prompts, options, mesh, ...)
WORDS = 2  # uint32 words of each part's hash (jax's default int32 world has no uint64)
FAILED = np.uint32(0xFFFFFFFF)  # every word of a process whose call failed before the exchange


def spans_processes(mesh) -> bool:
    """Whether `mesh` (a jax Mesh, or anything else: False) holds devices of several processes."""
    return isinstance(mesh, Mesh) and len({d.process_index for d in mesh.devices.flat}) > 1


def mesh_fingerprint(mesh: Mesh | None) -> tuple | None:
    """What identifies a mesh across processes: its axes, their sizes and its devices' global ids."""
    if mesh is None:
        return None
    return (tuple(mesh.axis_names), mesh.devices.shape, tuple(int(d.id) for d in mesh.devices.flat))


def digest(value) -> np.ndarray:
    """[WORDS] uint32: a hash of `value` that is the same in every process for equal values: numpy
    and jax arrays by shape, dtype and bytes, containers item by item, anything else by its repr
    with object addresses removed (they differ between processes)."""
    hasher = hashlib.sha256()
    _feed(hasher, value)
    words = np.frombuffer(hasher.digest()[: 4 * WORDS], np.uint32).copy()
    return np.where(words == FAILED, 0, words).astype(np.uint32)  # FAILED marks a failed process only


def _feed(hasher, value) -> None:
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    if isinstance(value, np.ndarray | jax.Array):
        array = np.asarray(value)
        hasher.update(f"array{array.shape}{array.dtype}".encode())
        hasher.update(np.ascontiguousarray(array).tobytes())
    elif isinstance(value, Mapping):
        hasher.update(b"{")
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, list | tuple):
        hasher.update(f"{type(value).__name__}[{len(value)}]".encode())
        for item in value:
            _feed(hasher, item)
    else:
        hasher.update(re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value)).encode())


class CallAgreement:
    """The exchange of one call's fingerprint between the processes of `mesh` (nothing to do on a
    mesh inside one process, or without a mesh). `who` names the call in messages.

        agreement = CallAgreement(mesh, "generate")
        try:
            ...  # validate, tokenize, build inputs
            agreement.check({"prompts": ..., "options": ..., "mesh": ...})
            ...  # place, compile, run
        except Exception:
            agreement.fail()  # the others must not wait for this process
            raise
    """

    def __init__(self, mesh, who: str):
        self.active = spans_processes(mesh)
        self.who = who
        self.names: tuple[str, ...] | None = None
        self.done = False

    def check(self, parts: Mapping[str, object]) -> None:
        """Exchange the digests of `parts` (name -> value) with every process; ValueError naming the
        processes and parts that differ from process 0's, or the processes that failed."""
        if not self.active or self.done:
            return
        if len(parts) > MAX_PARTS:
            raise ValueError(f"CallAgreement.check: at most {MAX_PARTS} parts, got {len(parts)}")
        self.names = tuple(parts)
        self._exchange(np.stack([digest(value) for value in parts.values()]))

    def fail(self) -> None:
        """Tell the other processes that this one failed before the exchange (a no-op after it)."""
        if self.active and not self.done:
            self._exchange(None)

    def _exchange(self, local: np.ndarray | None) -> None:
        self.done = True
        # The gathered shape must be the same in every process, whatever each one's call: one row
        # of WORDS per part, at most MAX_PARTS parts.
        rows = np.full((MAX_PARTS, WORDS), FAILED, np.uint32)
        if local is not None:
            rows[:] = 0
            rows[: len(local)] = local
        gathered = multihost_utils.process_allgather(rows)  # [processes, MAX_PARTS, WORDS]
        failed = [p for p in range(len(gathered)) if (gathered[p] == FAILED).all()]
        if failed and local is None:
            return  # this process raises its own error
        if failed:
            raise ValueError(
                f"{self.who}: process {_listed(failed)} failed before running the call (see the error "
                f"there); every process of a mesh that spans processes must make the same call"
            )
        names = self.names or ()
        differing = {}
        for p in range(1, len(gathered)):
            parts = [names[i] for i in range(len(names)) if (gathered[p, i] != gathered[0, i]).any()]
            if parts:
                differing[p] = parts
        if differing:
            details = "; ".join(f"process {p}: {', '.join(parts)}" for p, parts in differing.items())
            raise ValueError(
                f"{self.who}: the processes did not make the same call; these differ from process 0's "
                f"({details}). On a mesh that spans processes every process must pass the same "
                f"{_and(names)} (this process is {jax.process_index()} of {jax.process_count()})"
            )


def _and(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _listed(processes: list[int]) -> str:
    return ", ".join(str(p) for p in processes)
