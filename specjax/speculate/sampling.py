"""Sampling options and the one path from logits to a token.

Every token the library emits or drafts goes through `adjust_logits` (logit bias, then the
repetition, frequency and presence penalties, as vLLM orders them), then either the argmax
(temperature 0) or `warp_logits` (temperature, top-k, top-p, min-p, in HF transformers' order)
and a draw. Target and draft call the same functions, so a draft's `q` and the target's `p` are
shaped alike, which lossless verification requires.

Options are per row: `SamplingParams` holds one value per row ([B] arrays), so greedy and
sampled rows, or rows with different penalties, share one compiled program. `WarpSpec` is the
static part: which code paths any row needs. A row that does not use a path gets its neutral
value (top_k 0, top_p 1, min_p 0, penalties 1 / 0 / 0, bias 0), which leaves its logits as they
are.

Top-k and top-p need the largest logits in order. Sorting the whole vocabulary at every scored
position cost ~330 ms per verify pass of SmolLM2 on a CPU ([4, 5, 49152] logits), `lax.top_k` of
64 candidates ~5 ms (measured here), so the filters look at the `WarpSpec.candidates` largest
logits only, and sort everything only in a step where some row's nucleus does not fit in them
(a batch-wide `lax.cond`). The kept tokens, hence the warped law, are those of the full sort,
which stays as the reference (`WarpSpec.candidates == 0`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_int, is_number
from specjax.speculate.grammar import Grammar, check_constraint, constraint_regex

MAX_SEED = 2**32  # seeds become uint32 arrays
# Candidates the top-k / top-p filters look at (`WarpSpec.candidates`): the batch's largest top_k
# rounded up to a power of two from MIN_CANDIDATES (so that nearby values share a program), at
# least TOP_P_CANDIDATES when a row has top-p without top-k; a top_k above MAX_CANDIDATES sorts.
MIN_CANDIDATES = 64
TOP_P_CANDIDATES = 256
MAX_CANDIDATES = 4096


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one row picks its tokens. temperature 0 is greedy: the argmax of the logits after
    logit bias and penalties; the filters (top-k, top-p, min-p) then do nothing.

    temperature, top_k (0 = off), top_p (1 = off), min_p (0 = off): as in HF transformers, applied
      in that order to the adjusted logits.
    repetition_penalty (1 = off, > 0): HF/CTRL style; a token seen in the prompt or the output so
      far has its logit divided by it when positive and multiplied by it when negative.
    frequency_penalty, presence_penalty (0 = off, in [-2, 2]): OpenAI style, over the output only;
      subtract `frequency_penalty * count + presence_penalty * (count > 0)` from a token's logit.
    logit_bias: {token id: bias} added to the logits before anything else.
    stop: strings that end the row at their first occurrence in the output text; the returned text
      stops before it, the returned tokens end with the token that completes it.
    stop_token_ids: token ids that end the row like EOS (the token is returned).
    seed: this row's own random stream; rows with a seed give the same output whatever `key`.
    regex, json_schema (a dict or its JSON text), choice (a list of strings): at most one; the row's
      output (before EOS) matches it in full, drawn from the target's law restricted to the
      tokens the constraint allows at each step (specjax/speculate/grammar.py).
    compact_json: with json_schema, JSON without whitespace between its tokens (vLLM's
      disable_any_whitespace; default False: a space may follow each colon and comma): the
      quoted keys, colons and commas are then forced text, which GrammarDraft drafts whole.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    stop: str | Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    regex: str | None = None
    json_schema: Mapping | str | None = None
    choice: Sequence[str] | None = None
    compact_json: bool = False

    def __post_init__(self):
        def fail(name, allowed):
            raise ValueError(f"Sampling {name} must be {allowed}, got {getattr(self, name)!r}")

        t = self.temperature
        if not is_number(t) or not math.isfinite(t) or t < 0:
            fail("temperature", "a finite number >= 0")
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "an integer >= 0 (0 disables it)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "in (0, 1] (1 disables it)")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "in [0, 1] (0 disables it)")
        r = self.repetition_penalty
        if not is_number(r) or not math.isfinite(r) or r <= 0:
            fail("repetition_penalty", "a finite number > 0 (1 disables it)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                fail(name, "a number in [-2, 2] (0 disables it)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                fail("logit_bias", "a dict {token id: bias} or None")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    raise ValueError(f"Sampling logit_bias keys must be token ids >= 0, got {token!r}")
                if not is_number(bias) or not math.isfinite(bias):
                    raise ValueError(f"Sampling logit_bias[{token}] must be a finite number, got {bias!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            fail("stop", "a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if (
            not isinstance(ids, Sequence)
            or isinstance(ids, str)
            or not all(is_int(i) and i >= 0 for i in ids)
        ):
            fail("stop_token_ids", "a list of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            fail("seed", f"None or an integer in [0, 2**32), not {type(self.seed).__name__}")
        check_constraint(self.regex, self.json_schema, self.choice, self.compact_json)
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def constraint(self) -> str | None:
        """The regular expression the row's output must match in full (regex, json_schema or
        choice; specjax/speculate/grammar.py), None when it has none."""
        return constraint_regex(self.regex, self.json_schema, self.choice, self.compact_json)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


@dataclasses.dataclass(frozen=True)
class WarpSpec:
    """The static part of sampling: which code paths the rows of one call need."""

    greedy: bool = True  # every row is greedy: no random draws, no warping at all
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    penalties: bool = False  # some row has a repetition, frequency or presence penalty
    logit_bias: bool = False
    # How many of the largest logits top-k and top-p look at (>= every row's top_k); 0 sorts the
    # whole vocabulary (the reference), as does a number >= the vocabulary size.
    candidates: int = 0

    @classmethod
    def of(cls, sampling: Sampling | Sequence[Sampling]) -> WarpSpec:
        rows = [sampling] if isinstance(sampling, Sampling) else list(sampling)
        sampled = [s for s in rows if not s.greedy]
        return cls(
            greedy=not sampled,
            top_k=any(s.top_k > 0 for s in sampled),
            top_p=any(s.top_p < 1 for s in sampled),
            min_p=any(s.min_p > 0 for s in sampled),
            penalties=any(s.penalized for s in rows),
            logit_bias=any(s.logit_bias for s in rows),
            candidates=_candidates(sampled),
        )


def _candidates(sampled: Sequence[Sampling]) -> int:
    """`WarpSpec.candidates` for these sampled rows (0 when no row filters by rank)."""
    top_k = max((s.top_k for s in sampled), default=0)
    nucleus_only = any(s.top_p < 1 and s.top_k == 0 for s in sampled)
    if top_k == 0 and not nucleus_only:
        return 0
    if top_k > MAX_CANDIDATES:
        return 0
    needed = max(top_k, MIN_CANDIDATES, TOP_P_CANDIDATES if nucleus_only else 0)
    return 1 << (needed - 1).bit_length()


@flax.struct.dataclass
class SamplingParams:
    """The dynamic part, one value per row: changing a value never recompiles."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    repetition_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    logit_bias: jax.Array | None  # [B, V] float32, None when no row has a bias
    grammar: Grammar | None = None  # the rows' constraints' automata, None when no row has one

    @classmethod
    def of(cls, sampling: Sampling | Sequence[Sampling], batch_size: int, vocab_size: int = 0):
        """Per-row arrays from one Sampling (every row alike) or one per row."""
        rows = [sampling] * batch_size if isinstance(sampling, Sampling) else list(sampling)

        def column(name, dtype):
            return jnp.asarray(np.array([getattr(s, name) for s in rows], dtype))

        bias = None
        if any(s.logit_bias for s in rows):
            bias = np.zeros((len(rows), vocab_size), np.float32)
            for b, s in enumerate(rows):
                for token, value in (s.logit_bias or {}).items():
                    bias[b, token] += value
            bias = jnp.asarray(bias)
        return cls(
            temperature=column("temperature", np.float32),
            top_k=column("top_k", np.int32),
            top_p=column("top_p", np.float32),
            min_p=column("min_p", np.float32),
            repetition_penalty=column("repetition_penalty", np.float32),
            frequency_penalty=column("frequency_penalty", np.float32),
            presence_penalty=column("presence_penalty", np.float32),
            logit_bias=bias,
        )


