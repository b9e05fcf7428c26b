"""AsyncLLMEngine: one background thread drives ``LLMEngine.step``; requests stream over asyncio.

Only the engine thread touches the LLMEngine. Callers submit work (add a request, abort one,
read a statistic) as commands on a queue; the thread runs them between steps, so a request
added while a batch runs joins the next step, and the event loop never blocks on the model.
Each request has a ``RequestStream`` that the engine thread fills through
``loop.call_soon_threadsafe``. A stream holds one unread output: a cumulative output replaces
the one before it, a ``DELTA`` output is added to it, so a slow consumer skips intermediate
states and loses nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedllm.config import EngineArgs
from pagedllm.core.outputs import RequestOutput
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Default bound of the waiting queue: well above what a batch of max_num_seqs drains quickly.
DEFAULT_MAX_WAITING_REQUESTS = 4096


class EngineError(RuntimeError):
    """The engine failed while running a request; the request has been aborted."""


class EngineDeadError(EngineError):
    """The engine is unusable (a failed step left it inconsistent, or it was shut down)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class RequestStream:
    """The outputs of one request, filled by the engine thread and read on the caller's loop.

    One output waits to be read: a newer cumulative output replaces it, a newer delta
    (``deltas``: the request's output_kind is DELTA) is added to it. An error is final.
    ``abort()`` is idempotent and does nothing once the request has finished.
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        on_abort: Callable[[RequestStream], None],
        deltas: bool = False,
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self.deltas = deltas
        self.finished = False  # the final output has been read
        self._on_abort = on_abort
        self._aborted = False
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._item, BaseException):
            return
        pending = self._item
        if self.deltas and isinstance(pending, RequestOutput) and isinstance(item, RequestOutput):
            pending.add(item)
        else:
            self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        assert item is not None
        self.finished = item.finished
        return item

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the final one; leaving early aborts the request."""
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished and not self._aborted:
            self._aborted = True
            self._on_abort(self)


@dataclass
class _Command:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


_STOP = object()  # queue sentinel that ends the engine thread


