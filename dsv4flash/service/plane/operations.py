"""Operation ids for every queued request, per-tenant bounded admission, and polling.

Each accepted request becomes an `Operation` (a pollable id, the tenant that owns it, a future of its result).
A tenant may hold at most `max_pending` unfinished operations: one more is refused (HTTP 429, which the SDK
retries with back-off), so a client flooding the server gets backpressure instead of unbounded memory.
Finished results stay retrievable for `keep_s` seconds (a client reconnecting after a network drop polls again
and gets them); after that, and for ids the server never issued or lost in a restart, polling answers 410
(the SDK's "promise gone": resubmit).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


class QueueFull(Exception):
    """A tenant's bounded queue has no room (HTTP 429)."""


class UnknownOperation(KeyError):
    """No such operation for this tenant (never issued, expired, or another tenant's)."""


@dataclass
class Operation:
    """One queued request: its id, owner, kind, the future of its result and an encoder for the wire."""

    request_id: str
    tenant: str
    kind: str
    future: concurrent.futures.Future
    encode: Callable[[Any], Any]
    cancel: Callable[[], bool] | None = None  # stops a running call too (APIFuture.cancel); else future.cancel
    created: float = field(default_factory=time.time)
    finished: float | None = None


class OperationTable:
    """request id -> Operation, with per-tenant bounds and retention of finished results."""

    def __init__(self, *, max_pending: int = 64, keep_s: float = 3600.0) -> None:
        self.max_pending = int(max_pending)
        self.keep_s = float(keep_s)
        self._ops: dict[str, Operation] = {}
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()
        self._epoch = secrets.token_hex(4)  # ids from before a restart can never collide with new ones
        self._seq = itertools.count(1)

    def admit(self, tenant: str, kind: str) -> str:
        """Reserve a slot in the tenant's queue -> a fresh request id; QueueFull when it has none."""
        with self._lock:
            self._expire_locked()
            self._require_room_locked(tenant)
            self._pending[tenant] = self._pending.get(tenant, 0) + 1
            return f"{kind}-{self._epoch}-{next(self._seq)}"

    def require_room(self, tenant: str) -> None:
        """QueueFull when the tenant's queue is full (checked before decoding a request: a refusal costs little)."""
        with self._lock:
            self._require_room_locked(tenant)

    def _require_room_locked(self, tenant: str) -> None:
        if self._pending.get(tenant, 0) >= self.max_pending:
            raise QueueFull(f"tenant {tenant!r} has {self.max_pending} unfinished requests (the per-tenant bound); "
                            f"retry after some finish")

    def attach(self, request_id: str, tenant: str, kind: str, future: concurrent.futures.Future,
               encode: Callable[[Any], Any], cancel: Callable[[], bool] | None = None) -> Operation:
        """Bind an admitted id to its running future (`cancel`: how to stop it, if not `future.cancel`)."""
        op = Operation(request_id, tenant, kind, future, encode, cancel)
        with self._lock:
            self._ops[request_id] = op
        future.add_done_callback(lambda _f: self._finish(op))
        return op

    def release(self, tenant: str) -> None:
        """Give back an admitted slot whose request was refused before it ran."""
        with self._lock:
            self._pending[tenant] = max(0, self._pending.get(tenant, 0) - 1)

    def get(self, request_id: str, tenant: str) -> Operation:
        """The tenant's operation; UnknownOperation otherwise (another tenant's ids look unknown)."""
        with self._lock:
            op = self._ops.get(request_id)
        if op is None or op.tenant != tenant:
            raise UnknownOperation(request_id)
        return op

    def forget(self, request_id: str, tenant: str) -> None:
        """Drop a finished operation whose result its client has fetched (retrieve_futures acks); else no-op."""
        with self._lock:
            op = self._ops.get(request_id)
            if op is not None and op.tenant == tenant and op.finished is not None:
                del self._ops[request_id]

    def pending(self, tenant: str) -> int:
        """Unfinished operations of a tenant."""
        with self._lock:
            return self._pending.get(tenant, 0)

    def cancel(self, request_id: str, tenant: str) -> bool:
        """Cancel an operation: a queued one never runs, a running one stops at its next step -> whether it will."""
        op = self.get(request_id, tenant)
        return (op.cancel or op.future.cancel)()

    def _finish(self, op: Operation) -> None:
        from dsv4flash.lifecycle.faults import crashpoint

        # Test hook: die with the work done but not yet acknowledged (DSV4FLASH_CRASH_AT=serve.<kind>.done).
        crashpoint(f"serve.{op.kind}.done")
        with self._lock:
            op.finished = time.time()
            self._pending[op.tenant] = max(0, self._pending.get(op.tenant, 0) - 1)

    def _expire_locked(self) -> None:
        cutoff = time.time() - self.keep_s
        for rid in [r for r, op in self._ops.items() if op.finished is not None and op.finished < cutoff]:
            del self._ops[rid]
