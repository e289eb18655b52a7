"""The automata an engine's running requests share (specjax/serve/engine.py): their stop strings'
(`StopStringTables`) and their constraints' (`ConstraintPool`), each in one fixed-size set of
device tables, so that a request's arrival never recompiles.

Stop strings: one Aho-Corasick automaton over the running requests' strings
(specjax/speculate/stops.py), `EngineConfig.max_stop_states` states. A request whose strings are
new gets a new automaton over the running ones' and its own, the running rows' states moved to it;
one whose strings do not fit beside the running ones' waits; one that could never fit is refused.

Constraints (the tables' layout is specjax/speculate/grammar.py's):
`generate` numbers the automata of one call's rows into one state space sized for them. An
engine's programs are compiled once, so its tables have a fixed budget of states and
transitions (`EngineConfig.constraint_states` and `constraint_edges`), and the requests' automata
come and go inside it:

- a request's automaton is placed at the first range of free states that holds it (first fit),
  and stays there while any request using it runs: a running row's automaton state is an index
  into the tables, so an automaton never moves;
- requests with the same constraint share one placement;
- an automaton no running request uses stays placed, so the next request with the same schema
  (a server's usual case) finds it; such automata are evicted, least recently used first, when a
  new one needs their room;
- a request whose automaton does not fit now waits for running ones to end (`can_place`); one
  that could not fit an empty set of tables is refused at once (`check`).

Compiling a schema's automaton is the slow part (outlines-core, host only; a second for a nested
schema): `compile_constraint` caches it, so a server compiles it off the engine's thread before
it adds the request (serve/app.py) and the engine finds it done.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from specjax.speculate.grammar import (
    FORCED_TOKENS,
    Grammar,
    TokenAutomaton,
    check_constraint_model,
    check_edge_keys,
    compile_constraint,
    device_grammar,
    packed_allowed,
    sorted_edges,
)
from specjax.speculate.stops import MAX_STOP_STRINGS, StopStringSet


class StopStringTables:
    """The running requests' stop strings as one automaton and its device tables."""

    def __init__(self, tokenizer, vocab_size: int, max_batch: int, max_states: int):
        self.tokenizer, self.vocab_size, self.max_batch = tokenizer, vocab_size, max_batch
        self.max_states = max_states
        self.set = StopStringSet(())
        self.tables = self._tables(self.set)

    def check(self, stops) -> None:
        """Refuse a request whose stop strings could never fit the automaton alone."""
        own = StopStringSet(sorted(set(stops)))
        if len(own.patterns) > MAX_STOP_STRINGS or own.num_states > self.max_states:
            raise ValueError(
                f"sampling.stop: {len(own.patterns)} stop strings needing {own.num_states} automaton "
                f"states; the engine holds at most {MAX_STOP_STRINGS} strings in "
                f"max_stop_states={self.max_states} states; use fewer or shorter stop strings"
            )

    def has(self, stops) -> bool:
        return set(stops) <= set(self.set.patterns)

    def fits(self, running: set[str], stops) -> bool:
        """Whether the running requests' strings (`running`) and these fit one automaton."""
        if self.has(stops):
            return True
        patterns = sorted(running | set(stops))
        return len(patterns) <= MAX_STOP_STRINGS and StopStringSet(patterns).num_states <= self.max_states

    def grow(self, running: set[str], stops, states: np.ndarray) -> np.ndarray:
        """A new automaton over the running requests' strings and these (the finished requests'
        dropped): the running rows' states (`states`, in the old one) in the new one."""
        patterns = sorted(running | set(stops))
        if len(patterns) > MAX_STOP_STRINGS:
            raise ValueError(
                f"sampling.stop: the running requests and this one have {len(patterns)} distinct stop "
                f"strings, at most {MAX_STOP_STRINGS} at once"
            )
        new = StopStringSet(patterns)
        tables = self._tables(new)  # (raises before anything changes)
        moved = new.move_states(states, self.set)
        self.set, self.tables = new, tables
        return moved

    def mask(self, stops) -> int:
        return self.set.mask(stops)

    def _tables(self, stop_strings: StopStringSet):
        if stop_strings.num_states > self.max_states:
            raise ValueError(
                f"sampling.stop: the stop strings of the running requests and this one need "
                f"{stop_strings.num_states} automaton states, more than the engine's max_stop_states="
                f"{self.max_states}; use fewer or shorter stop strings, or a larger max_stop_states"
            )
        no_rows = [()] * self.max_batch  # (each row's strings: the engine's inputs, per admission)
        return stop_strings.device_tables(self.tokenizer, self.vocab_size, no_rows, self.max_states)