def _per_row(values: jax.Array, like: jax.Array) -> jax.Array:
    """Reshape [B] values to broadcast against `like` [B, ..., V]."""
    return values.reshape(values.shape + (1,) * (like.ndim - 1))


def adjust_logits(
    logits: jax.Array, params: SamplingParams, spec: WarpSpec, counts=None, in_prompt=None
) -> jax.Array:
    """Logit bias and penalties, for greedy and sampled rows alike: logits [B, ..., V] float32.

    counts [B, ..., V] int32 (broadcastable to logits) holds how often each token was generated
    before the position being scored; in_prompt [B, V] bool which tokens the prompt holds. Both
    are needed only when spec.penalties.
    """
    logits = logits.astype(jnp.float32)
    if spec.logit_bias:
        bias = params.logit_bias.reshape(logits.shape[:1] + (1,) * (logits.ndim - 2) + logits.shape[-1:])
        logits = logits + bias
    if spec.penalties:
        in_prompt = in_prompt.reshape(logits.shape[:1] + (1,) * (logits.ndim - 2) + logits.shape[-1:])
        seen = in_prompt | (counts > 0)
        r = _per_row(params.repetition_penalty, logits)
        logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
        counts = counts.astype(jnp.float32)
        logits = logits - _per_row(params.frequency_penalty, logits) * counts
        logits = logits - _per_row(params.presence_penalty, logits) * (counts > 0)
    return logits


