"""The OpenAI-compatible HTTP server: `make_app(engine)` (a FastAPI app) and `serve(model)`.

Routes:

    POST /v1/chat/completions   OpenAI's chat completions, streamed (server-sent events) or not
    POST /v1/completions        OpenAI's completions (one prompt per request), streamed or not
    GET  /v1/models             the served model
    GET  /health                200 while the scheduler runs, 503 after it died
    GET  /metrics               Prometheus text (specjax/serve/metrics.py)

The app only translates: protocol.py turns a request body into an engine Request, scheduler.py
runs the engine on its own thread, and the tokens that come back become the text that
`generate` would return for them (decoded, special tokens skipped, cut at a stop string). A
request whose client disconnects is aborted in the engine.

Under load, requests wait for one of the engine's slots in a bounded queue: past `max_waiting`
waiting requests, a new one is answered at once with HTTP 503 in OpenAI's error shape (code
"server_overloaded", a Retry-After header; the openai client retries such answers by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specjax.checks import is_int
from specjax.models import Model, load
from specjax.serve.config import speculative_config_to_proposer
from specjax.serve.engine import Engine
from specjax.serve.engine_config import EngineConfig
from specjax.serve.engine_config import Request as EngineRequest
from specjax.serve.metrics import ServerMetrics
from specjax.serve.protocol import (
    CHAT,
    COMPLETION,
    GenerationRequest,
    RequestError,
    Responder,
    error_body,
    parse_request,
    speculate_metrics,
    usage,
)
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

DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is there
WAITING_PER_SLOT = 4  # the default max_waiting: this many requests queued per slot of the engine
RETRY_AFTER_S = 1  # the Retry-After of a 503
# `serve` compiles the prefill of prompts up to this many tokens before it listens (one program
# per bucket: 16, 32, 64, then multiples of 64); longer prompts compile on first use.
PRECOMPILE_PROMPT_TOKENS = 256


class ClientGone(Exception):
    """The client of a non-streamed request disconnected."""


def make_app(
    engine,
    *,
    served_model_name: str | None = None,
    metrics_prefix: str = "specjax:",
    max_waiting: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (a specjax.serve.engine.Engine, whose model has a
    tokenizer). The engine is driven by a scheduler thread that starts and stops with the app
    (its lifespan: uvicorn runs it). `served_model_name` (default: the model's name) is the id
    /v1/models lists and requests name; `metrics_prefix` prefixes the Prometheus names;
    `max_waiting` (default 4 x the engine's max_batch) bounds the requests waiting for a slot:
    past it a request gets HTTP 503."""
    model = engine.model
    if model.tokenizer is None:
        raise ValueError("make_app: the engine's model has no tokenizer; the server needs one for text")
    name = served_model_name or model.name
    metrics = ServerMetrics(name, metrics_prefix)
    if max_waiting is None:
        max_waiting = WAITING_PER_SLOT * engine.max_batch
    try:
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

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": name,
            "object": "model",
            "created": server.started,
            "owned_by": "specjax",
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, COMPLETION)

    return app


class _Routes:
    """What the generation routes share: the engine's limits, the scheduler, the model's name."""

    def __init__(self, engine, scheduler: Scheduler, name: str):
        self.engine, self.scheduler, self.name = engine, scheduler, name
        self.tokenizer = engine.model.tokenizer
        self.vocab_size = engine.model.config.vocab_size
        self.max_model_len = engine.max_model_len
        self.speculative = engine.proposer is not None
        self.started = int(time.time())

    async def generate(self, http_request: Request, kind: str) -> Response:
        body = await _json_body(http_request)
        if isinstance(body, dict) and body.get("model") not in (None, self.name):
            raise RequestError(
                f"the model {body['model']!r} does not exist; this server serves {self.name!r}",
                param="model",
                status=404,
                code="model_not_found",
            )
        parsed = parse_request(body, kind, self.tokenizer, self.vocab_size, self.max_model_len)
        stream = await self._admit(parsed)
        responder = Responder.new(kind, self.name)
        if parsed.stream:
            events = self._events(stream, parsed, responder)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return JSONResponse(await self._whole(http_request, stream, parsed, responder))
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request": no one reads it

    async def _admit(self, parsed: GenerationRequest) -> RequestStream:
        """Hand the request to the scheduler and wait for the engine to take it: HTTP 503 when
        max_waiting requests wait already, or the scheduler is stopping or has died; 400 for a
        ValueError from engine.add (the client's mistake), 500 for another error of the engine's."""
        request = EngineRequest(
            prompt=parsed.prompt,
            sampling=parsed.sampling,
            max_new_tokens=parsed.max_new_tokens,
            speculate=parsed.speculate,
        )
        stream = RequestStream(request, asyncio.get_running_loop())
        try:
            self.scheduler.submit(stream)
            await stream.admitted
        except ValueError as error:
            raise RequestError(str(error)) from None
        except Overloaded as error:
            raise RequestError(str(error), status=503, code="server_overloaded") from None
        except Unavailable as error:
            raise RequestError(str(error), status=503) from None
        except EngineError as error:
            raise RequestError(str(error), status=500) from None
        except asyncio.CancelledError:
            self.scheduler.abort(stream)
            raise
        return stream

    def _speculate_metrics(self, parsed: GenerationRequest, update) -> dict | None:
        """The finished request's acceptance figures; null where it did not speculate."""
        if not (self.speculative and parsed.speculate):
            return None
        return speculate_metrics(update.metrics)

    async def _whole(
        self, http_request: Request, stream: RequestStream, parsed: GenerationRequest, responder: Responder
    ) -> dict:
        """Wait for every token, aborting the request if its client disconnects meanwhile."""
        watcher = asyncio.create_task(_watch_disconnect(http_request, stream))
        tokens, finished = [], None
        try:
            while finished is None:
                update = await stream.next_update()
                tokens += update.tokens
                if update.finished:
                    finished = update
        except EngineError as error:  # the engine failed while running it
            raise RequestError(str(error), status=500) from None
        finally:
            watcher.cancel()
            if finished is None:
                self.scheduler.abort(stream)
        text = cut_text(self.tokenizer.decode(tokens, skip_special_tokens=True), parsed.sampling.stop)
        return responder.response(
            text,
            finished.finish_reason,
            usage(len(parsed.prompt), len(tokens)),
            self._speculate_metrics(parsed, finished),
        )

    async def _events(self, stream: RequestStream, parsed: GenerationRequest, responder: Responder):
        """The server-sent events of a streamed request: text deltas, a last chunk with the
        finish reason (and the usage chunk when asked for), then `data: [DONE]`. Starlette
        cancels this generator when the client disconnects; `finally` then aborts the request."""
        deltas = TextDeltas(self.tokenizer, parsed.sampling.stop)
        include_usage, num_tokens, finished = parsed.include_usage, 0, False
        try:
            if parsed.kind == CHAT:  # OpenAI's first chunk says the role
                yield _event(responder.chunk("", first=True, include_usage=include_usage))
            while not finished:
                update = await stream.next_update()
                num_tokens += len(update.tokens)
                text = deltas.push(update.tokens)
                finished = update.finished
                if finished:
                    text += deltas.finish()
                    spec = self._speculate_metrics(parsed, update)
                    chunk = responder.chunk(
                        text, finish_reason=update.finish_reason, spec=spec, include_usage=include_usage
                    )
                    yield _event(chunk)
                elif text:
                    yield _event(responder.chunk(text, include_usage=include_usage))
            if include_usage:
                yield _event(responder.usage_chunk(usage(len(parsed.prompt), num_tokens)))
        except EngineError as error:  # the engine failed mid-stream: the status (200) is already sent
            yield _event(error_body(str(error), "server_error"))
        finally:
            if not finished:
                self.scheduler.abort(stream)
        yield "data: [DONE]\n\n"


