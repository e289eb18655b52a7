"""The OpenAI-compatible HTTP server: `make_app(engine)` (a FastAPI app) and `serve(model)`.

Routes:

    POST /v1/chat/completions   OpenAI's chat completions, streamed (server-sent events) or not
    POST /v1/completions        OpenAI's completions (a prompt or a list of them), streamed or not
    GET  /v1/models, /v1/models/{id}, POST /tokenize, /detokenize, GET /tokenizer_info, /version
                                routes.py
    GET  /health                200 while the scheduler runs, 503 after it died
    GET  /metrics               Prometheus text (specjax/serve/metrics.py)

The app only translates: protocol.py turns a request body into engine Requests (a choice each:
n of each prompt), scheduler.py runs the engine on its own thread, and the tokens that come back
become the text that `generate` would return for them (decoded, special tokens skipped, cut at a
stop string). A request whose client disconnects is aborted in the engine, every choice of it.
guard.py checks what comes before the routes (the API key, the body's size, X-Request-Id) and
gives every error OpenAI's shape; CORS, when origins are allowed, is Starlette's middleware.

Under load, requests wait for one of the engine's slots in a bounded queue: past `max_waiting`
waiting requests, a new one is answered at once with HTTP 503 in OpenAI's error shape (code
"server_overloaded", a Retry-After header; the openai client retries such answers by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Sequence

import jax
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specjax import sharding
from specjax.api import load
from specjax.checks import check_int, is_int
from specjax.models import Model
from specjax.serve.config import speculative_config_to_proposer
from specjax.serve.engine import Engine
from specjax.serve.engine_config import (
    DEFAULT_CONSTRAINT_STATES,
    DEFAULT_MAX_LOGPROBS,
    PREFILL_CHUNK,
    EngineConfig,
)
from specjax.serve.engine_config import Request as EngineRequest
from specjax.serve.guard import DEFAULT_MAX_REQUEST_BYTES, Guard, add_error_handlers, check_api_key
from specjax.serve.handoff import PREFILL_ROUTE, RemotePrefiller, request_from_json
from specjax.serve.logprob_bodies import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from specjax.serve.metrics import ServerMetrics
from specjax.serve.protocol import GenerationRequest, RequestError, parse_request
from specjax.serve.responses import (
    CHAT,
    COMPLETION,
    Responder,
    error_body,
    spec_decode_metrics,
    speculate_metrics,
    usage,
)
from specjax.serve.routes import add_routes, check_model, json_body
from specjax.serve.scheduler import (
    EngineError,
    Overloaded,
    RequestStream,
    Scheduler,
    Unavailable,
    check_max_waiting,
)
from specjax.speculate.stops import cut_text
from specjax.text import TextDeltas

log = logging.getLogger("specjax.serve")

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is there
WAITING_PER_SLOT = 4  # the default max_waiting: this many requests queued per slot of the engine
RETRY_AFTER_S = 1  # the Retry-After of a 503
# `serve` compiles the prefill of prompts up to this many tokens before it listens (one program
# per bucket: 16, 32, 64, then multiples of 64); longer prompts compile on first use.
PRECOMPILE_PROMPT_TOKENS = 256
MONITORING = ("/health", "/metrics")  # open without the API key unless protect_monitoring
API_KEY_ENV = "SPECJAX_API_KEY"


class ClientGone(Exception):
    """The client of a non-streamed request disconnected."""


def make_app(
    engine,
    *,
    served_model_name: str | None = None,
    metrics_prefix: str = "specjax:",
    max_waiting: int | None = None,
    api_key: str | None = None,
    protect_monitoring: bool = False,
    allowed_origins: Sequence[str] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app serving `engine` (a specjax.serve.engine.Engine, whose model has a
    tokenizer). The engine is driven by a scheduler thread that starts and stops with the app
    (its lifespan: uvicorn runs it). `served_model_name` (default: the model's name) is the id
    /v1/models lists and requests name; `metrics_prefix` prefixes the Prometheus names;
    `max_waiting` (default 4 x the engine's max_batch) bounds the requests waiting for a slot:
    past it a request gets HTTP 503.

    api_key: requests must send `Authorization: Bearer <api_key>` (else 401), but to /health and
        /metrics unless `protect_monitoring`. None: no key.
    allowed_origins: the origins a browser may call from (CORS; "*" for any). Empty: no CORS.
    max_request_bytes: the largest request body (default 8 MiB); a larger one gets 413 unread."""
    model = engine.model
    if model.tokenizer is None:
        raise ValueError("make_app: the engine's model has no tokenizer; the server needs one for text")
    try:
        check_api_key(api_key)
        check_int("max_request_bytes", max_request_bytes, 1)
        if isinstance(allowed_origins, str) or not all(isinstance(o, str) and o for o in allowed_origins):
            raise ValueError(f"allowed_origins must be a list of origins, got {allowed_origins!r}")
        if not isinstance(protect_monitoring, bool):
            raise ValueError(f"protect_monitoring must be True or False, got {protect_monitoring!r}")
        name = served_model_name or model.name
        metrics = ServerMetrics(name, metrics_prefix)
        if max_waiting is None:
            max_waiting = WAITING_PER_SLOT * engine.max_batch
        scheduler = Scheduler(engine, metrics, max_waiting)
    except ValueError as error:
        raise ValueError(f"make_app: {error}") from None
    server = _Routes(engine, scheduler, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="specjax", lifespan=lifespan)
    app.state.engine, app.state.scheduler, app.state.metrics = engine, scheduler, metrics
    add_error_handlers(app)
    # Starlette runs the middleware added last first: CORS answers a preflight before the guard.
    open_paths = () if protect_monitoring else MONITORING
    app.add_middleware(Guard, api_key=api_key, open_paths=open_paths, max_request_bytes=max_request_bytes)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if scheduler.alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        content, content_type = metrics.exposition()
        return Response(content, media_type=content_type)

    add_routes(app, name, engine, server.started)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, COMPLETION)

    return app


