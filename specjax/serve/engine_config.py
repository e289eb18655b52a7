"""What an `Engine` is told and what it tells: its frozen config, the requests it takes, the updates
it reports and where its time went."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from specjax.checks import check_int, is_int
from specjax.planner import MIN_BUCKET
from specjax.speculate.sampling import TOP_P_CANDIDATES, Sampling, WarpSpec

# Every sampling option on, so that any request runs in the same program; greedy rows are
# unaffected (neutral values leave their logits bit for bit as they are).
ALL_OPTIONS = WarpSpec(
    greedy=False,
    top_k=True,
    top_p=True,
    min_p=True,
    penalties=True,
    logit_bias=True,
    candidates=TOP_P_CANDIDATES,
)
MAX_STOP_TOKEN_IDS = 16  # EOS and a request's stop token ids, per slot
# Steps per chunk at most while a slot is free (EngineConfig.admission_steps): a chunk boundary
# costs 2-3 ms of host work on a 2-core CPU, and 4-step chunks stepped within 1% of 16-step ones
# there (docs/serving.md, "Latency and chunks").
ADMISSION_STEPS = 4
# Chunks in a row whose running requests fit a narrower width before the state narrows
# (EngineConfig.narrow_after): the requests that finish together are usually followed by their
# clients' next ones within milliseconds, and narrowing then growing back cost a served burst of 8
# clients here 0.7-2.4 s of moves and fresh memory, against a few steps at the wider width
# (docs/serving.md).
NARROW_AFTER = 2
# Tokens per prefill chunk of a long prompt (EngineConfig.prefill_chunk): see docs/serving.md,
# "Long prompts in chunks", for the latencies measured at 64, 128 and 256.
PREFILL_CHUNK = 128
# The most logprobs a served request may ask for, unless `serve(max_logprobs=)` says otherwise
# (vLLM's --max-logprobs default)
DEFAULT_MAX_LOGPROBS = 20
# The constraint automata's state budget of a served engine (`serve(constraint_states=)`): 4096
# states' bitmasks are 4096 x V / 8 bytes (25 MB for the built-in model's 49,152 tokens), beside
# the transitions' 16 MB; a flat JSON schema needs tens of states, a nested one hundreds.
DEFAULT_CONSTRAINT_STATES = 4096


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an Engine batches, chunks and compiles. Every field is checked when the config is made
    (against the model, when the engine is made); `EngineConfig(max_batch=16, chunk_steps=8)`."""

    max_batch: int = 8
    """Slots: the most requests decoded at once (the running state's widest width)."""

    max_model_len: int | None = None
    """A request's prompt plus new tokens, at most; each slot's cache holds that many tokens and a
    verify pass. None: the model's context."""

    chunk_steps: int = 16
    """Loop steps per `Engine.step` call at most: fewer report tokens sooner, more cost fewer host
    round trips."""

    admission_steps: int | None = None
    """Loop steps per `Engine.step` call at most while a slot is free (None: 4, or chunk_steps if
    fewer): a request that arrives during a chunk waits for its end before its prefill, so a free
    slot is offered to arrivals this often. (A chunk also ends as soon as a row finishes, so that
    its last tokens are reported and its slot refilled at once.)"""

    narrow_after: int = NARROW_AFTER
    """Chunks in a row the running requests must fit a narrower width before the state narrows to
    it (0: at once). Until then the chunks step at the wider width, so that requests arriving just
    after others finished find the slots where they were."""

    prefill_chunk: int | None = PREFILL_CHUNK
    """A prompt longer than this many tokens is prefilled in chunks of this size (a multiple of
    16), one chunk per `step` while other requests run, so that their rows wait at most one
    chunk's pass for it (every chunk runs in the same program, whatever the prompt's length);
    when nothing else runs, its chunks run back to back. Shorter prompts are prefilled in one pass
    of their bucket (admitted beside a long one in chunks). None: every prompt in one pass of its
    bucket, while the running rows wait."""

    warp: WarpSpec | None = None
    """The sampling code paths compiled in (None: every option; a `WarpSpec.of(...)` of the
    requests to come makes a leaner program, and requests needing more are refused)."""

    kernels: str = "auto"
    """The kernels, as `generate`'s: "auto", "xla", "pallas:tpu" or "pallas:cuda"."""

    matmul_precision: str | None = None
    """The products' precision, as `generate`'s (None: "highest" for float32 models)."""

    cache_dtype: Any = None
    """The target's KV cache dtype, as `generate`'s (None: the model's)."""

    scan_layers: bool | None = None
    """Layers as loops over their stacked weights, as `generate`'s (None: unrolled)."""

    key: jax.Array | None = None
    """The PRNG key that sampled requests without a seed or a key of their own draw from (request
    i uses it folded with i). None: jax.random.key(0)."""

    max_stop_states: int = 64
    """The size of the stop-string automaton the running requests share: a request whose strings
    do not fit beside theirs waits; one that never fits is refused."""

    logprobs: int | None = None
    """The most logprobs a request may ask for (`Request.logprobs` and `prompt_logprobs`): the
    programs can compute each committed token's logprob and those of the N most likely tokens,
    as `generate`'s logprobs, for the requests that ask. None: off, the programs compute none
    and a request asking is refused. (Chunks in which no running request asks run programs
    without them: engine_loops.py.)"""

    constraint_states: int | None = None
    """The constraint automata's state budget (`Sampling(regex=, json_schema=, choice=)`): the
    programs carry tables of that many states (a bitmask of the allowed tokens each, V / 8 bytes)
    and `constraint_edges` transitions (8 bytes each), shared by the running requests' automata.
    A request whose automaton does not fit beside theirs waits; one that never fits is refused.
    None: off, the programs carry no tables and a constrained request is refused.
    (engine_constraints.py)"""

    constraint_edges: int = 1 << 21
    """The transitions the constraint tables hold (with `constraint_states`): a JSON string's
    state allows nearly the whole vocabulary, so each costs about V transitions."""

    page_size: int | None = None
    """The target's KV cache in pages of this many slots (a power of two, at least 16): one pool
    of pages that every slot's row reads through its page table, a row holding pages for what it
    has committed and its next chunk may write (engine_pages.py), so that how many requests fit is
    what their lengths need. When the pool runs out, the newest running request is preempted: its
    pages freed, and it starts again from its prompt once pages are free (what it had reported is
    not sent twice). None: a dense row of max_model_len slots per slot."""

    num_pages: int | None = None
    """With page_size: the pool's pages (beside one null page nobody holds). None: from
    kv_cache_memory, else enough for every slot to hold max_model_len tokens."""

    kv_cache_memory: int | float | None = None
    """With page_size, instead of num_pages: the pool's bytes (an integer), or a fraction in (0, 1]
    of the device's free memory when the engine starts (vLLM's gpu_memory_utilization, of what is
    free rather than of the whole device)."""

    prefix_caching: bool = True
    """With page_size: full pages are keyed by their content and shared by later requests whose
    prompts begin with the same tokens (vLLM's automatic prefix caching): a hit prefills only
    the rest, and its proposer drafts as on a miss (the features it reads are kept with the pages;
    a draft model's own cache is made again from the prompt). False: every prompt prefilled."""

    def __post_init__(self):
        check_int("max_batch", self.max_batch, 1)
        self._check_pages()
        if self.constraint_states is not None:
            check_int("constraint_states", self.constraint_states, 1)
        check_int("constraint_edges", self.constraint_edges, 1)
        check_int("chunk_steps", self.chunk_steps, 1)
        admission = (
            min(ADMISSION_STEPS, self.chunk_steps) if self.admission_steps is None else self.admission_steps
        )
        check_int("admission_steps", admission, 1)
        if admission > self.chunk_steps:
            raise ValueError(
                f"admission_steps={admission} exceeds chunk_steps={self.chunk_steps}: a chunk runs at "
                "most chunk_steps steps, and at most admission_steps while a slot is free"
            )
        object.__setattr__(self, "admission_steps", admission)
        check_int("max_stop_states", self.max_stop_states, 1)
        check_int("narrow_after", self.narrow_after, 0)
        if self.prefill_chunk is not None:
            check_int("prefill_chunk", self.prefill_chunk, MIN_BUCKET)
            if self.prefill_chunk % MIN_BUCKET:
                raise ValueError(
                    f"prefill_chunk={self.prefill_chunk}: chunks are a multiple of {MIN_BUCKET} tokens "
                    "(or None: every prompt in one pass)"
                )
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)
        if self.warp is not None and not isinstance(self.warp, WarpSpec):
            raise ValueError(f"warp must be None (every option) or a WarpSpec, got {self.warp!r}")

    def _check_pages(self) -> None:
        if self.page_size is None:
            for name in ("num_pages", "kv_cache_memory"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sizes a paged cache: give a page_size too"
                    )
            return
        if not is_int(self.page_size) or self.page_size < MIN_BUCKET or self.page_size & (self.page_size - 1):
            raise ValueError(
                f"page_size must be None or a power of two of at least 16 slots, got {self.page_size!r}"
            )
        if self.num_pages is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_pages or kv_cache_memory, not both")
        if self.num_pages is not None:
            check_int("num_pages", self.num_pages, 1)
        memory = self.kv_cache_memory
        if memory is not None and not (
            (is_int(memory) and memory >= 1) or (isinstance(memory, float) and 0 < memory <= 1)
        ):
            raise ValueError(
                f"kv_cache_memory must be bytes (an integer >= 1) or a fraction of the free memory "
                f"(a float in (0, 1]), got {memory!r}"
            )

    @property
    def widths(self) -> list[int]:
        """The running state's widths: 1, 2, 4, ... up to max_batch, and max_batch."""
        return sorted(
            {min(1 << i, self.max_batch) for i in range(self.max_batch.bit_length())} | {self.max_batch}
        )

    @property
    def sampling_paths(self) -> WarpSpec:
        """The sampling code paths the programs compile in."""
        return ALL_OPTIONS if self.warp is None else self.warp


