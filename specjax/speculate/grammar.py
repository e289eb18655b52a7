"""Structured output: a row constrained by a regex, a JSON schema or a list of choices, inside the
compiled loop and lossless under the constraint.

The host compiles a row's constraint to a regular expression (a JSON schema through
outlines-core's `build_regex_from_schema`, a choice list as an alternation of escaped strings)
and that to a deterministic automaton over *tokens* of the model's vocabulary (outlines-core's
`Index`; docs/structured.md says why that library). The automata of a call's rows are numbered
into one state space and put on the device as fixed-size tables:

- `allowed [S, ceil(V/32)] uint32`: per state, a bitmask of the tokens it allows (EOS exactly in
  the accepting states);
- `edge_keys [E] int32` sorted, `edge_next [E] int32`: the transitions as a sparse list, key
  state * V + token, looked up with `searchsorted` (a state inside a JSON string allows nearly the
  whole vocabulary, so a dense [S, V] table would be mostly copies; the list holds what is there).

S and E are budgets rounded up to powers of two (from MIN_STATES / MIN_EDGES), so another schema of
the same budget reuses the compiled program; one over MAX_STATES / MAX_EDGES is refused.

On device a row's automaton state (DecodeState.grammar_states, -1 for an unconstrained row)
advances by committed tokens only. The target's logits at every scored position are masked by the
state reached along the draft path to it, so a draft token the automaton forbids has p = 0 and is
rejected, whatever the proposer's q: the output follows the target's law restricted to the grammar
and renormalised at each step (greedy: its argmax over the allowed tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MIN_STATES = 64  # the smallest state budget (tables round up to a power of two from here)
MAX_STATES = 4096  # states of one call's automata together
MIN_EDGES = 4096
MAX_EDGES = 1 << 21  # transitions of one call's automata together (16 MiB of int32 pairs)
CONSTRAINTS = ("regex", "json_schema", "choice")


def check_constraint(regex, json_schema, choice, compact_json: bool = False) -> None:
    """Validate a Sampling's constraint fields (at most one set; compact_json a bool, True only
    with json_schema); ValueError naming the field."""
    if not isinstance(compact_json, bool):
        raise ValueError(f"Sampling compact_json must be True or False, got {compact_json!r}")
    if compact_json and json_schema is None:
        raise ValueError(
            "Sampling compact_json=True shapes a json_schema's whitespace; give a json_schema with it "
            "(regex and choice spell their own), got json_schema=None"
        )
    given = [
        name
        for name, value in zip(CONSTRAINTS, (regex, json_schema, choice), strict=True)
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"Sampling takes at most one of regex, json_schema and choice, got {', '.join(given)}"
        )
    if regex is not None and (not isinstance(regex, str) or not regex):
        raise ValueError(f"Sampling regex must be a non-empty string, got {regex!r}")
    if json_schema is not None:
        schema_regex(json_schema, compact_json)  # raises on a schema outlines-core cannot compile
    if choice is not None and (
        isinstance(choice, str)
        or not isinstance(choice, Sequence)
        or not choice
        or not all(isinstance(c, str) and c for c in choice)
    ):
        raise ValueError(f"Sampling choice must be a non-empty list of non-empty strings, got {choice!r}")


def schema_regex(json_schema, compact: bool = False) -> str:
    """The regular expression of a JSON schema (a dict or its JSON text). Between its tokens the
    JSON may hold a space (outlines-core's default, `[ ]?`), or with `compact` none at all (vLLM's
    disable_any_whitespace): then every key's quoted name and its colon, and the punctuation
    between values, are forced text, which GrammarDraft drafts whole."""
    if isinstance(json_schema, Mapping):
        try:
            text = json.dumps(json_schema)
        except (TypeError, ValueError) as error:
            raise ValueError(f"Sampling json_schema must be JSON-serialisable: {error}") from None
    elif isinstance(json_schema, str):
        text = json_schema
    else:
        raise ValueError(
            f"Sampling json_schema must be a dict or a JSON string, got {type(json_schema).__name__}"
        )
    return _regex_of_schema(text, compact)


@functools.lru_cache(maxsize=256)
def _regex_of_schema(text: str, compact: bool) -> str:
    """(Cached: a served schema's regex is asked for at each admission check of its request.)"""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        schema = json.loads(text)
    except ValueError as error:
        raise ValueError(f"Sampling json_schema is not JSON: {error}") from None
    found = unenforced_keyword(schema)
    if found is not None:
        keyword, where = found
        raise ValueError(
            f"Sampling json_schema uses {keyword!r} (at {where or '/'}), which outlines-core's compiler does "
            "not enforce, so an answer could break it; drop it (or express it another way: a pattern, "
            "an enum)"
        )
    try:
        return build_regex_from_schema(text, "") if compact else build_regex_from_schema(text)
    except (TypeError, ValueError) as error:
        raise ValueError(f"Sampling json_schema is not a schema specjax can compile: {error}") from None


# Validation keywords outlines-core 0.2.14's build_regex_from_schema reads past without enforcing
# (each checked against its output: the regex is the same with and without). A schema using one
# is refused rather than answered with JSON that may not validate.
UNENFORCED_KEYWORDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "patternProperties",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedItems",
    "unevaluatedProperties",
)
# Where a schema holds subschemas: a keyword's value is one, or a list or a map of them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def unenforced_keyword(schema, where: str = "") -> tuple[str, str] | None:
    """The first UNENFORCED_KEYWORDS keyword in a schema and its JSON pointer; None if none."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            return keyword, where
    inner = [(schema[k], f"{where}/{k}") for k in _SUBSCHEMA if k in schema]
    for k in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(k), list):
            inner += [(s, f"{where}/{k}/{i}") for i, s in enumerate(schema[k])]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            inner += [(s, f"{where}/{k}/{name}") for name, s in schema[k].items()]
    if isinstance(schema.get("items"), list):  # (draft 4's tuple form)
        inner += [(s, f"{where}/items/{i}") for i, s in enumerate(schema["items"])]
    for subschema, path in inner:
        found = unenforced_keyword(subschema, path)
        if found is not None:
            return found
    return None


def constraint_regex(regex, json_schema, choice, compact_json: bool = False) -> str | None:
    """The regular expression a row's output must match in full, or None when it has none."""
    if regex is not None:
        return regex
    if json_schema is not None:
        return schema_regex(json_schema, compact_json)
    if choice is not None:
        return "(" + "|".join(re.escape(c) for c in choice) + ")"
    return None