class _Choice:
    """One choice of a request on its way: its engine stream and what it has sent so far."""

    def __init__(
        self, index: int, prompt: list[int], stream: RequestStream, deltas: TextDeltas, answers: bool
    ):
        self.index, self.prompt, self.stream, self.deltas = index, prompt, stream, deltas
        self.answers = answers  # False for max_tokens=0: the engine's one token is not sent
        self.tokens: list[int] = []
        self.logprobs: list = []  # the answer's Logprobs, a piece per Update (when asked)
        self.scored_prompt = None  # the prompt's Logprobs (Request.prompt_logprobs), once reported
        self.text_offset = 0  # a streamed completion's logprobs: the text offset of its next token
        self.opened = False  # streamed: its opening chunk (echo's prompt, prompt_logprobs) is sent
        self.finished = None  # its last Update
        self.held = ""  # streamed tool calls: the text so far (sent whole at the end)

    def take(self, update):
        """Keep what an Update brings; its new tokens and their Logprobs (none where the request
        asked for no answer: max_tokens=0)."""
        if update.prompt_logprobs is not None:
            self.scored_prompt = update.prompt_logprobs
        if update.finished:
            self.finished = update
        if not self.answers:
            return [], None
        self.tokens += update.tokens
        if update.logprobs is not None:
            self.logprobs.append(update.logprobs)
        return update.tokens, update.logprobs

    @property
    def finish_reason(self) -> str | None:
        """The finished choice's: the engine's, but "length" for an answer of max_tokens=0 (its
        budget spent at once), unless it was aborted or failed."""
        reason = self.finished.finish_reason
        return "length" if not self.answers and reason == "stop" else reason

    def usage(self) -> dict:
        return usage(len(self.prompt), len(self.tokens))


