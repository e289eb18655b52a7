"""Stop strings, matched on device, token by token, inside the compiled loop.

Detokenizing on the device is out of the question, so the host compiles the stop strings of a
call into a finite automaton over *tokens*: an Aho-Corasick automaton over the characters of the
stop strings, run ahead of time through every token's text. The result is two tables indexed
by (automaton state, token id): the state after reading the token's text, and a bitmask of the
stop strings an occurrence of which ends inside that token. On device, advancing a row by one
token is two gathers; a row stops at the first token whose bitmask meets the row's own strings.

Token texts are each token's text as it reads in the middle of a sequence (decoded after a fixed
ordinary token, so SentencePiece's leading-space marker counts), special tokens read as "". A
multi-byte character split across byte-level tokens reads as replacement characters, so a stop
string holding such a character may be missed on device; `cut_text` still cuts the returned
text at it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MAX_STOP_STRINGS = 31  # distinct stop strings in one call: bits of an int32 mask
STATE_GRANULE = 8  # automaton sizes round up to this, so similar stop strings share a program


@flax.struct.dataclass
class StopStrings:
    """The device side: the automaton tables and each row's strings."""

    next_state: jax.Array  # [S, V] int32: the state after reading a token's text
    matches: jax.Array  # [S, V] int32: bitmask of the strings completed while reading it
    row_mask: jax.Array  # [B] int32: bitmask of the strings that stop this row

    def advance(self, states: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Read tokens [B, T] from states [B]: (states after each token [B, T], stop [B, T] bool).

        Entries of tokens past a row's real candidates may be anything (-1 included); the caller
        ignores what they produce."""
        safe = jnp.clip(tokens, 0, self.next_state.shape[1] - 1)
        after, stop = [], []
        for t in range(tokens.shape[1]):  # T = k + 1, small and static
            matched = self.matches[states, safe[:, t]]
            states = self.next_state[states, safe[:, t]]
            after.append(states)
            stop.append((matched & self.row_mask) != 0)
        return jnp.stack(after, axis=1), jnp.stack(stop, axis=1)


def _aho_corasick(patterns: Sequence[str]) -> tuple[np.ndarray, np.ndarray, dict[str, int], list[str]]:
    """(delta [S, A+1], output bitmask per state [S], alphabet {char: column}, the prefix of a
    pattern each state stands for [S]) of the automaton that finds every pattern; column A stands
    for any character outside the patterns."""
    alphabet = {c: i for i, c in enumerate(sorted(set("".join(patterns))))}
    goto: list[dict[str, int]] = [{}]
    output = [0]
    prefixes = [""]
    for bit, pattern in enumerate(patterns):
        state = 0
        for c in pattern:
            if c not in goto[state]:
                goto.append({})
                output.append(0)
                prefixes.append(prefixes[state] + c)
                goto[state][c] = len(goto) - 1
            state = goto[state][c]
        output[state] |= 1 << bit
    delta = np.zeros((len(goto), len(alphabet) + 1), np.int64)  # the "other" column stays at 0
    fail = [0] * len(goto)
    queue = collections.deque()
    for c, column in alphabet.items():
        delta[0, column] = goto[0].get(c, 0)
        if c in goto[0]:
            queue.append(goto[0][c])
    while queue:  # breadth first, so a state's fail target is complete before the state
        state = queue.popleft()
        output[state] |= output[fail[state]]
        for c, column in alphabet.items():
            if c in goto[state]:
                child = goto[state][c]
                fail[child] = delta[fail[state], column]
                delta[state, column] = child
                queue.append(child)
            else:
                delta[state, column] = delta[fail[state], column]
    return delta, np.asarray(output, np.int64), alphabet, prefixes


def token_tables(token_texts: Sequence[str], patterns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(next_state [S, V], matches [S, V]) for the patterns over tokens with these texts."""
    delta, output, alphabet, _ = _aho_corasick(patterns)
    other = len(alphabet)
    width = max(1, max(len(t) for t in token_texts))
    chars = np.full((len(token_texts), width), -1, np.int64)  # -1 pads past a token's end
    for v, text in enumerate(token_texts):
        chars[v, : len(text)] = [alphabet.get(c, other) for c in text]
    num_states = delta.shape[0]
    next_state = np.zeros((num_states, len(token_texts)), np.int32)
    matches = np.zeros((num_states, len(token_texts)), np.int32)
    for start in range(num_states):  # run every token from every state, vectorised over tokens
        state = np.full(len(token_texts), start, np.int64)
        found = np.zeros(len(token_texts), np.int64)
        for i in range(width):
            column = chars[:, i]
            live = column >= 0
            moved = delta[state, np.maximum(column, 0)]
            state = np.where(live, moved, state)
            found |= np.where(live, output[moved], 0)
        next_state[start], matches[start] = state, found
    return next_state, matches


_TEXTS: dict[int, tuple[object, int, list[str]]] = {}


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """Each token id's text as it reads after an ordinary token; "" for special and unused ids."""
    cached = _TEXTS.get(id(tokenizer))
    if cached is not None and cached[0] is tokenizer and cached[1] == vocab_size:
        return cached[2]
    anchor = tokenizer("a", add_special_tokens=False)["input_ids"][-1]
    head = tokenizer.decode([anchor], skip_special_tokens=True)
    known = min(vocab_size, len(tokenizer))
    pairs = tokenizer.batch_decode([[anchor, v] for v in range(known)], skip_special_tokens=True)
    alone = None
    texts = []
    for v, pair in enumerate(pairs):
        if pair.startswith(head):
            texts.append(pair[len(head) :])
        else:  # the pair merged in decoding: fall back to the token on its own
            alone = alone or tokenizer.batch_decode([[u] for u in range(known)], skip_special_tokens=True)
            texts.append(alone[v])
    texts += [""] * (vocab_size - known)
    _TEXTS[id(tokenizer)] = (tokenizer, vocab_size, texts)
    return texts


def build_stop_strings(tokenizer, vocab_size: int, per_row: Sequence[Sequence[str]]) -> StopStrings | None:
    """The device tables for a batch whose row b stops at any of per_row[b]; None if no row has
    stop strings."""
    patterns = sorted({s for row in per_row for s in row})
    if not patterns:
        return None
    if len(patterns) > MAX_STOP_STRINGS:
        raise ValueError(
            f"sampling stop: {len(patterns)} distinct stop strings in one call, at most "
            f"{MAX_STOP_STRINGS} are supported"
        )
    return StopStringSet(tuple(patterns)).device_tables(tokenizer, vocab_size, per_row)


class StopStringSet:
    """The host side of one automaton: its patterns (bit i stands for patterns[i]) and the prefix
    each of its states stands for, so that a continuous batch, whose set of stop strings changes
    as requests come and go, can move a running row to the new automaton (`move_states`)."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        self.delta, _, self.alphabet, self.prefixes = _aho_corasick(self.patterns)

    @property
    def num_states(self) -> int:
        return len(self.prefixes)

    def mask(self, stops: Sequence[str]) -> int:
        """The bitmask of a row that stops at `stops` (each one of the patterns)."""
        return sum(1 << self.patterns.index(s) for s in set(stops))

    def state_after(self, text: str) -> int:
        """The state reached by reading text from the start state."""
        state, other = 0, len(self.alphabet)
        for c in text:
            state = int(self.delta[state, self.alphabet.get(c, other)])
        return state

    def move_states(self, states: np.ndarray, old: StopStringSet) -> np.ndarray:
        """Row states of `old`'s automaton as states of this one.

        A state of `old` stands for the longest end of the text read so far that begins one of
        old's patterns. Read from the start, that prefix leads this automaton to the longest end of
        it that begins one of this set's patterns. For a row whose own strings are in both sets,
        that is as much of the text as its strings can still complete: what the row matches from
        then on is what it would have matched had this automaton read the whole text."""
        return np.asarray([self.state_after(old.prefixes[s]) for s in states], np.int32)

    def device_tables(
        self, tokenizer, vocab_size: int, per_row: Sequence[Sequence[str]], num_states: int | None = None
    ) -> StopStrings:
        """The device tables, padded to num_states rows (default: a multiple of STATE_GRANULE;
        the padding states are unreachable), with row b stopping at per_row[b]."""
        next_state, matches = token_tables(token_texts(tokenizer, vocab_size), self.patterns)
        padded = num_states or -(-next_state.shape[0] // STATE_GRANULE) * STATE_GRANULE
        pad = ((0, padded - next_state.shape[0]), (0, 0))
        row_mask = np.array([self.mask(row) for row in per_row], np.int32)
        return StopStrings(
            next_state=jnp.asarray(np.pad(next_state, pad)),
            matches=jnp.asarray(np.pad(matches, pad)),
            row_mask=jnp.asarray(row_mask),
        )


def cut_text(text: str, stops: Sequence[str], include: bool = False) -> str:
    """The text before the first occurrence of any stop string (all of it when none occurs); with
    `include`, up to the end of that stop string (vLLM's include_stop_str_in_output)."""
    end = stop_end(text, stops, 0, include)
    return text if end is None else text[:end]


def stop_end(text: str, stops: Sequence[str], start: int, include: bool) -> int | None:
    """Where the text ends at its first stop string found from `start` on: where the stop string
    begins, or with `include` where it ends (of the strings beginning there, the longest); None
    when none occurs."""
    found = [(i, len(s)) for s in stops if (i := text.find(s, start)) >= 0]
    if not found:
        return None
    first = min(i for i, _ in found)
    return first + max(n for i, n in found if i == first) if include else first