def admission_bucket(length: int) -> int:
    """The padded prompt length of an admission's prefill: a multiple of 16 up to 64 tokens, then
    four buckets per doubling (80, 96, 112, 128, 160, 192, 224, 256, 320, ...): at most 15 tokens
    of padding up to 64 tokens, under a quarter of the prompt past them.

    Finer than `generate`'s buckets (planner.prompt_bucket: 64 then 128 tokens for a 65-token
    prompt) because an engine compiles only a prefill per bucket, where `generate` compiles its
    whole loop, and because prefills are a quarter of a busy engine's time on a small CPU
    (docs/serving.md): chat prompts of 40 to 127 tokens spent 30% of their prefill on padding with
    the coarse ones.
    """
    step = max(MIN_BUCKET, 1 << max(0, (length - 1).bit_length() - 3))
    return max(MIN_BUCKET, -(-length // step) * step)


@dataclasses.dataclass
class Request:
    """One generation: a prompt's token ids and its options (as `generate` takes them)."""

    prompt: Sequence[int]
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    max_new_tokens: int = 128
    # False: the request's drafts are never verified (it decodes one token per step, plainly)
    # while the batch around it speculates; its output is the same either way.
    speculate: bool = True
    # The PRNG key a sampled request without a seed draws from (as `generate`'s key for a batch
    # of this one request); None: the engine's key folded with the request's id.
    key: jax.Array | None = None
    # True: EOS does not end the request (it runs to max_new_tokens, a stop token id or a stop
    # string), as vLLM's ignore_eos, which benchmark clients send to fix the answers' lengths.
    ignore_eos: bool = False
    # N: each Update's `logprobs` holds its tokens' logprobs and the N most likely tokens at each
    # (as `generate(..., logprobs=N)`); at most EngineConfig.logprobs. None: none.
    logprobs: int | None = None
    # N: the first Update's `prompt_logprobs` holds the prompt's tokens from the second on, each
    # with its logprob given the tokens before it and the N most likely tokens there (as
    # `generate(..., prompt_logprobs=N)`: the model's raw distribution); at most
    # EngineConfig.logprobs. Such a prompt is prefilled in one pass, never in chunks. None: none.
    prompt_logprobs: int | None = None


@dataclasses.dataclass
class Update:
    """What one engine step reports for one request: its new tokens, and counters since its
    previous Update."""

    request_id: int
    tokens: list[int]  # committed since the previous Update (a stop token included, as generate does)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (non-finite logits) once finished
    num_drafts: int  # drafting steps (vLLM's num_drafts)
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]  # accepted drafts at each draft position (k of them)
    metrics: Any = None  # the request's whole figures (a SpecMetrics), once finished
    # With Request.logprobs: the new tokens' logprobs (a speculate/logprobs.py Logprobs)
    logprobs: Any = None
    # With Request.prompt_logprobs, on the request's first Update: its prompt's (a Logprobs of the
    # prompt's tokens from the second on)
    prompt_logprobs: Any = None


@dataclasses.dataclass
class EngineStats:
    """Where an engine's time went, in host wall-clock seconds since it started (or since
    `reset`): what a benchmark divides to tell prefill from decoding, and each width's step."""

    admissions: int = 0
    admission_s: float = 0.0  # prefills and writes into slots, while the running rows wait
    prompt_chunks: int = 0  # long prompts' prefill chunks (EngineConfig.prefill_chunk)
    preemptions: int = 0  # requests taken out of the batch for their pages (EngineConfig.page_size)
    steps: dict[int, int] = dataclasses.field(default_factory=dict)  # loop steps, by chunk width
    chunk_s: dict[int, float] = dataclasses.field(default_factory=dict)  # chunks' seconds, by width
    # Of those, the quiet chunks' (Dynamic's chunks in which no row may draft), by width
    quiet_steps: dict[int, int] = dataclasses.field(default_factory=dict)
    quiet_s: dict[int, float] = dataclasses.field(default_factory=dict)

    def reset(self) -> None:
        self.admissions, self.admission_s, self.steps, self.chunk_s = 0, 0.0, {}, {}
        self.prompt_chunks, self.preemptions = 0, 0
        self.quiet_steps, self.quiet_s = {}, {}

    def ms_per_step(self, width: int) -> float:
        return 1e3 * self.chunk_s[width] / max(self.steps[width], 1)

    def add_chunk(self, width: int, steps: int, seconds: float, quiet: bool) -> None:
        for counts, times in ((self.steps, self.chunk_s), (self.quiet_steps, self.quiet_s))[: 1 + quiet]:
            counts[width] = counts.get(width, 0) + steps
            times[width] = times.get(width, 0.0) + seconds

    def summary(self) -> str:
        """Steps by width and their milliseconds each, the quiet ones apart: "16: 120 x 29.1 ms
        (quiet 80 x 28.0)"."""
        parts = []
        for w in sorted(self.steps):
            part = f"{w}: {self.steps[w]} x {self.ms_per_step(w):.1f} ms"
            if self.quiet_steps.get(w):
                part += f" (quiet {self.quiet_steps[w]} x {1e3 * self.quiet_s[w] / self.quiet_steps[w]:.1f})"
            parts.append(part)
        return ", ".join(parts)


def check_request(
    request, vocab_size: int, max_model_len: int, max_logprobs: int | None, pool_tokens: int | None = None
) -> list[int]:
    """A request's prompt as a list of token ids, after the checks of its own fields (what the
    engine checks beside them, the sampling options, it checks itself); `max_logprobs`: the
    engine's EngineConfig.logprobs; `pool_tokens`: a paged engine's pool (named where a request
    could never fit: the pool holds one request of max_model_len, engine_pages.py)."""
    if not isinstance(request, Request):
        raise ValueError(f"request must be a specjax.serve.Request, got {type(request).__name__}")
    prompt = request.prompt
    listed = isinstance(prompt, Sequence | np.ndarray) and not isinstance(prompt, str | bytes)
    if not listed or len(prompt) == 0:
        raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r:.80}")
    for t in prompt:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt holds {t!r}: token ids must be integers in [0, {vocab_size})")
    check_int("max_new_tokens", request.max_new_tokens, 1)
    if len(prompt) + request.max_new_tokens > max_model_len:
        raise ValueError(
            f"max_new_tokens={request.max_new_tokens}: with a prompt of {len(prompt)} tokens it "
            f"exceeds the engine's max_model_len of {max_model_len} tokens"
            + ("" if pool_tokens is None else f" (its KV cache's pool holds {pool_tokens} tokens)")
        )
    if not isinstance(request.sampling, Sampling):
        raise ValueError(f"sampling must be a specjax.Sampling, got {type(request.sampling).__name__}")
    if not isinstance(request.speculate, bool):
        raise ValueError(f"speculate must be True or False, got {request.speculate!r}")
    if not isinstance(request.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be True or False, got {request.ignore_eos!r}")
    for name, value in (("logprobs", request.logprobs), ("prompt_logprobs", request.prompt_logprobs)):
        if value is None:
            continue
        check_int(name, value, 0)
        if max_logprobs is None or value > max_logprobs:
            allowed = (
                "none (EngineConfig.logprobs is None)" if max_logprobs is None else f"0 to {max_logprobs}"
            )
            raise ValueError(
                f"{name}={value}: this engine computes at most EngineConfig.logprobs={max_logprobs} "
                f"alternatives per token (allowed: {allowed})"
            )
    return [int(t) for t in prompt]