class AsyncLLMEngine:
    """An LLMEngine behind a background thread, with per-request async output streams.

    ``generate(prompt, params, request_id)`` is an async iterator of RequestOutputs (see above);
    leaving it early (break, cancellation, client disconnect) aborts the request and frees its
    KV blocks. A failed step fails every in-flight request with EngineError.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}.")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dead_error: BaseException | None = None
        # Called once, on the engine thread, when a failure (not shutdown) kills the engine.
        self.on_dead: Callable[[BaseException], None] | None = None

    @classmethod
    def from_engine_args(
        cls, args: EngineArgs, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    ) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args), max_waiting_requests)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """Request defaults from the model's generation_config.json (see LLMEngine)."""
        return self.engine.sampling_defaults

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is dead: {self.dead_error}")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run_loop, name="pagedllm-engine", daemon=True
                )
                self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread, fail whatever is still running, release the model."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_STOP)
            thread.join()
        if self.dead_error is None:
            self.dead_error = EngineDeadError("the engine was shut down")
        self.engine.shutdown()

    # ---- requests ------------------------------------------------------------------------
    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run fn(engine) on the engine thread between steps (thread-safe, for any caller)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead_error}")
        self.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_Command(fn, future))
        if self._thread is not None and not self._thread.is_alive():
            self._reject_queued()  # the thread ended between the check and the put
        return future

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Queue a request; iterate ``stream.outputs()`` for its results.

        Raises ValueError (bad request), EngineOverloadedError (queue full) or EngineDeadError.
        """
        deltas = sampling_params.output_kind == RequestOutputKind.DELTA
        stream = RequestStream(
            request_id, asyncio.get_running_loop(), self._abort_later, deltas=deltas
        )
        added = self.submit(
            lambda engine: self._add(
                engine, stream, prompt, sampling_params, arrival_time, lora_request
            )
        )
        try:
            await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            stream.abort()  # the add may still run; the abort queued behind it undoes it
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes: everything so far each
        time, or with output_kind DELTA what came since the output before.

        Leaving the iteration early (break, cancellation) aborts the request.
        """
        stream = await self.add_request(
            request_id, prompt, sampling_params, arrival_time, lora_request
        )
        async with contextlib.aclosing(stream.outputs()) as outputs:
            async for out in outputs:
                yield out

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its stream ends with EngineError('aborted')."""

        def abort(engine: LLMEngine) -> None:
            stream = self._streams.get(request_id)
            if stream is not None:
                self._abort(engine, stream)
                stream.put_threadsafe(EngineError(f"request {request_id} was aborted"))

        await asyncio.wrap_future(self.submit(abort))

    def _add(
        self,
        engine: LLMEngine,
        stream: RequestStream,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None,
        lora_request: Any = None,
    ) -> None:
        waiting = engine.scheduler_stats().num_waiting
        if waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {waiting} requests are already waiting "
                f"(--max-waiting-requests {self.max_waiting_requests}); retry later."
            )
        engine.add_request(stream.request_id, prompt, params, arrival_time, lora_request)
        self._streams[stream.request_id] = stream

    def _abort_later(self, stream: RequestStream) -> None:
        try:
            self.submit(lambda engine: self._abort(engine, stream))
        except EngineDeadError:
            pass  # a dead engine has dropped every request already

    def _abort(self, engine: LLMEngine, stream: RequestStream) -> None:
        # By identity: a stream whose add failed leaves another request of the same id alone.
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            engine.abort_request(stream.request_id)

    # ---- the engine thread ---------------------------------------------------------------
    def _run_loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a crashed thread must not look alive
            logger.exception("the engine thread crashed")
            self._die(e)
        self._reject_queued()

    def _serve(self) -> None:
        """Run commands and steps until shut down or dead."""
        engine = self.engine
        while self.dead_error is None:
            ran = self._run_commands(block=not engine.has_unfinished_requests())
            if ran is None:
                self.dead_error = EngineDeadError("the engine was shut down")
                self._fail_all(self.dead_error)
                break
            if engine.has_unfinished_requests():
                self._step()
            elif ran:
                engine.step()  # nothing to run: records fresh gauges after aborts

    def _reject_queued(self) -> None:
        """Commands that arrived after the loop ended fail instead of waiting forever."""
        error = EngineDeadError(f"the engine is dead: {self.dead_error}")
        while True:
            try:
                cmd = self._commands.get(block=False)
            except queue.Empty:
                return
            if isinstance(cmd, _Command) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(error)

    def _run_commands(self, block: bool) -> int | None:
        """Run queued commands (waiting for one if block); None when asked to stop."""
        ran = 0
        while True:
            try:
                cmd = self._commands.get(block=block and ran == 0)
            except queue.Empty:
                return ran
            if cmd is _STOP:
                return None
            assert isinstance(cmd, _Command)
            ran += 1
            if not cmd.future.set_running_or_notify_cancel():
                continue  # the caller gave up before the command ran
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception(
                "engine step failed; failing the %d running requests", len(self._streams)
            )
            self._fail_all(EngineError(f"the engine failed while running this request: {e!r}"))
            return
        lost = self.engine.executor.dead_error
        if lost is not None:  # dead before any client hears of it: /health says so by then
            self.dead_error = lost
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if out.error is not None:  # the engine ended the request with finish_reason "error"
                stream.put_threadsafe(EngineError(f"the request failed: {out.error}"))
            else:
                stream.put_threadsafe(out)
        if lost is not None:  # no step can run again: every later request would fail too
            self._die(lost)

    def _fail_all(self, error: EngineError) -> None:
        """Fail and abort every in-flight request; a state that stays broken kills the engine."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_threadsafe(error)
        try:
            self.engine.abort_request(list(self.engine.requests))
            self.engine.check_integrity()
        except Exception as e:
            logger.exception("the engine is inconsistent after a failure")
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """The engine's state is unknown: refuse all work from now on and say so."""
        self.dead_error = error
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put_threadsafe(EngineDeadError(f"the engine is dead: {error!r}"))
        if self.on_dead is not None:
            try:
                self.on_dead(error)
            except Exception:
                logger.exception("the on_dead callback failed")