def warp_logits(logits: jax.Array, params: SamplingParams, spec: WarpSpec) -> jax.Array:
    """Log-probabilities [B, ..., V] of the warped distribution; filtered tokens get -inf.

    For sampled rows; a greedy row (temperature 0) is warped at temperature 1 here and its result
    is not used (its token is the argmax).
    """
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    logits = logits.astype(jnp.float32) / _per_row(temperature, logits)
    if spec.top_k or spec.top_p:
        # Tokens at or above the threshold stay (ties with the last kept one included, as in HF).
        if 0 < spec.candidates < logits.shape[-1]:
            threshold, fits = _capped_threshold(logits, params, spec, spec.candidates)
            # Exact either way: sort only when some row keeps more tokens than the candidates.
            threshold = jax.lax.cond(
                jnp.all(fits), lambda x: threshold, lambda x: _sorted_threshold(x, params, spec), logits
            )
        else:
            threshold = _sorted_threshold(logits, params, spec)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    if spec.min_p:
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        top = jnp.max(log_probs, axis=-1, keepdims=True)
        min_p = _per_row(params.min_p, logits)
        logits = jnp.where(log_probs >= top + jnp.log(min_p), logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def _sorted_threshold(logits: jax.Array, params: SamplingParams, spec: WarpSpec) -> jax.Array:
    """[B, ..., 1] the smallest logit top-k and top-p keep, from the whole vocabulary sorted (the
    reference)."""
    sorted_desc = -jnp.sort(-logits, axis=-1)
    rank = jnp.arange(logits.shape[-1])
    keep_sorted = jnp.ones(sorted_desc.shape, bool)
    if spec.top_k:
        k = _per_row(params.top_k, logits)
        keep_sorted = (k == 0) | (rank < k)
    if spec.top_p:
        probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_desc, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        top_p = _per_row(params.top_p, logits)
        # Keep the smallest prefix holding top_p of the mass; the top token always stays, and
        # top_p = 1 keeps everything (the cumulative sum may round to 1 before the tail).
        keep_sorted &= (mass_before < top_p) | (rank == 0) | (top_p >= 1)
    return jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)


