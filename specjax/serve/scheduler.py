"""The one thread that drives the engine, and the channel from it to each HTTP request.

The engine is not thread-safe and its `step()` blocks while the device runs a chunk of the
compiled loop, so it lives on a thread of its own. HTTP handlers (on the asyncio event loop)
never touch it: they put requests and aborts in the scheduler's inbox, a thread-safe queue, and
read their request's Updates from an asyncio queue that the scheduler fills through
`loop.call_soon_threadsafe`. The scheduler loop:

    take everything in the inbox: engine.add each new request (its id or its ValueError goes
        back to the handler), engine.abort each request whose client went away
    engine.step() while the engine has work (else wait for the inbox)
    hand each Update to its request's queue, and count it in the metrics

Overload: at most `max_batch + max_waiting` requests are open at once (in a slot, waiting for
one, or on their way to the engine), so at most `max_waiting` wait once the slots are full.
`submit` refuses the next one at once with `Overloaded` (HTTP 503), on the caller's thread: a
request is never queued without bound, and a refusal does not wait for the engine's chunk.

Failures stay with the requests they concern where the engine's interface lets us tell: a
request that engine.add refuses or fails on ends alone, and a failed engine.step() is recovered
from as `_recover` describes; the thread itself stops only on a bug of its own (then /health
answers 503 and new requests are refused).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from specjax.checks import check_int
from specjax.serve.metrics import ServerMetrics

log = logging.getLogger("specjax.serve")

IDLE_WAIT_S = 0.1  # how often an idle scheduler looks up from its inbox (to notice stop())


class EngineError(RuntimeError):
    """The engine failed on a request (HTTP 500)."""


class Unavailable(EngineError):
    """The server cannot take or finish the request: it is stopping, or its scheduler died (HTTP 503)."""


class Overloaded(Unavailable):
    """max_waiting requests wait for a slot already (HTTP 503: retry later)."""


class RequestStream:
    """One request on its way through the scheduler: made by the HTTP handler (on the event
    loop), then filled by the scheduler thread."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        self.request = request  # an engine Request
        self.loop = loop
        self.admitted: asyncio.Future = loop.create_future()  # the engine's request id, or its error
        self.updates: asyncio.Queue = asyncio.Queue()  # Updates, then possibly an exception
        self.arrival = time.monotonic()
        # The scheduler thread's own bookkeeping.
        self.request_id: int | None = None
        self.last_tokens_at: float | None = None
        self.reported = False  # an Update came: the request is (or was) in a slot
        self.failed_steps = 0  # failed engine steps in a row it was in (see Scheduler._recover)
        self.closed = False  # finished, refused or failed: no longer counted as open

    # Called on the scheduler thread: each hands a value over to the event loop.

    def _hand_over(self, callback, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed (the server stopped): no one is listening
            pass

    def admit(self, request_id: int) -> None:
        self.request_id = request_id
        self._hand_over(_settle, self.admitted, request_id, None)

    def reject(self, error: Exception) -> None:
        self._hand_over(_settle, self.admitted, None, error)

    def put(self, update) -> None:
        self._hand_over(self.updates.put_nowait, update)

    def fail(self, error: EngineError) -> None:
        """End the request with an error (admitted or not)."""
        self.reject(error)
        self._hand_over(self.updates.put_nowait, error)

    # Called on the event loop.

    async def next_update(self):
        """The next Update; raises the error the scheduler ended the request with."""
        item = await self.updates.get()
        if isinstance(item, BaseException):
            raise item
        return item


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # cancelled: the handler stopped waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def check_max_waiting(max_waiting) -> None:
    check_int("max_waiting", max_waiting, 0)


class Scheduler:
    """Owns the engine on a background thread; `submit` and `abort` may be called from anywhere.

    max_waiting: how many requests may wait for one of the engine's `max_batch` slots; `submit`
    refuses more with Overloaded."""

    def __init__(self, engine, metrics: ServerMetrics, max_waiting: int):
        check_max_waiting(max_waiting)
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add" | "abort", RequestStream) or None
        self._streams: dict[int, RequestStream] = {}  # by engine request id, until finished
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the thread, if it died
        # Requests submitted and not yet closed, and whether submit takes more; under the lock,
        # as submit runs on the event loop and closing on the scheduler thread.
        self._lock = threading.Lock()
        self._num_open = 0
        self._accepting = True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specjax-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the chunk in progress, end every open request with an error, and join."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet finished, refused or failed."""
        return self._num_open

    def submit(self, stream: RequestStream) -> None:
        """Queue a request for the engine; raises Overloaded when max_waiting requests wait for
        a slot already, Unavailable when the scheduler is stopping or has stopped."""
        max_batch = self.engine.max_batch
        with self._lock:
            if not (self._accepting and self.alive):
                raise Unavailable("the server is not taking requests: it is shutting down or has failed")
            if self._num_open >= max_batch + self.max_waiting:
                self.metrics.rejected()
                raise Overloaded(
                    f"the server is overloaded: its {max_batch} slots are taken and max_waiting="
                    f"{self.max_waiting} requests wait for one already; retry later (with backoff), or "
                    "start the server with a larger --max-waiting or --max-batch"
                )
            self._num_open += 1
            self._inbox.put(("add", stream))

    def abort(self, stream: RequestStream) -> None:
        self._inbox.put(("abort", stream))

    # ---- on the scheduler thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._take_inbox(wait=not self.engine.has_work)
                if self.engine.has_work:
                    self._step()
                self.metrics.set_queue(self.engine.num_running, self.engine.num_waiting)
                cache = self.engine.kv_cache
                usage = cache.usage(self.engine.num_running)
                self.metrics.set_cache(usage, self.engine.stats.preemptions, *cache.prefix_counts)
            self._shut_down(Unavailable("the server is shutting down"))
        except BaseException as error:  # a bug here: fail the open requests, /health reports it
            self.error = error
            log.exception("the scheduler thread stopped")
            self._shut_down(Unavailable(f"the server's scheduler stopped: {error!r}"))
            raise

    def _take_inbox(self, wait: bool) -> None:
        """Handle every message in the inbox; when `wait`, wait a little for the first."""
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if wait else self._inbox.get_nowait()
            while item is not None:  # None: stop() was called
                self._handle(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _close(self, stream: RequestStream) -> None:
        """The request no longer counts against max_waiting (once, however it ended)."""
        if not stream.closed:
            stream.closed = True
            with self._lock:
                self._num_open -= 1

    def _handle(self, kind: str, stream: RequestStream) -> None:
        if kind == "abort":
            if stream.request_id in self._streams:  # else: refused, finished or never admitted
                try:
                    updates = self.engine.abort(stream.request_id)  # its final Update
                except Exception as error:
                    log.exception("engine.abort() failed")
                    self._fail(stream, EngineError(f"the engine failed to abort the request: {error!r}"))
                    return
                for update in updates:
                    self._dispatch(update)
            return
        try:
            request_id = self.engine.add(stream.request)
        except ValueError as error:  # a bad request: the handler answers 400
            self._close(stream)
            stream.reject(error)
            return
        except Exception as error:  # the engine's fault, this request's alone
            log.exception("engine.add() failed")
            self._close(stream)
            stream.reject(EngineError(f"the engine failed to take the request: {error!r}"))
            return
        self._streams[request_id] = stream
        stream.admit(request_id)
        self.metrics.admitted(len(stream.request.prompt))

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception as error:
            log.exception("engine.step() failed")
            self._recover(EngineError(f"the engine failed: {error!r}"))
            return
        for update in updates:
            self._dispatch(update)

    def _recover(self, error: EngineError) -> None:
        """After engine.step() raised. A step admits waiting requests into free slots (a prefill
        each), then runs the batch, and which request broke it is not known; so each open request
        gets one more chance, and a second failed step in a row ends it with the error:

        - a request with Updates (in a slot) stays: if an admission failed, the batch's state is
          as it was; if the batch itself failed, the next step fails too and ends it;
        - a request without Updates (waiting, or admitted by the failed step) is taken back
          (engine.abort) and queued again, at the back, from its start (it has sent nothing yet).
          If the engine no longer has it, the failed step took it from the queue: it is the
          request whose admission failed, and ends."""
        for request_id, stream in list(self._streams.items()):
            stream.failed_steps += 1
            if stream.reported and stream.failed_steps == 1:
                continue
            try:
                taken_back = self.engine.abort(request_id)
            except Exception:  # the engine is past aborting it; it ends here either way
                taken_back = []
            del self._streams[request_id]
            if stream.reported or stream.failed_steps > 1 or not taken_back:
                self._fail(stream, error)
                continue
            try:
                stream.request_id = self.engine.add(stream.request)
            except Exception:
                self._fail(stream, error)
                continue
            self._streams[stream.request_id] = stream

    def _dispatch(self, update) -> None:
        stream = self._streams.get(update.request_id)
        if stream is None:
            return
        now = time.monotonic()
        since_last = None if stream.last_tokens_at is None else now - stream.last_tokens_at
        self.metrics.observe_tokens(len(update.tokens), now - stream.arrival, since_last)
        if update.tokens:
            stream.last_tokens_at = now
        self.metrics.speculated(
            update.num_drafts, update.num_draft_tokens, update.num_accepted_tokens, update.accepted_per_pos
        )
        stream.reported, stream.failed_steps = True, 0  # (a step went through: the count starts again)
        if update.finished:
            del self._streams[update.request_id]
            self._close(stream)
            self.metrics.finished(update.finish_reason, now - stream.arrival)
        stream.put(update)

    def _fail(self, stream: RequestStream, error: EngineError) -> None:
        self._streams.pop(stream.request_id, None)
        self._close(stream)
        stream.fail(error)

    def _shut_down(self, error: Unavailable) -> None:
        """Take no more requests (submit checks under the lock: nothing lands in the inbox after
        this), and end the open ones."""
        with self._lock:
            self._accepting = False
        self._end_all(error)

    def _end_all(self, error: EngineError) -> None:
        """End every open request with `error`, dropping it from the engine."""
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be past helping; the request ends here either way
                pass
            self._fail(stream, error)
        while True:  # requests not yet admitted
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0] == "add":
                self._fail(item[1], error)
