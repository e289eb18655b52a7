"""The host's view of the engine's requests (specjax/serve/engine.py): a request in a slot, and a
long prompt part-way through its prefill chunks, kept between the engine's steps
(EngineConfig.prefill_chunk)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.serve.engine_config import Request

# The metric counters an Update reports as deltas since the request's previous Update
COUNTERS = ("drafting_steps", "drafted", "accepted", "accepted_at")


def row_counters(counters, b: int) -> dict[str, np.ndarray]:
    """Row b's COUNTERS, read from the loop's MetricCounters (on the host)."""
    return {
        "drafting_steps": np.asarray(counters.drafting_steps[b]),
        "drafted": np.asarray(counters.drafted[b]),
        "accepted": np.asarray(counters.accepted[b]),
        "accepted_at": np.asarray(counters.accepted_at[b]),
    }


@dataclasses.dataclass
class Running:
    """A request in a slot."""

    request_id: int
    request: Request
    stop_ids: frozenset[int]
    reported: int  # tokens of the row (prompt included) already reported
    tokens: list[int]  # generated so far
    seen: dict[str, np.ndarray]  # counters at the previous Update
    started: float
    prompt_logprobs: Any = None  # its prompt's Logprobs (Request.prompt_logprobs), until reported
    constraint_start: int = -1  # its constraint automaton's start state in the engine's tables
    updated: bool = False  # an Update went out (a restarted request's first start's counts)
    admitted: int = 0  # the engine's admission count when it took the slot (the newest is preempted)
    # Tokens an earlier start of the request reported before it was preempted: its row
    # regenerates them (the same tokens: `Restart`), and they are not sent again
    resend: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Restart:
    """A request preempted (a paged engine's pool ran out) and waiting to start again from its
    prompt: what it had reported. Its row regenerates those tokens (greedy, and a seeded or keyed
    request's draws, are those of its first start: its steps are numbered from its own prefill),
    and they are checked against what was sent rather than sent twice."""

    tokens: list[int]
    reported: bool  # an Update went out (its prompt_logprobs with it)


@dataclasses.dataclass
class PromptInChunks:
    """The request, its row so far on the device (a `PartialPrefill`: the target's cache through
    the chunks run, the features its proposer reads) and how many prompt tokens those chunks held."""

    request_id: int
    request: Request
    partial: Any
    chunk: int  # tokens per chunk
    done: int = 0

    @property
    def complete(self) -> bool:
        return self.done >= len(self.request.prompt)

    def next_chunk(self):
        """The next chunk's arguments (tokens [1, chunk] padded past the prompt with 0, its start
        position, the prompt's length), counted as run."""
        prompt = self.request.prompt
        tokens = np.zeros((1, self.chunk), np.int32)
        piece = prompt[self.done : self.done + self.chunk]
        tokens[0, : len(piece)] = piece
        start = self.done
        self.done += self.chunk
        return jnp.asarray(tokens), jnp.int32(start), jnp.int32(len(prompt))