async def _watch_disconnect(http_request: Request, stream: RequestStream) -> None:
    """Wake a non-streamed request's handler with ClientGone when its client disconnects (a
    streamed one learns it from Starlette, which cancels its generator)."""
    while not await http_request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    stream.updates.put_nowait(ClientGone())


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _json_body(http_request: Request):
    try:
        return await http_request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON ({error})") from None


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
    max_waiting: int | None = None,
    served_model_name: str | None = None,
    metrics_prefix: str = "specjax:",
    log_level: str = "info",
    precompile: int | None = PRECOMPILE_PROMPT_TOKENS,
) -> None:
    """Serve a model over HTTP until interrupted (what `specjax serve` runs).

    model: a specjax.Model, or anything `specjax.load` takes (a built-in name, an HF folder, a
        .gguf file), loaded in `dtype` with `quantization` and `group_size` (as `specjax.load`).
    speculative_config: vLLM's / FastDeploy's --speculative-config object (see
        specjax/serve/config.py), or `proposer`: any specjax proposer; neither for plain decoding.
    max_batch, max_model_len, chunk_steps, admission_steps: the engine's slots, the longest
        prompt + answer, and the most loop steps between two looks at the queue (while a slot is
        free: admission_steps) (specjax.serve.engine.Engine).
    max_waiting: the most requests waiting for a slot (default 4 x max_batch); past it, 503.
    served_model_name: the model's id in the API (default: `model` as given, or the Model's name).
    precompile: before listening, compile the loop at every width and the prefill of prompts up to
        this many tokens (`Engine.precompile`): a program compiled while serving stalls every
        running request while it compiles. None: compile each on first use.
    """
    if precompile is not None and (not is_int(precompile) or precompile < 0):
        raise ValueError(f"serve: precompile must be None or an integer >= 0, got {precompile!r}")
    if proposer is not None and speculative_config is not None:
        raise ValueError("serve: give a proposer or a speculative_config, not both")
    if max_waiting is not None:  # before the model loads
        try:
            check_max_waiting(max_waiting)
        except ValueError as error:
            raise ValueError(f"serve: {error}") from None
    if not isinstance(model, Model):
        served_model_name = served_model_name or str(model)
        model = load(model, dtype=dtype, quantization=quantization, group_size=group_size)
    if proposer is None:
        proposer = speculative_config_to_proposer(speculative_config, model)
    config = EngineConfig(
        max_batch=max_batch,
        max_model_len=max_model_len,
        chunk_steps=chunk_steps,
        admission_steps=admission_steps,
    )
    engine = Engine(model, proposer, config)
    if precompile is not None:
        longest = min(precompile, engine.max_model_len - 1)
        start = time.perf_counter()
        print(f"specjax serve: compiling the loop and the prefill of prompts up to {longest} tokens")
        count = engine.precompile(range(1, longest + 1))
        print(f"specjax serve: {count} programs compiled in {time.perf_counter() - start:.0f} s")
    app = make_app(
        engine, served_model_name=served_model_name, metrics_prefix=metrics_prefix, max_waiting=max_waiting
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)
