"""`specjax.stream`: one prompt's text, delta by delta, as the compiled loop commits tokens.

It runs the prompt through a one-slot `Engine` (continuous batching with a batch of one): the
loop runs `chunk_steps` steps at a time and hands back the tokens it committed, which
`TextDeltas` turns into text (a character split across tokens waits until it is whole; text that
may begin a stop string waits until it is known not to). The engine is compiled with the
request's own sampling options, so the tokens are exactly `generate`'s for the same arguments.
Engines are kept (a few, least recently used dropped) so that a second call with the same model,
proposer and options compiles nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import weakref
from collections.abc import Iterator

import jax

from specjax import planner
from specjax.checks import check_int
from specjax.models.model import Model
from specjax.serve.engine import Engine
from specjax.serve.engine_config import Request
from specjax.speculate.logprobs import Logprobs
from specjax.speculate.metrics import SpecMetrics
from specjax.speculate.sampling import Sampling, WarpSpec
from specjax.text import TextDeltas

MAX_KEPT_ENGINES = 2  # each holds its slot's caches (and its model) while kept


@dataclasses.dataclass
class StreamDelta:
    """What one chunk of the loop added: its text and token ids; the last delta of a stream also
    says why it ended and carries the generation's metrics."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" on the last delta
    metrics: SpecMetrics | None = None  # on the last delta
    # With stream(..., logprobs=N): the token ids' logprobs and top N (a speculate/logprobs.py Logprobs)
    logprobs: Logprobs | None = None

    def __str__(self) -> str:
        return self.text


def stream(
    model: Model,
    prompt,
    proposer=None,
    sampling: Sampling | None = None,
    max_new_tokens: int = 128,
    key: jax.Array | None = None,
    chat: bool = False,
    chunk_steps: int = 8,
    kernels: str = "auto",
    matmul_precision: str | None = None,
    cache_dtype=None,
    scan_layers: bool | None = None,
    logprobs: int | None = None,
) -> Iterator[StreamDelta]:
    """Generate from one prompt and yield StreamDelta's as tokens are committed.

    `prompt` is a str, a list of token ids, or with `chat=True` a list of messages
    ([{"role": "user", "content": ...}, ...], through the tokenizer's chat template); the other
    arguments are `generate`'s. Joined, the deltas' texts equal `generate(...).texts[0]` and their
    token ids its tokens. Every `chunk_steps` steps of the loop the host receives the new tokens
    (fewer: text sooner; more: fewer round trips). With `logprobs=N`, each delta's `logprobs` holds
    its tokens' logprobs and top N, as `generate(..., logprobs=N)` reports them.

        for delta in specjax.stream(model, "Write a haiku.", chat=True):
            print(delta.text, end="", flush=True)

    Closing the generator early (a `break`) frees its slot.
    """
    ids = planner.tokenize(model, [prompt], chat)[0]
    check_int("max_new_tokens", max_new_tokens, 1)
    sampling = planner.row_samplings(sampling, 1)[0]
    planner.check_token_options([sampling], model)
    key = planner.call_key(key, [sampling])
    planner.check_fits_context(model, len(ids), max_new_tokens, "prompt")
    # Engines are shared by calls whose lengths round to the same capacity, as generate's programs are.
    length = planner.prompt_bucket(len(ids)) + max_new_tokens
    granule = planner.CAPACITY_GRANULE
    max_model_len = min(model.config.max_position_embeddings, -(-length // granule) * granule)
    options = dict(
        max_model_len=max_model_len,
        chunk_steps=chunk_steps,
        warp=WarpSpec.of(sampling),
        kernels=kernels,
        matmul_precision=matmul_precision,
        cache_dtype=cache_dtype,
        scan_layers=scan_layers,
        logprobs=planner.check_logprobs(logprobs, model.config.vocab_size),
    )
    engine = _engine(model, proposer, options)
    request_id = engine.add(Request(ids, sampling, max_new_tokens, key=key, logprobs=options["logprobs"]))
    return _deltas(
        engine, request_id, TextDeltas(model.tokenizer, sampling.stop) if model.tokenizer else None
    )


def _deltas(engine: Engine, request_id: int, text: TextDeltas | None) -> Iterator[StreamDelta]:
    finished = False
    try:
        while not finished:
            for update in engine.step():
                finished = update.finished
                delta = StreamDelta("", update.tokens, update.finish_reason, update.metrics, update.logprobs)
                if text is not None:
                    delta.text = text.push(update.tokens) + (text.finish() if finished else "")
                yield delta
    finally:
        if not finished:  # closed early: the slot goes back
            engine.abort(request_id)


_ENGINES: collections.OrderedDict = collections.OrderedDict()


def _engine(model: Model, proposer, options: dict) -> Engine:
    """A kept one-slot engine for these arguments, or a new one (kept when they are hashable)."""
    try:
        key = (id(model), proposer, tuple(sorted(options.items())))
        hash(key)
    except TypeError:  # a proposer that cannot be a dict key: a fresh engine each call
        return Engine(model, proposer, max_batch=1, **options)
    kept = _ENGINES.get(key)
    if kept is not None and kept[0]() is model and not kept[1].has_work:
        _ENGINES.move_to_end(key)
        return kept[1]
    engine = Engine(model, proposer, max_batch=1, **options)
    if kept is None or not kept[1].has_work:  # (one in use by an unfinished stream stays its own)
        _ENGINES[key] = (weakref.ref(model), engine)
        while len(_ENGINES) > MAX_KEPT_ENGINES:
            _ENGINES.popitem(last=False)
    return engine
