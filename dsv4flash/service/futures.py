"""Futures and per-client ordered execution: every call returns an `APIFuture`; a client's calls run in
submission order on its own worker thread (the resident base serialises compute across clients)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Generic, TypeVar

from dsv4flash.service.calls import StopToken, running

T = TypeVar("T")


class APIFuture(Generic[T]):
    """A pending result: `.result(timeout)` blocks, `await .result_async()` does not."""

    def __init__(self, future: Future, request_id: str, stop: StopToken | None = None) -> None:
        self._future = future
        self.request_id = request_id
        self.stop = stop or StopToken()

    def result(self, timeout: float | None = None) -> T:
        """The value (re-raises the call's error)."""
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        """Await the value without blocking the event loop."""
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def done(self) -> bool:
        """Whether the call has finished."""
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel a queued call, or stop a running one at its next step (it then fails with `CallCancelled`)."""
        return self._future.cancel() or (not self._future.done() and self.stop.cancel())

    def set_deadline(self, seconds: float | None) -> None:
        """Stop the call (`CallTimedOut`) once it has run `seconds` from its first turn on the base."""
        self.stop.deadline_s = None if seconds is None else float(seconds)

    @property
    def future(self) -> Future:
        """The underlying `concurrent.futures.Future` (what a server polls or awaits)."""
        return self._future

    def __await__(self):
        return self.result_async().__await__()


class OrderedExecutor:
    """Runs submitted calls strictly in submission order on one worker thread.

    The worker exits after `idle_s` seconds without work and a new one starts with the next submission (still
    one at a time), so clients that are no longer used (a sampler per RL step) leave no thread behind.
    """

    def __init__(self, name: str, idle_s: float = 30.0) -> None:
        self.name = name
        self.idle_s = float(idle_s)
        # gate(fn) -> a context manager held while fn runs (a scheduler's turn on the resident base); None: no gate
        self.gate: Callable[[Callable[..., Any]], Any] | None = None
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> APIFuture:
        """Queue `fn(*args, **kwargs)`; the request id is `<name>:<seq>` (deterministic per client)."""
        fut: Future = Future()
        stop = StopToken()
        with self._lock:
            self._seq += 1
            request_id = f"{self.name}:{self._seq}"
            self._queue.put((fut, stop, fn, args, kwargs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"dsv4flash-{self.name}", daemon=True)
                self._thread.start()
        return APIFuture(fut, request_id, stop)

    def _loop(self) -> None:
        while True:
            try:
                fut, stop, fn, args, kwargs = self._queue.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # submit() enqueues under this lock, so nothing can slip in unseen
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with running(stop), self.gate(fn) if self.gate is not None else contextlib.nullcontext():
                    stop.start()
                    stop.check()  # cancelled while it waited for its turn
                    result = fn(*args, **kwargs)
            except BaseException as exc:  # the caller sees it from .result()
                fut.set_exception(exc)
            else:
                fut.set_result(result)  # after the gate: done callbacks never run holding the base
