"""What the server checks of a request before any route reads it, and its errors' shape.

`Guard` is an ASGI middleware in front of the routes (behind CORS, so that a browser's preflight
and the refusals below carry the CORS headers):

    X-Request-Id    a client's id, checked (printable ASCII, at most 200 characters) and echoed on
                    the response; the generation routes use it as the response's id
    API key         with `api_key`, a request without `Authorization: Bearer <key>` gets 401, but
                    for the paths in `open_paths` (/health and /metrics unless protected)
    body size       a body over `max_request_bytes` gets 413 before any of it is parsed: at once
                    when its Content-Length says so, else as soon as the bytes read pass the limit
                    (a chunked upload); the routes then read the body from memory

`add_error_handlers` gives every error FastAPI or Starlette would answer (an unknown route 404,
a wrong method 405, a validation error, an exception) OpenAI's error shape.
"""

from __future__ import annotations

import json
import logging
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from specjax.serve.responses import error_body

log = logging.getLogger("specjax.serve")

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # 8 MiB: a long prompt's JSON, not a flood
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")  # printable ASCII without spaces
HTTP_CODES = {400: "bad_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def check_api_key(api_key) -> None:
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError(f"api_key must be None (no key) or a non-empty string, got {api_key!r}")


async def _send_error(
    send, status: int, message: str, code: str | None, param: str | None = None, headers=()
):
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps(error_body(message, kind, param, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """The checks above, as a pure ASGI middleware (it reads the body itself, counting)."""

    def __init__(self, app, *, api_key: str | None, open_paths: tuple[str, ...], max_request_bytes: int):
        self.app, self.api_key, self.open_paths = app, api_key, open_paths
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id")
        if request_id is not None:
            if not REQUEST_ID.fullmatch(request_id):
                message = (
                    f"the X-Request-Id header must be 1 to 200 printable ASCII characters without "
                    f"spaces, got {request_id[:80]!r}"
                )
                return await _send_error(send, 400, message, "bad_request", "X-Request-Id")
            send = _echoing(send, request_id)
        if self.api_key is not None and scope["method"] != "OPTIONS" and scope["path"] not in self.open_paths:
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                what = "no API key" if not given else "a wrong API key"
                message = f"the request has {what}: send the header 'Authorization: Bearer <key>'"
                www = [(b"www-authenticate", b"Bearer")]
                return await _send_error(send, 401, message, "invalid_api_key", headers=www)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await _send_error(
                    send, 400, f"Content-Length {length!r} is not a number", "bad_request"
                )
            if int(length) > self.max_request_bytes:
                return await self._too_large(send, f"its Content-Length is {int(length)} bytes")
        body, more, disconnected = [], True, False
        size = 0
        while more:  # (a GET's empty body too: one message)
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return await self._too_large(send, f"it is over {self.max_request_bytes} bytes")
            body.append(chunk)
            more = message.get("more_body", False)
        if disconnected:
            return None
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _too_large(self, send, why: str):
        message = (
            f"the request body is too large: {why}, the server takes at most {self.max_request_bytes} "
            "bytes (--max-request-bytes)"
        )
        # (the rest of the body is not read: the connection closes after the answer)
        return await _send_error(send, 413, message, "request_too_large", headers=[(b"connection", b"close")])


def _echoing(send, request_id: str):
    async def send_with_id(message):
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"x-request-id" for name, _ in headers):
                headers.append((b"x-request-id", request_id.encode()))
            message = {**message, "headers": headers}
        await send(message)

    return send_with_id


def _replay(body: bytes, receive):
    """A receive that gives the body read, then waits on the connection (for a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error shape for what FastAPI and Starlette answer themselves."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        status = error.status_code
        if status == 404:
            message = f"no route {request.method} {request.url.path} on this server"
        elif status == 405:
            allowed = (error.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        else:
            message = str(error.detail)
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = error_body(message, kind, None, HTTP_CODES.get(status))
        return JSONResponse(body, status_code=status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        where = [str(part) for part in first.get("loc", ()) if part not in ("body", "path", "query")]
        param = ".".join(where) or None
        message = f"{param or 'the request'}: {first.get('msg', 'is not valid')}"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("a request failed: %s %s", request.method, request.url.path)
        message = f"the server failed on the request: {error!r}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)