class _Routes:
    """What the generation routes share: the engine's limits, the scheduler, the model's name."""

    def __init__(self, engine, scheduler: Scheduler, name: str):
        self.engine, self.scheduler, self.name = engine, scheduler, name
        self.tokenizer = engine.model.tokenizer
        self.vocab_size = engine.model.config.vocab_size
        self.max_model_len = engine.max_model_len
        self.speculative = engine.proposer is not None
        self.max_logprobs = engine.config.logprobs
        self.texts = TokenTexts(self.tokenizer)
        self.started = int(time.time())
        self.warned: set[str] = set()  # the ignored fields already logged at warning level

    async def generate(self, http_request: Request, kind: str) -> Response:
        body = await json_body(http_request)
        check_model(body, self.name)
        parsed = parse_request(
            body, kind, self.tokenizer, self.vocab_size, self.max_model_len, self.max_logprobs
        )
        self._log_ignored(parsed)
        await self._prepare(parsed)
        choices = await self._admit(parsed)
        responder = Responder.new(kind, self.name, http_request.headers.get("x-request-id"))
        headers = {"X-Request-Id": responder.id}
        if parsed.stream:
            events = self._events(choices, parsed, responder)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            answer = await self._whole(http_request, choices, parsed, responder)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request": no one reads it
        return JSONResponse(answer, headers=headers)

    def _log_ignored(self, parsed: GenerationRequest) -> None:
        """Fields that cannot change the answer are ignored, and said so: at warning level the
        first time each is seen, then at debug level (a benchmark sends them with every request)."""
        for name in parsed.ignored:
            level = logging.DEBUG if name in self.warned else logging.WARNING
            self.warned.add(name)
            log.log(level, "the request's field %r is ignored: it does not change the answer", name)

    async def _prepare(self, parsed: GenerationRequest) -> None:
        """A constrained request's automaton, compiled off the engine's thread (Engine.prepare):
        a new schema's takes up to seconds, which the running requests would otherwise wait."""
        if parsed.sampling.constraint is None:
            return
        try:
            await asyncio.to_thread(self.engine.prepare, parsed.sampling)
        except ValueError as error:
            raise RequestError(str(error), param=parsed.constraint_field) from None

    def _capacity_check(self, parsed: GenerationRequest) -> None:
        count = parsed.n * len(parsed.prompts)
        capacity = self.engine.max_batch + self.scheduler.max_waiting
        if count > capacity:
            raise RequestError(
                f"n={parsed.n} choices of {len(parsed.prompts)} prompts make {count} engine requests; this "
                f"server holds at most {capacity} at once (--max-batch + --max-waiting)",
                param="n",
            )

    async def _admit(self, parsed: GenerationRequest) -> list[_Choice]:
        """Hand each choice to the scheduler and wait for the engine to take them all: HTTP 503
        when max_waiting requests wait already, or the scheduler is stopping or has died; 400 for
        a ValueError from engine.add (the client's mistake), 500 for another error of the
        engine's. If one choice is refused, the others are aborted: the request fails whole."""
        self._capacity_check(parsed)
        loop, choices = asyncio.get_running_loop(), []
        try:
            for index, prompt, sampling in parsed.choices():
                request = EngineRequest(
                    prompt=prompt,
                    sampling=sampling,
                    # max_tokens=0 (the prompt scored, no answer): the prefill's token is not sent
                    max_new_tokens=max(parsed.max_new_tokens, 1),
                    speculate=parsed.speculate,
                    ignore_eos=parsed.ignore_eos,
                    logprobs=parsed.logprobs,
                    prompt_logprobs=parsed.scored_prompt,
                )
                stream = RequestStream(request, loop)
                deltas = TextDeltas(
                    self.tokenizer,
                    sampling.stop,
                    skip_special_tokens=parsed.skip_special_tokens,
                    include_stop=parsed.include_stop,
                )
                self.scheduler.submit(stream)
                choices.append(_Choice(index, prompt, stream, deltas, parsed.max_new_tokens > 0))
            for choice in choices:
                await choice.stream.admitted
        except BaseException as error:
            for choice in choices:
                self.scheduler.abort(choice.stream)
            if isinstance(error, ValueError):
                raise RequestError(str(error)) from None
            if isinstance(error, Overloaded):
                raise RequestError(str(error), status=503, code="server_overloaded") from None
            if isinstance(error, Unavailable):
                raise RequestError(str(error), status=503) from None
            if isinstance(error, EngineError):
                raise RequestError(str(error), status=500) from None
            raise
        return choices

    def _speculate_metrics(self, parsed: GenerationRequest, update) -> dict | None:
        """The finished request's acceptance figures; null where it did not speculate."""
        if not (self.speculative and parsed.speculate):
            return None
        return speculate_metrics(update.metrics)

    def _spec_decode(self, parsed: GenerationRequest, choices: list[_Choice]) -> dict | None:
        """The request's acceptance over its choices in vLLM's per-request shape (AIPerf's)."""
        if not (self.speculative and parsed.speculate):
            return None
        summaries = [c.finished.metrics.summary() for c in choices if c.finished.metrics is not None]
        return spec_decode_metrics(summaries) if summaries else None

    def _usage(self, parsed: GenerationRequest, choices: list[_Choice]) -> dict:
        """Each prompt's tokens once (however many choices it has), every choice's new tokens."""
        prompt_tokens = sum(len(prompt) for prompt in parsed.prompts)
        return usage(prompt_tokens, sum(len(c.tokens) for c in choices))

    async def _whole(
        self, http_request: Request, choices: list[_Choice], parsed: GenerationRequest, responder: Responder
    ) -> dict:
        """Wait for every token of every choice, aborting them all if the client disconnects."""
        watcher = asyncio.create_task(_watch_disconnect(http_request, [c.stream for c in choices]))

        async def collect(choice: _Choice) -> None:
            while choice.finished is None:
                choice.take(await choice.stream.next_update())

        try:
            await asyncio.gather(*(collect(c) for c in choices))
        except EngineError as error:  # the engine failed while running it
            raise RequestError(str(error), status=500) from None
        finally:
            watcher.cancel()
            for choice in choices:
                if choice.finished is None:
                    self.scheduler.abort(choice.stream)
        bodies = []
        for choice in choices:
            text = self.tokenizer.decode(choice.tokens, skip_special_tokens=parsed.skip_special_tokens)
            text = cut_text(text, choice.stream.request.sampling.stop, parsed.include_stop)
            if parsed.echo:
                text = self._prompt_text(parsed, choice) + text
            spec = self._speculate_metrics(parsed, choice.finished)
            logprobs = self._logprobs(parsed, choice, choice.logprobs, prompt=parsed.echo, streamed=False)
            reason, message = choice.finish_reason, None
            if parsed.tool_calls is not None:  # the answer's text is a call (or calls)
                answer = parsed.tool_calls.answer(text, reason)
                reason, message = answer["finish_reason"], answer["message"]
            body = responder.choice(text, reason, spec, choice.index, logprobs, message)
            if parsed.prompt_logprobs is not None and parsed.kind == COMPLETION:
                body["prompt_logprobs"] = self._prompt_logprobs(parsed, choice)
            bodies.append(body)
        answer = responder.responses(bodies, self._usage(parsed, choices), self._spec_decode(parsed, choices))
        if parsed.prompt_logprobs is not None and parsed.kind == CHAT:  # (vLLM's place for them)
            answer["prompt_logprobs"] = self._prompt_logprobs(parsed, choices[0])
        return answer

    def _prompt_text(self, parsed: GenerationRequest, choice: _Choice) -> str:
        return self.tokenizer.decode(choice.prompt, skip_special_tokens=parsed.skip_special_tokens)

    def _prompt_logprobs(self, parsed: GenerationRequest, choice: _Choice) -> list:
        return prompt_logprobs(self.texts, choice.scored_prompt, parsed.prompt_logprobs)

    def _logprobs(
        self, parsed: GenerationRequest, choice: _Choice, pieces: list, prompt: bool, streamed: bool
    ) -> dict | None:
        """A choice's logprobs body (logprob_bodies.py) of the answer's `pieces` (Logprobs), after
        the prompt's tokens where `prompt` (echo: the first prompt token with none); `streamed`:
        a chunk's, whose text offsets follow the chunks before it. None where the request asked
        for no logprobs."""
        if parsed.logprobs is None:
            return None
        if parsed.kind == CHAT:
            return chat_logprobs(self.texts, pieces, parsed.tokens_as_ids)
        first = choice.prompt[0] if prompt else None
        if prompt:
            pieces = [choice.scored_prompt.first(parsed.logprobs), *pieces]
        body, after = completion_logprobs(self.texts, pieces, parsed.tokens_as_ids, choice.text_offset, first)
        if streamed:
            choice.text_offset = after
        return body

    async def _events(self, choices: list[_Choice], parsed: GenerationRequest, responder: Responder):
        """The server-sent events of a streamed request: each choice's text deltas (by index, as
        its tokens come), its last chunk with the finish reason, the usage chunk when asked for,
        then `data: [DONE]`. Starlette cancels this generator when the client disconnects;
        `finally` then aborts the choices not finished."""
        include_usage, continuous = parsed.include_usage, parsed.continuous_usage
        calls = parsed.tool_calls if parsed.tool_calls and parsed.tool_calls.schema is not None else None
        updates: asyncio.Queue = asyncio.Queue()  # (choice, Update or EngineError), every choice's

        async def pump(choice: _Choice) -> None:
            try:
                while True:
                    update = await choice.stream.next_update()
                    updates.put_nowait((choice, update))
                    if update.finished:
                        return
            except EngineError as error:
                updates.put_nowait((choice, error))

        def chunk(choice: _Choice, text: str, prompt_logprobs=None, **options) -> str:
            now = choice.usage() if continuous else None
            body = responder.chunk(
                text, index=choice.index, include_usage=include_usage, usage=now, **options
            )
            if prompt_logprobs is not None:  # vLLM's place: the choice's, or the chat chunk's
                (body["choices"][0] if parsed.kind == COMPLETION else body)["prompt_logprobs"] = (
                    prompt_logprobs
                )
            return _event(body)

        def opening(choice: _Choice) -> str | None:
            """The chunk sent before a choice's first tokens: with echo its prompt (and the
            prompt's logprobs), with prompt_logprobs vLLM's; None where it has none."""
            scored = None if parsed.prompt_logprobs is None else self._prompt_logprobs(parsed, choice)
            if not parsed.echo and scored is None:
                return None
            text = self._prompt_text(parsed, choice) if parsed.echo else ""
            logprobs = self._logprobs(parsed, choice, [], prompt=True, streamed=True) if parsed.echo else None
            return chunk(choice, text, prompt_logprobs=scored, logprobs=logprobs)

        pumps = [asyncio.create_task(pump(c)) for c in choices]
        try:
            if parsed.kind == CHAT:  # OpenAI's first chunk of a choice says the role
                for choice in choices:
                    yield chunk(choice, "", first=True)
            running = len(choices)
            while running:
                choice, update = await updates.get()
                if isinstance(update, EngineError):  # the status (200) is already sent
                    yield _event(error_body(str(update), "server_error"))
                    break
                new, piece = choice.take(update)
                if not choice.opened:  # (after its first Update: it brings the prompt's logprobs)
                    choice.opened = True
                    if (first := opening(choice)) is not None:
                        yield first
                text = choice.deltas.push(new)
                if calls is not None:  # a call goes whole in the last chunk (ToolCalls.delta)
                    choice.held, text = choice.held + text, ""
                logprobs = self._logprobs(
                    parsed, choice, [] if piece is None else [piece], prompt=False, streamed=True
                )
                if update.finished:
                    running -= 1
                    text += choice.deltas.finish()
                    spec = self._speculate_metrics(parsed, update)
                    reason, delta = choice.finish_reason, None
                    if calls is not None:
                        last = calls.delta(choice.held + text, reason)
                        text, reason, delta = "", last["finish_reason"], last["delta"]
                    yield chunk(choice, text, finish_reason=reason, spec=spec, logprobs=logprobs, delta=delta)
                elif text or new and logprobs is not None:  # (text held back: its logprobs go now)
                    yield chunk(choice, text, logprobs=logprobs)
            else:
                if include_usage:
                    spec = self._spec_decode(parsed, choices)
                    yield _event(responder.usage_chunk(self._usage(parsed, choices), spec))
        finally:
            for task in pumps:
                task.cancel()
            for choice in choices:
                if choice.finished is None:
                    self.scheduler.abort(choice.stream)
        yield "data: [DONE]\n\n"