@dataclasses.dataclass
class Placement:
    """An automaton in the tables: its first state's index, its host tables, and the running
    requests using it."""

    offset: int
    automaton: TokenAutomaton
    keys: np.ndarray  # its sorted transitions' keys, numbered from its own state 0
    targets: np.ndarray
    users: int = 0


class ConstraintPool:
    """The engine's constraint tables (the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, max_states: int, max_edges: int):
        check_constraint_model(tokenizer, tuple(eos_ids))
        check_edge_keys(max_states, vocab_size)
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(sorted(set(eos_ids)))
        self.max_states, self.max_edges = max_states, max_edges
        self._allowed = np.zeros((max_states, -(-vocab_size // 32)), np.uint32)
        self._forced = np.full((max_states, FORCED_TOKENS), -1, np.int32)
        self._placed: dict[str, Placement] = {}  # by regex, least recently used first
        self._device: Grammar | None = None  # the tables on the device, while they are current

    def check(self, regex: str) -> TokenAutomaton:
        """The regex's automaton (compiled, or found in the cache); ValueError if it is not a
        constraint outlines-core can compile or it could never fit the tables."""
        automaton = compile_constraint(regex, self.tokenizer, self.vocab_size, self.eos_ids)
        edges = len(automaton.tokens)
        if automaton.num_states > self.max_states or edges > self.max_edges:
            raise ValueError(
                f"sampling constraint: its automaton has {automaton.num_states} states and {edges} "
                f"transitions; the engine's tables hold {self.max_states} states "
                f"(EngineConfig.constraint_states) and {self.max_edges} transitions "
                "(constraint_edges); use a smaller schema (fewer fields, bounded repeats) or larger "
                "budgets"
            )
        return automaton

    def can_place(self, regex: str | None) -> bool:
        """Whether the regex's automaton is placed or fits now (evicting unused ones)."""
        return regex is None or regex in self._placed or self._room(self.check(regex)) is not None

    def acquire(self, regex: str) -> int:
        """Place the regex's automaton (if it is not) for one more running request; its start
        state. The caller checked `can_place`."""
        placement = self._placed.pop(regex, None)
        if placement is None:
            automaton = self.check(regex)
            offset, evicted = self._room(automaton)
            for old in evicted:
                del self._placed[old]
            keys, targets = sorted_edges(automaton, self.vocab_size)
            placement = Placement(offset, automaton, keys, targets)
            rows = slice(offset, offset + automaton.num_states)
            self._allowed[rows] = packed_allowed(automaton, self.vocab_size, self.eos_ids)
            self._forced[rows] = automaton.forced
            self._device = None
        placement.users += 1
        self._placed[regex] = placement  # (now the most recently used)
        return placement.offset

    def release(self, regex: str) -> None:
        """One running request using the regex's automaton ended (it stays placed, unused)."""
        self._placed[regex].users -= 1

    def grammar(self, starts) -> Grammar:
        """The tables on the device, with `starts` as the rows' start states (-1: free rows)."""
        if self._device is None:
            placements = sorted(self._placed.values(), key=lambda p: p.offset)
            keys = [p.keys + p.offset * self.vocab_size for p in placements]  # in order of their
            targets = [p.targets + p.offset for p in placements]  # offsets: the keys stay sorted
            self._device = device_grammar(
                self._allowed,
                np.concatenate(keys) if keys else np.zeros(0, np.int64),
                np.concatenate(targets) if targets else np.zeros(0, np.int32),
                self.max_edges,
                [-1],
                self._forced,
            )
        return self._device.replace(start=jnp.asarray(starts, jnp.int32))

    def _room(self, automaton: TokenAutomaton) -> tuple[int, list[str]] | None:
        """Where the automaton would go: (its offset, the unused automata evicted to make room),
        or None if it does not fit beside the automata in use."""
        kept = dict(self._placed)
        evicted = []
        unused = [regex for regex, p in self._placed.items() if p.users == 0]  # oldest first
        while True:
            edges = sum(len(p.keys) for p in kept.values()) + len(automaton.tokens)
            offset = self._first_fit(automaton.num_states, kept.values())
            if offset is not None and edges <= self.max_edges:
                return offset, evicted
            if not unused:
                return None
            evicted.append(unused.pop(0))
            del kept[evicted[-1]]

    def _first_fit(self, states: int, placements) -> int | None:
        at = 0
        for p in sorted(placements, key=lambda p: p.offset):
            if p.offset - at >= states:
                return at
            at = p.offset + p.automaton.num_states
        return at if self.max_states - at >= states else None
