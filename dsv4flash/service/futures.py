"""Futures and per-client ordered execution: every call returns an `APIFuture`; a client's calls run in
submission order on its own worker thread (the resident base serialises compute across clients)."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    """A pending result: `.result(timeout)` blocks, `await .result_async()` does not."""

    def __init__(self, future: Future, request_id: str) -> None:
        self._future = future
        self.request_id = request_id

    def result(self, timeout: float | None = None) -> T:
        """The value (re-raises the call's error)."""
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        """Await the value without blocking the event loop."""
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def done(self) -> bool:
        """Whether the call has finished."""
        return self._future.done()

    @property
    def future(self) -> Future:
        """The underlying `concurrent.futures.Future` (what a server polls or awaits)."""
        return self._future

    def __await__(self):
        return self.result_async().__await__()


class OrderedExecutor:
    """One worker thread running submitted calls strictly in submission order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"dsv4flash-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> APIFuture:
        """Queue `fn(*args, **kwargs)`; the request id is `<name>:<seq>` (deterministic per client)."""
        fut: Future = Future()
        with self._lock:
            self._seq += 1
            request_id = f"{self.name}:{self._seq}"
            self._queue.put((fut, fn, args, kwargs))
        return APIFuture(fut, request_id)

    def _loop(self) -> None:
        while True:
            fut, fn, args, kwargs = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller sees it from .result()
                fut.set_exception(exc)