def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's bytes_to_unicode), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes as it reads inside a sequence; None for special and unused ids."""
    from specjax.speculate.stops import token_texts

    decoder = type(tokenizer.backend_tokenizer.decoder).__name__
    byte_level = decoder == "ByteLevel"
    to_byte = _byte_decoder()
    special = set(tokenizer.all_special_ids)
    texts = token_texts(tokenizer, vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    out: list[bytes | None] = []
    for v in range(vocab_size):
        piece = pieces[v] if v < len(pieces) else None
        if piece is None or v in special:
            out.append(None)
        elif byte_level and all(c in to_byte for c in piece):
            out.append(bytes(to_byte[c] for c in piece))
        elif (match := _SENTENCEPIECE_BYTE.fullmatch(piece)) is not None:
            out.append(bytes([int(match.group(1), 16)]))
        else:
            out.append(texts[v].encode() or None)
    return out


_VOCABULARIES: dict[tuple, tuple[object, object]] = {}
_AUTOMATA: dict[tuple, TokenAutomaton] = {}


def _vocabulary(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """outlines-core's Vocabulary of the model's tokens (EOS and special tokens left out)."""
    from outlines_core import Vocabulary

    key = (id(tokenizer), vocab_size, eos_ids)
    cached = _VOCABULARIES.get(key)
    if cached is not None and cached[0] is tokenizer:
        return cached[1]
    pieces: dict[bytes, list[int]] = {}
    for v, piece in enumerate(token_bytes(tokenizer, vocab_size)):
        if piece is not None and v not in eos_ids:
            pieces.setdefault(piece, []).append(v)
    pieces.setdefault(END.encode(), []).append(vocab_size)  # see compile_constraint
    vocabulary = Vocabulary(eos_ids[0], pieces)
    _VOCABULARIES[key] = (tokenizer, vocabulary)
    return vocabulary


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
    """One constraint's automaton on the host, states renumbered 0..n-1 (0 the start)."""

    num_states: int
    sources: np.ndarray  # [n_edges] int32
    tokens: np.ndarray  # [n_edges] int32
    targets: np.ndarray  # [n_edges] int32
    accepting: np.ndarray  # [num_states] bool
    # [num_states, FORCED_TOKENS] int32 (`forced_tokens`, which reads the rest; compile_constraint sets it)
    forced: np.ndarray | None = None


# A character no constraint should hold (a private-use code point), read by a token outside the
# vocabulary and appended to every regex: see `compile_constraint`.
END = "\U0010fffd"


def compile_constraint(regex: str, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> TokenAutomaton:
    """The token automaton of a regular expression over the model's vocabulary (cached).

    outlines-core 0.2.14's `Index` keeps, out of an accepting state, only the tokens that lead to
    accepting states (in `n(ab)?` after "n", token "a" is lost, "ab" kept; measured here), and
    matches alternatives leftmost-first (in `(a|ab)`, "ab" is lost). So the index is built for
    `(?:regex)END` with END read by one extra token (id vocab_size): the only accepting states are
    after END, every state of the regex itself keeps its edges, and the regex's accepting states
    are those with an END edge. The END edges and the states after them are dropped."""
    from outlines_core import Index

    eos_ids = tuple(sorted(set(eos_ids)))
    key = (regex, id(tokenizer), vocab_size, eos_ids)
    cached = _AUTOMATA.get(key)
    if cached is not None:
        return cached
    try:
        index = Index(f"(?:{regex}){END}", _vocabulary(tokenizer, vocab_size, eos_ids))
    except ValueError as error:
        raise ValueError(
            f"Sampling regex {regex[:200]!r} cannot be compiled over the vocabulary: {error}"
        ) from None
    transitions = index.get_transitions()
    finals = set(index.get_final_states())  # the states after the closing END, and only those
    initial = index.get_initial_state()
    live = [initial] + sorted(s for s in transitions if s != initial and s not in finals)
    number = {s: i for i, s in enumerate(live)}
    skip = set(eos_ids) | {vocab_size}
    sources, tokens, targets = [], [], []
    accepting = np.zeros(len(number), bool)
    for state, edges in transitions.items():
        if state not in number:
            continue
        # (END inside the regex, say in a JSON string, leads elsewhere: an END edge counts only
        # where it closes the match)
        accepting[number[state]] = edges.get(vocab_size) in finals
        for token, target in edges.items():
            if token not in skip and target in number:
                sources.append(number[state])
                tokens.append(token)
                targets.append(number[target])
    sources, tokens, targets = (np.asarray(x, np.int32) for x in (sources, tokens, targets))
    # Keep only edges into states from which the match can still end (a real token spelling part
    # of END's bytes would otherwise lead to a dead end).
    useful = accepting.copy()
    while True:
        grown = useful.copy()
        grown[sources[useful[targets]]] = True
        if (grown == useful).all():
            break
        useful = grown
    keep = useful[targets]
    sources, tokens, targets = sources[keep], tokens[keep], targets[keep]
    automaton = TokenAutomaton(
        num_states=len(number),
        sources=sources,
        tokens=tokens,
        targets=targets,
        accepting=accepting,
    )
    automaton = dataclasses.replace(
        automaton, forced=forced_tokens(automaton, tokenizer, vocab_size, eos_ids)
    )
    _AUTOMATA[key] = automaton
    return automaton


FORCED_TOKENS = 16  # tokens of forced text a state's row of the forced table holds
_FORCED_BYTES = 96  # the longest forced text read from one state


def forced_tokens(
    automaton: TokenAutomaton, tokenizer, vocab_size: int, eos_ids: Sequence[int], keep_last: bool = False
) -> np.ndarray:
    """[num_states, FORCED_TOKENS] int32: per state, the tokens of the text the constraint forces
    from there, as the tokenizer spells that text (-1 past them; GrammarDraft drafts them).

    The forced text is read byte by byte: a byte-level vocabulary holds a token for every single
    byte, and a token is allowed exactly where its bytes keep the match alive, so the bytes that
    may come next are those of the allowed single-byte tokens; while there is one of them and the
    state does not accept, that byte is forced. The text's tokens (the tokenizer's encoding of it,
    walked through the automaton: a token it has no edge for ends them) are one spelling among
    several the automaton allows, the one a model trained on that tokenizer most likely writes.
    Where free text follows the forced text, its last token is left out (unless `keep_last`): a
    BPE model writes the boundary merged with what follows (`":` after a key, ` France` after
    `Paris,`), so the tokenizer's spelling of the forced part alone ends in a token it would not
    write. A state allowing a single token and nothing else (EOS where it accepts and has no
    edges, or a vocabulary without single bytes) forces that token."""
    n = automaton.num_states
    forced = np.full((n, FORCED_TOKENS), -1, np.int32)
    pieces = token_bytes(tokenizer, vocab_size)
    keys, targets = sorted_edges(automaton, vocab_size)
    eos = int(min(eos_ids))

    def step(state: int, token: int) -> int:
        key = state * vocab_size + token
        at = int(np.searchsorted(keys, key))
        return int(targets[at]) if at < len(keys) and keys[at] == key else -1

    single = np.array([p is not None and len(p) == 1 for p in pieces] + [False], bool)
    is_single = single[automaton.tokens]
    next_byte: list[dict[int, int]] = [{} for _ in range(n)]  # state -> {byte: state after it}
    for source, token, target in zip(
        automaton.sources[is_single], automaton.tokens[is_single], automaton.targets[is_single], strict=True
    ):
        next_byte[source][pieces[token][0]] = int(target)
    edges_from = np.bincount(automaton.sources, minlength=n)
    only_token = {}  # state -> its one allowed token, where it has exactly one edge
    for source, token in zip(automaton.sources, automaton.tokens, strict=True):
        if edges_from[source] == 1:
            only_token[int(source)] = int(token)

    def ends_forced(state: int) -> bool:  # only EOS is allowed here
        return bool(automaton.accepting[state]) and edges_from[state] == 0

    for state in range(n):
        text, at = bytearray(), state
        while len(text) < _FORCED_BYTES and not automaton.accepting[at] and len(next_byte[at]) == 1:
            ((byte, at),) = next_byte[at].items()
            text.append(byte)
        tokens: list[int] = []
        if text:
            spelled = bytes(text).decode("utf-8", errors="ignore")  # (a partial character is left out)
            at = state
            spelled_tokens = tokenizer.encode(spelled, add_special_tokens=False)
            for token in spelled_tokens:
                after = step(at, int(token))
                if after < 0:
                    break
                tokens.append(int(token))
                at = after
            if len(tokens) == len(spelled_tokens) and ends_forced(at):
                tokens.append(eos)
            elif not keep_last:
                tokens = tokens[:-1]
        elif ends_forced(state):
            tokens = [eos]
        elif state in only_token and not automaton.accepting[state]:
            tokens = [only_token[state]]
        tokens = tokens[:FORCED_TOKENS]
        forced[state, : len(tokens)] = tokens
    return forced


def _budget(needed: int, smallest: int, largest: int, what: str) -> int:
    if needed > largest:
        raise ValueError(
            f"Sampling constraint: the call's automata need {needed} {what}, more than the budget of "
            f"{largest}; use a smaller regex / schema (fewer fields, bounded repeats) or fewer "
            "distinct constraints per call"
        )
    return max(smallest, 1 << max(needed - 1, 0).bit_length())


@flax.struct.dataclass
class Grammar:
    """The device side: one call's automata in one state space, and each row's start state."""

    allowed: jax.Array  # [S, ceil(V/32)] uint32: bit v of state s, token v is allowed there
    edge_keys: jax.Array  # [E] int32 sorted: state * V + token; padding past the edges is int32 max
    edge_next: jax.Array  # [E] int32: the state after the edge's token
    start: jax.Array  # [B] int32: the row's start state, -1 for a row without a constraint
    # [S, FORCED_TOKENS] int32: per state, the tokens of the text the constraint forces from it
    # (`forced_tokens`), -1 past them; what GrammarDraft drafts
    forced: jax.Array

    def mask(self, states: jax.Array, vocab_size: int) -> jax.Array:
        """states [B, ...] -> allowed [B, ..., V] bool (all True where the state is -1)."""
        bits = self.allowed[jnp.maximum(states, 0)]  # [B, ..., W]
        shifts = jnp.arange(32, dtype=jnp.uint32)
        unpacked = (bits[..., None] >> shifts) & jnp.uint32(1)  # [B, ..., W, 32]
        allowed = unpacked.reshape(bits.shape[:-1] + (-1,))[..., :vocab_size] != 0
        return allowed | (states < 0)[..., None]

    def allows(self, states: jax.Array, tokens: jax.Array) -> jax.Array:
        """states [B, ...] and token ids [W] (a draft vocabulary's) -> [B, ..., W] bool: whether
        each state allows each token (all True where the state is -1); reads only W bits a state."""
        words = self.allowed[jnp.maximum(states, 0)][..., tokens // 32]  # [B, ..., W]
        bits = (words >> (tokens % 32).astype(jnp.uint32)) & jnp.uint32(1)
        return (bits != 0) | (states < 0)[..., None]

    def step(self, states: jax.Array, tokens: jax.Array, vocab_size: int) -> jax.Array:
        """The states after one token each (states, tokens of one shape). A token without an edge
        (one the state forbids, EOS, or -1 padding) leaves the state as it is: its row stops there
        or the position is never used."""
        hit, after = self.edge(states, tokens, vocab_size)
        return jnp.where(hit, after, states)

    def edge(self, states: jax.Array, tokens: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
        """(whether each state has an edge for its token, the state it leads to where it has)."""
        key = states * vocab_size + tokens
        at = jnp.minimum(jnp.searchsorted(self.edge_keys, key), self.edge_keys.shape[0] - 1)
        hit = (self.edge_keys[at] == key) & (states >= 0) & (tokens >= 0)
        return hit, self.edge_next[at]

    def advance(self, states: jax.Array, tokens: jax.Array, vocab_size: int) -> jax.Array:
        """Read tokens [B, T] from states [B]: the states after each token [B, T]."""
        after = []
        for t in range(tokens.shape[1]):  # T = k + 1, small and static
            states = self.step(states, tokens[:, t], vocab_size)
            after.append(states)
        return jnp.stack(after, axis=1)

    def node_states(self, states: jax.Array, node_tokens: jax.Array, parents, vocab_size: int) -> jax.Array:
        """[B, N+1] the state at each node of a token tree: the root's is states [B] (at the last
        committed token), every other node's the state after its parent's, read by its token
        (node_tokens [B, N], node i's at i - 1). parents [N+1] (static, numpy): each node's, the
        root's -1; nodes come after their parents."""
        at = [states]
        for i in range(1, len(parents)):  # N small and static
            at.append(self.step(at[int(parents[i])], node_tokens[:, i - 1], vocab_size))
        return jnp.stack(at, axis=1)

    def path_states(self, states: jax.Array, drafts: jax.Array, vocab_size: int) -> jax.Array:
        """[B, K+1] the state at each scored position of a chain: states [B] at the last committed
        token, then after each of the drafts [B, K]."""
        if drafts.shape[1] == 0:
            return states[:, None]
        return jnp.concatenate([states[:, None], self.advance(states, drafts, vocab_size)], axis=1)


def mask_logits(grammar: Grammar | None, logits: jax.Array, states: jax.Array | None) -> jax.Array:
    """logits [B, ..., V] with the tokens forbidden at states [B, ...] set to -inf."""
    if grammar is None:
        return logits
    return jnp.where(grammar.mask(states, logits.shape[-1]), logits, -jnp.inf)


def mask_draft_logits(grammar: Grammar | None, logits: jax.Array, states: jax.Array | None, vocab=None):
    """A drafter's logits [B, ..., W] masked as the target's are at states [B, ...] (the states
    along its own drafts), so that each draft is drawn from the tokens the automaton allows and its
    q is its law over them: what a draft the target would reject costs is then spent on one it may
    accept. W is the vocabulary (vocab None) or a draft vocabulary, vocab [W] its token ids. Where a
    state allows none of the W tokens (a draft vocabulary without them) the logits stay as they
    are: that draft is rejected whatever it is, and q is still what it was drawn from."""
    if grammar is None or states is None:
        return logits
    allowed = grammar.mask(states, logits.shape[-1]) if vocab is None else grammar.allows(states, vocab)
    allowed |= ~jnp.any(allowed, axis=-1, keepdims=True)
    return jnp.where(allowed, logits, -jnp.inf)


def packed_allowed(automaton: TokenAutomaton, vocab_size: int, eos_ids: Sequence[int]) -> np.ndarray:
    """[num_states, ceil(V/32)] uint32: bit v of row s set where the automaton allows token v in
    its state s (EOS exactly in the accepting states)."""
    words = -(-vocab_size // 32)
    allowed = np.zeros((automaton.num_states, words * 32), bool)
    allowed[automaton.sources, automaton.tokens] = True
    eos = list(eos_ids)
    allowed[np.ix_(np.flatnonzero(automaton.accepting), eos)] = True
    # A state with nothing allowed (a dead end) may end the row, so that no row is left without a
    # token: the automata outlines-core builds have none, this is a guard.
    allowed[np.ix_(~allowed.any(axis=1), eos)] = True
    packed = np.packbits(allowed.reshape(-1, words, 32), axis=-1, bitorder="little")  # [n, W, 4] uint8
    return packed.view(np.uint32).reshape(automaton.num_states, words)


def sorted_edges(automaton: TokenAutomaton, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The automaton's transitions as (keys state * V + token, sorted; the states after them),
    states numbered from 0: an automaton placed at offset o has keys + o * V and states + o."""
    keys = automaton.sources.astype(np.int64) * vocab_size + automaton.tokens
    order = np.argsort(keys, kind="stable")
    return keys[order], automaton.targets[order]


def device_grammar(
    allowed: np.ndarray, keys: np.ndarray, targets: np.ndarray, edges: int, start, forced: np.ndarray
) -> Grammar:
    """A Grammar from host tables: allowed [S, W] uint32, sorted edge keys and their targets,
    padded to `edges` transitions (past them, int32's largest key, never a state * V + token),
    and the forced tokens [S, FORCED_TOKENS]."""
    edge_keys = np.full(edges, np.iinfo(np.int32).max, np.int32)
    edge_next = np.zeros(edges, np.int32)
    edge_keys[: len(keys)], edge_next[: len(keys)] = keys, targets
    return Grammar(
        allowed=jnp.asarray(allowed),
        edge_keys=jnp.asarray(edge_keys),
        edge_next=jnp.asarray(edge_next),
        start=jnp.asarray(start, jnp.int32),
        forced=jnp.asarray(forced),
    )


def build_grammar(
    tokenizer, vocab_size: int, eos_ids: Sequence[int], regexes: Sequence[str | None]
) -> Grammar | None:
    """The device tables for a batch whose row b must match regexes[b] (None: free); None when no
    row has a constraint. Equal regexes share one automaton."""
    if all(r is None for r in regexes):
        return None
    check_constraint_model(tokenizer, eos_ids)
    distinct = sorted({r for r in regexes if r is not None})
    automata = [compile_constraint(r, tokenizer, vocab_size, eos_ids) for r in distinct]
    offsets = np.cumsum([0] + [a.num_states for a in automata])
    S = _budget(int(offsets[-1]), MIN_STATES, MAX_STATES, "states")
    E = _budget(sum(len(a.tokens) for a in automata), MIN_EDGES, MAX_EDGES, "transitions")
    check_edge_keys(S, vocab_size)
    allowed = np.zeros((S, -(-vocab_size // 32)), np.uint32)
    forced = np.full((S, FORCED_TOKENS), -1, np.int32)
    keys, targets = [], []
    for offset, a in zip(offsets[:-1], automata, strict=True):
        allowed[offset : offset + a.num_states] = packed_allowed(a, vocab_size, eos_ids)
        forced[offset : offset + a.num_states] = a.forced
        local_keys, local_targets = sorted_edges(a, vocab_size)
        keys.append(local_keys + int(offset) * vocab_size)  # (automata in order of their offsets:
        targets.append(local_targets + offset)  # the keys stay sorted)
    start = [-1 if r is None else int(offsets[distinct.index(r)]) for r in regexes]
    return device_grammar(allowed, np.concatenate(keys), np.concatenate(targets), E, start, forced)


def forget_compiled() -> None:
    """Empty the caches of schema regexes and token automata (for timing a build from scratch)."""
    _regex_of_schema.cache_clear()
    _AUTOMATA.clear()


def check_constraint_model(tokenizer, eos_ids: Sequence[int]) -> None:
    if tokenizer is None:
        raise ValueError("Sampling regex / json_schema / choice needs a tokenizer; the model has none")
    if not eos_ids:
        raise ValueError("Sampling regex / json_schema / choice needs an EOS token; the model has none")


def check_edge_keys(states: int, vocab_size: int) -> None:
    if states * vocab_size >= 2**31:
        raise ValueError(
            f"Sampling constraint: {states} states x {vocab_size} tokens overflow the int32 edge keys"
        )