async def _watch_disconnect(http_request: Request, streams: list[RequestStream]) -> None:
    """Wake a non-streamed request's handler with ClientGone when its client disconnects (a
    streamed one learns it from Starlette, which cancels its generator)."""
    while not await http_request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    for stream in streams:
        stream.updates.put_nowait(ClientGone())


def make_prefill_app(
    engine: Engine, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """A prefill server's app (`specjax serve --role prefill`; handoff.py): POST PREFILL_ROUTE
    with a request's JSON (`request_to_json`) answers its row's bytes (`encode_row`), or HTTP 400
    naming what the engine refused; GET /health for probes. Rows are made one at a time, off the
    event loop. The API server's guard in front (`Guard`: the API key, which the decode side
    sends, and the body limit: a larger body gets 413 unread)."""
    app = FastAPI(title="specjax prefill")
    app.state.engine = engine
    app.add_middleware(Guard, api_key=api_key, open_paths=MONITORING, max_request_bytes=max_request_bytes)
    lock = threading.Lock()

    def make(body: dict) -> bytes:
        with lock:
            return engine.prefill_bytes(request_from_json(body))

    @app.post(PREFILL_ROUTE)
    async def prefill(http: Request):
        try:
            data = await asyncio.to_thread(make, await http.json())
        except (ValueError, KeyError, TypeError) as error:
            return JSONResponse(
                {"error": {"message": f"prefill: {error}", "type": "invalid_request_error"}}, 400
            )
        return Response(data, media_type="application/octet-stream")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    return app


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


ROLES = ("both", "prefill", "decode")


def serving_prefiller(role: str, prefill_url: str | None, api_key: str | None = None):
    """The engine's prefiller for a `serve` role: a RemotePrefiller of prefill_url for "decode",
    else None (checked: prefill_url goes with "decode" alone)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {', '.join(ROLES)}")
    if role != "both" and jax.process_count() > 1:
        raise ValueError(
            f"role={role!r}: a prefill or decode server runs in one process (its own devices); "
            "across processes, serve with role 'both'"
        )
    if (role == "decode") != (prefill_url is not None):
        raise ValueError(
            f"role={role!r} with prefill_url={prefill_url!r}: a decode server needs the prefill "
            "server's URL, and only a decode server takes one"
        )
    return None if prefill_url is None else RemotePrefiller(prefill_url, api_key=api_key)


def serving_mesh(tensor_parallel_size: int, data_parallel_size: int, speculative_config: dict | None):
    """The engine's mesh for `serve`'s parallel sizes (None for 1 x 1: one device), checked
    against the devices (this process's; after `jax.distributed.initialize`, every process's)
    and the speculative config's draft_tensor_parallel_size."""
    check_int("tensor_parallel_size", tensor_parallel_size, 1)
    check_int("data_parallel_size", data_parallel_size, 1)
    draft = (speculative_config or {}).get("draft_tensor_parallel_size", 1)
    if draft not in (1, tensor_parallel_size):
        raise ValueError(
            f"speculative_config draft_tensor_parallel_size={draft!r}: 1 (the draft replicated) or "
            f"tensor_parallel_size={tensor_parallel_size} (split as the target)"
        )
    size = tensor_parallel_size * data_parallel_size
    if size == 1:
        return None
    devices = jax.devices()  # (global: several processes' after jax.distributed.initialize)
    if size > len(devices):
        where = (
            "this process has" if jax.process_count() == 1 else f"the {jax.process_count()} processes have"
        )
        raise ValueError(
            f"tensor_parallel_size x data_parallel_size = {tensor_parallel_size} x {data_parallel_size} "
            f"= {size} devices, but {where} {len(devices)} ({devices[0].platform})"
        )
    return sharding.make_mesh(model=tensor_parallel_size, data=data_parallel_size, devices=devices[:size])


def serve(
    model,
    speculative_config: dict | None = None,
    *,
    proposer=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "float32",
    quantization: str | None = None,
    group_size: int | None = None,
    max_batch: int = 8,
    max_model_len: int | None = None,
    chunk_steps: int = 16,
    admission_steps: int | None = None,
    prefill_chunk: int | None = PREFILL_CHUNK,
    page_size: int | None = None,
    num_pages: int | None = None,
    kv_cache_memory: int | float | None = None,
    prefix_caching: bool = True,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    role: str = "both",
    prefill_url: str | None = None,
    lockstep_address: str | None = None,
    max_logprobs: int | None = DEFAULT_MAX_LOGPROBS,
    constraint_states: int | None = DEFAULT_CONSTRAINT_STATES,
    max_waiting: int | None = None,
    served_model_name: str | None = None,
    metrics_prefix: str = "specjax:",
    log_level: str = "info",
    precompile: int | None = PRECOMPILE_PROMPT_TOKENS,
    api_key: str | None = None,
    protect_monitoring: bool = False,
    allowed_origins: Sequence[str] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> None:
    """Serve a model over HTTP until interrupted (what `specjax serve` runs).

    model: a specjax.Model, or anything `specjax.load` takes (a built-in name, an HF folder, a
        .gguf file), loaded in `dtype` with `quantization` and `group_size` (as `specjax.load`).
    speculative_config: vLLM's / FastDeploy's --speculative-config object (see
        specjax/serve/config.py), or `proposer`: any specjax proposer; neither for plain decoding.
    max_batch, max_model_len, chunk_steps, admission_steps, prefill_chunk: the engine's slots, the
        longest prompt + answer, the most loop steps between two looks at the queue (while a slot
        is free: admission_steps), and the chunks a long prompt is prefilled in (EngineConfig).
    page_size, num_pages, kv_cache_memory: the KV cache in pages of page_size slots, in a pool of
        num_pages pages or of kv_cache_memory (bytes, or a fraction of the free memory) shared by
        the requests as their lengths need (EngineConfig); None: a dense row per slot. With pages,
        prefix_caching shares prompts' pages by content (EngineConfig.prefix_caching).
    tensor_parallel_size, data_parallel_size: the engine on a mesh of their product of this
        process's devices (`sharding.make_mesh(model=..., data=...)`): each layer split over
        tensor_parallel_size devices, the slots over data_parallel_size groups of them
        (max_batch a multiple of it). A draft model is replicated unless the speculative config's
        draft_tensor_parallel_size is the tensor-parallel size.
    role, prefill_url: "both" (default) prefills and decodes here; "prefill" serves only rows
        (`make_prefill_app`: POST /specjax/prefill) for a decode server; "decode" serves the API
        and pulls each request's row from the prefill server at prefill_url (handoff.py), the
        two started with the same model, proposer and engine options.
    lockstep_address: on a mesh that spans processes (every process runs `serve` with the same
        arguments after `jax.distributed.initialize`), where process 0, which serves HTTP, leads
        the others' engines (serve/lockstep.py), "host:port" of process 0.
    max_logprobs: the most alternatives per token a request's logprobs, top_logprobs or
        prompt_logprobs may ask for (EngineConfig.logprobs; vLLM's default 20). None: no logprobs.
    constraint_states: the constraint automata's tables (EngineConfig.constraint_states), for
        response_format, tools and vLLM's structured_outputs. None: constraints refused.
    max_waiting: the most requests waiting for a slot (default 4 x max_batch); past it, 503.
    served_model_name: the model's id in the API (default: `model` as given, or the Model's name).
    precompile: before listening, compile the loop at every width and the prefill of prompts up to
        this many tokens (`Engine.precompile`): a program compiled while serving stalls every
        running request while it compiles. None: compile each on first use.
    api_key, protect_monitoring, allowed_origins, max_request_bytes: as `make_app`'s; api_key None
        reads the environment variable SPECJAX_API_KEY (unset: no key).
    """
    if precompile is not None and (not is_int(precompile) or precompile < 0):
        raise ValueError(f"serve: precompile must be None or an integer >= 0, got {precompile!r}")
    if proposer is not None and speculative_config is not None:
        raise ValueError("serve: give a proposer or a speculative_config, not both")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV)
    try:  # before the model loads
        if max_waiting is not None:
            check_max_waiting(max_waiting)
        check_api_key(api_key)
        check_int("max_request_bytes", max_request_bytes, 1)
        mesh = serving_mesh(tensor_parallel_size, data_parallel_size, speculative_config)
        prefiller = serving_prefiller(role, prefill_url, api_key)
    except ValueError as error:
        raise ValueError(f"serve: {error}") from None
    if not isinstance(model, Model):
        served_model_name = served_model_name or str(model)
        model = load(model, dtype=dtype, quantization=quantization, group_size=group_size, mesh=mesh)
    if proposer is None:
        proposer = speculative_config_to_proposer(speculative_config, model)
    config = EngineConfig(
        max_batch=max_batch,
        max_model_len=max_model_len,
        chunk_steps=chunk_steps,
        admission_steps=admission_steps,
        prefill_chunk=prefill_chunk,
        page_size=page_size,
        num_pages=num_pages,
        kv_cache_memory=kv_cache_memory,
        prefix_caching=prefix_caching,
        logprobs=max_logprobs,
        constraint_states=constraint_states,
    )
    engine = Engine(
        model, proposer, config, mesh=mesh, prefiller=prefiller, lockstep_address=lockstep_address
    )
    if mesh is not None:
        parallel = f"tensor parallel {tensor_parallel_size} x data parallel {data_parallel_size}"
        print(f"specjax serve: on {mesh.size} devices, {parallel}")
    print(f"specjax serve: {engine.kv_cache.summary()}")
    if precompile is not None:
        longest = min(precompile, engine.max_model_len - 1)
        start = time.perf_counter()
        print(f"specjax serve: compiling the loop and the prefill of prompts up to {longest} tokens")
        count = engine.precompile(range(1, longest + 1))
        print(f"specjax serve: {count} programs compiled in {time.perf_counter() - start:.0f} s")
    if jax.process_index() != 0:  # (a mesh across processes: process 0 serves, this one follows)
        print(f"specjax serve: process {jax.process_index()} follows process 0's engine")
        engine.follow()
        return
    if role == "prefill":
        print(f"specjax serve: prefill server, rows at POST {PREFILL_ROUTE}")
        app = make_prefill_app(engine, api_key, max_request_bytes)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
        return
    app = make_app(
        engine,
        served_model_name=served_model_name,
        metrics_prefix=metrics_prefix,
        max_waiting=max_waiting,
        api_key=api_key,
        protect_monitoring=protect_monitoring,
        allowed_origins=allowed_origins,
        max_request_bytes=max_request_bytes,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.close()  # (the other processes' engines stop following)
