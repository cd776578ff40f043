"""Completion queues of sampling sessions, for the SDK's `/api/v1/retrieve_futures` session poller.

With `sample_use_retrieve_futures` on, a `SamplingClient` does not poll each sample's future: one background
task per (sampling session, clone) long-polls this queue and learns which of its requests finished or failed,
then fetches each payload once with `retrieve_future`. Each queue numbers completions with a cursor; a poll
with `prev_cursor = c` acknowledges everything up to `c` (trimmed here, so a queue holds only what its client
has not yet seen) and gets what finished after it. Bounded by the tenant's request bound: every entry is a
request that was admitted to the tenant's queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading


class CompletionQueue:
    """Finished / failed request ids of one sampling-session clone, in finish order, with a cursor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cursor = 0
        self._done: list[tuple[int, str, bool]] = []  # (cursor, request id, failed)
        self._pending: set[str] = set()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def watch(self, request_id: str, future: concurrent.futures.Future) -> None:
        """Report `request_id` here once `future` finishes."""
        with self._lock:
            self._pending.add(request_id)
        future.add_done_callback(lambda f: self._finish(request_id, f))  # may run at once: outside the lock

    def _finish(self, request_id: str, future: concurrent.futures.Future) -> None:
        failed = future.cancelled() or future.exception() is not None
        with self._lock:
            if request_id not in self._pending:
                return
            self._pending.discard(request_id)
            self._cursor += 1
            self._done.append((self._cursor, request_id, failed))
            waiters = list(self._waiters)
        for loop, event in waiters:  # runs on a worker thread: wake the long polls on their loop
            loop.call_soon_threadsafe(event.set)

    def poll(self, prev_cursor: int) -> tuple[list[tuple[str, bool]], int]:
        """Acknowledge up to `prev_cursor` -> ([(request id, failed)] after it, the cursor to send back)."""
        with self._lock:
            self._done = [e for e in self._done if e[0] > prev_cursor]
            return [(rid, failed) for _, rid, failed in self._done], max(self._cursor, prev_cursor)

    async def wait(self, prev_cursor: int, timeout: float) -> None:
        """Return once something finished after `prev_cursor`, or after `timeout` seconds."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if any(e[0] > prev_cursor for e in self._done):
                return
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.remove(waiter)