def _capped_threshold(logits: jax.Array, params: SamplingParams, spec: WarpSpec, candidates: int):
    """`_sorted_threshold` from the `candidates` largest logits only: (threshold [B, ..., 1],
    fits [B, ..., 1]). Where `fits` is False the row keeps more tokens than that (a nucleus wider
    than the candidates, or top_k > candidates) and the threshold is wrong: sort instead.

    Top-p's probabilities are normalized over the top k when top-k applies (all inside the
    candidates), else over the whole vocabulary: a logsumexp, no sort."""
    top, _ = jax.lax.top_k(logits, candidates)  # [B, ..., C] descending
    rank = jnp.arange(candidates)
    keep = jnp.ones(top.shape, bool)
    by_k = jnp.zeros(logits.shape[:-1] + (1,), bool)  # top-k applies to the row
    fits = _per_row(params.temperature == 0, logits)  # a greedy row's warp is never used
    fits = jnp.broadcast_to(fits, by_k.shape)
    if spec.top_k:
        k = _per_row(params.top_k, logits)
        by_k = jnp.broadcast_to(k > 0, by_k.shape)
        keep = ~by_k | (rank < k)
        fits |= by_k & (k <= candidates)
    if spec.top_p:
        top_p = _per_row(params.top_p, logits)
        filtered = jnp.where(keep, top, -jnp.inf)
        whole = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        log_norm = jnp.where(by_k, jax.nn.logsumexp(filtered, axis=-1, keepdims=True), whole)
        probs = jnp.exp(filtered - log_norm)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep &= (mass_before < top_p) | (rank == 0) | (top_p >= 1)
        # Without top-k the nucleus fits when the token after the candidates would be dropped.
        fits |= ~by_k & ((top_p >= 1) | (jnp.sum(probs, axis=-1, keepdims=True) >= top_p))
        unfiltered = ~by_k & (top_p >= 1)
    else:
        unfiltered = ~by_k
        fits |= unfiltered
    threshold = jnp.min(jnp.where(keep, top, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(unfiltered, -jnp.inf, threshold), fits


def greedy_argmax(logits: jax.Array) -> jax.Array:
    """int32 argmax over the last axis, equal to `jnp.argmax` (the first of equal maxima; the first
    NaN where there is one), as a max and a min reduction: XLA:CPU ran jnp.argmax's paired
    value-and-index reduction over SmolLM2's 49,152 logits in ~230 us, this in ~50 us (measured
    here), once per decoding step."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    hits = (logits == top) | jnp.isnan(logits)
    return jnp.min(jnp.where(hits, index, logits.shape[-1]), axis=-1)


def is_greedy(params: SamplingParams, like: jax.Array) -> jax.Array:
    """[B] temperatures -> bool broadcastable against `like` [B, ...]: which rows take the argmax."""
    return _per_row(params.temperature == 0, like)


def choose_tokens(
    keys: jax.Array, logits: jax.Array, params: SamplingParams, spec: WarpSpec
) -> tuple[jax.Array, jax.Array | None]:
    """Pick one token per position from adjusted logits [B, ..., V] with one key per row ([B]).

    Returns (tokens int32 [B, ...], probs [B, ..., V] float32 or None when every row is greedy):
    probs is the exact distribution a sampled row's token was drawn from.
    """
    greedy_tokens = greedy_argmax(logits)
    if spec.greedy:
        return greedy_tokens, None
    log_probs = warp_logits(logits, params, spec)
    sampled = jax.vmap(lambda key, row: jax.random.categorical(key, row, axis=-1))(keys, log_probs)
    tokens = jnp.where(is_greedy(params, greedy_tokens), greedy_tokens, sampled.astype(jnp.int32))
    return tokens, jnp.exp(log_probs)
