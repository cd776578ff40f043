"""The cache tiers in one object: disk (blob store) → CPU cache → device slots, with backpressure.

`AdapterCache.acquire(ref)` never blocks and never fails for lack of capacity. It returns a `Lease`:
  READY    the revision is in a device slot (`lease.slot`),
  LOADING  a slot was assigned and the cold load is running in the loader pool,
  QUEUED   every slot is held by an in-flight request; the lease waits in FIFO order and is
           dispatched when a holder releases (backpressure as a state, not an error; with `max_queue`
           the queue is bounded and one more request raises `SlotQueueFull` with a retry-after estimate),
  FAILED   the load raised (integrity, base mismatch…); `wait()` re-raises it.
Cold loads of several missing adapters run concurrently in a thread pool (read, hash, unpack and
device copy of different adapters overlap); `workers=1` gives the serial baseline. Every load is
accounted (`LoadAccount`: source tier, bytes, tensors, queued/read/unpack/device ms, and the loading
thread's CPU ms and waits for a core); `hits` counts every acquire by the tier that served it (resident, cpu, disk).
`prepare(loaded)` (optional) turns a revision read from the CPU tier into what the slot holds (the serving
path decodes the adapter and its placement there, in the loader pool) -> (tensors, meta); `lease.meta` is
that meta.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from dsv4flash.lifecycle.cpu_cache import CpuCache
from dsv4flash.lifecycle.errors import LifecycleError, SlotQueueFull
from dsv4flash.lifecycle.fingerprint import BaseFingerprint
from dsv4flash.lifecycle.loader import LoadAccount, LoadedRevision, read_revision_blob, thread_core_wait_ms
from dsv4flash.lifecycle.slots import SlotPool
from dsv4flash.lifecycle.store import AdapterStore

__all__ = ["AdapterCache", "Lease", "LeaseState"]


class LeaseState(str, enum.Enum):
    """Where a request for an adapter stands."""

    READY = "ready"
    LOADING = "loading"
    QUEUED = "queued"
    FAILED = "failed"
    RELEASED = "released"


@dataclass
class _Slot:
    revision: str | None = None
    refcount: int = 0
    future: Future | None = None
    last_used: float = 0.0
    meta: Any = None


class Lease:
    """A hold on one revision in a device slot; release it when the request finishes."""

    def __init__(self, cache: "AdapterCache", revision: str):
        self._cache = cache
        self.revision = revision
        self.slot: int | None = None
        self.future: Future | None = None
        self.account: LoadAccount | None = None
        self._queued_at: float | None = None
        self._released = False
        self._dispatched = threading.Event()

    @property
    def meta(self) -> Any:
        """What `prepare` returned beside the tensors (None without `prepare`); valid once READY."""
        return self._cache._slots[self.slot].meta

    def tensors(self) -> dict:
        """The slot's tensors (valid once READY, until released)."""
        return self._cache.slots.view(self.slot)

    @property
    def state(self) -> LeaseState:
        """Current state (see module docstring)."""
        if self._released:
            return LeaseState.RELEASED
        if self.future is None:
            return LeaseState.QUEUED
        if not self.future.done():
            return LeaseState.LOADING
        return LeaseState.FAILED if self.future.exception() is not None else LeaseState.READY

    def wait(self, timeout: float | None = None) -> int:
        """Block until READY and return the slot index (re-raises a failed load)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._dispatched.wait(timeout):
            raise TimeoutError(f"revision {self.revision[:12]} still queued for a device slot after {timeout}s")
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.future.result(remaining)
        return self.slot

    def release(self) -> None:
        """Give the slot back (idempotent); a queued lease leaves the queue."""
        self._cache._release(self)

    def __enter__(self) -> "Lease":
        self.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({self.revision[:12]}, {self.state.value}, slot={self.slot})"


class AdapterCache:
    """Disk → CPU → device-slot residency for adapter revisions of one base."""

    def __init__(
        self,
        store: AdapterStore,
        slots: SlotPool,
        *,
        cpu_budget_bytes: int,
        workers: int = 4,
        verify: bool = True,
        resident_base: BaseFingerprint | None = None,
        cpu_max_entries: int | None = None,
        max_queue: int | None = None,
        prepare: Callable[[LoadedRevision], tuple[dict, Any]] | None = None,
    ):
        self.store = store
        self.slots = slots
        self.cpu = CpuCache(cpu_budget_bytes, cpu_max_entries)
        self.max_queue = max_queue
        self.prepare = prepare
        self.hits: Counter = Counter()  # acquires by the tier that served them: resident / cpu / disk
        self.loading = 0  # slot loads running now
        self.loading_peak = 0  # the most that ever ran at once (> 1: loads overlapped)
        self.verify = verify
        self.resident_base = resident_base
        self.accounts: list[LoadAccount] = []
        self._pin = slots.device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="adapter-load")
        self._lock = threading.RLock()
        self._slots = [_Slot() for _ in range(slots.num_slots)]
        self._by_rev: dict[str, int] = {}
        self._queue: deque[Lease] = deque()
        self._cpu_inflight: dict[str, Future] = {}

    # ---- public API ----
    def acquire(self, ref: str) -> Lease:
        """Request a revision in a device slot; returns at once with a READY/LOADING/QUEUED lease."""
        with self._lock:  # a revision id already in a slot needs no catalog query (the hot path of serving)
            known = ref in self._by_rev
        rev = ref if known else self.store.resolve(ref).id
        lease = Lease(self, rev)
        with self._lock:
            if not self._attach(lease):
                idx = self._free_slot()
                if idx is None:
                    if self.max_queue is not None and len(self._queue) >= self.max_queue:
                        raise SlotQueueFull(f"all {len(self._slots)} adapter slots are busy and {len(self._queue)} "
                                            f"requests already wait for one (the queue holds {self.max_queue})",
                                            self._retry_after())
                    lease._queued_at = time.perf_counter()
                    self._queue.append(lease)
                else:
                    self._assign(idx, lease)
        return lease

    def acquire_many(self, refs: Iterable[str]) -> list[Lease]:
        """`acquire` for each ref; missing adapters load concurrently."""
        return [self.acquire(r) for r in refs]

    def prefetch(self, refs: Iterable[str]) -> list[Future]:
        """Bring revisions into the CPU tier in the background (no slot taken)."""
        return [self._cpu_future(self.store.resolve(r).id) for r in refs]

    def prewarm(self, refs: Iterable[str]) -> list[Future]:
        """Load revisions into device slots and leave them resident but evictable."""
        out = []
        for lease in self.acquire_many(refs):
            done: Future = Future()

            def finish(lease=lease, done=done):
                try:
                    done.set_result(lease.wait())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                    done.set_exception(exc)
                finally:
                    lease.release()

            threading.Thread(target=finish, daemon=True, name="adapter-prewarm").start()
            out.append(done)
        return out

    def _retry_after(self) -> float:
        """Seconds until a queued request is likely to get a slot: the queue's share of the recent load times."""
        recent = [a.total_ms for a in self.accounts[-32:]] or [1000.0]
        per_load_s = sum(recent) / len(recent) / 1e3
        return max(1.0, round(per_load_s * (len(self._queue) + 1) / max(1, len(self._slots)), 1))

    def pin_cpu(self, ref: str) -> None:
        """Keep a revision in the CPU tier regardless of LRU (e.g. the `prod` tag)."""
        self.cpu.pin(self.store.resolve(ref).id)

    def resident(self) -> dict[int, str]:
        """Slot index -> revision id of ready or loading slots."""
        with self._lock:
            return {i: s.revision for i, s in enumerate(self._slots) if s.revision is not None}

    def queued(self) -> int:
        """Requests waiting for a slot."""
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        """Stop the loader pool (running loads finish)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "AdapterCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- slot bookkeeping (caller holds the lock) ----
    def _attach(self, lease: Lease) -> bool:
        idx = self._by_rev.get(lease.revision)
        if idx is None:
            return False
        slot = self._slots[idx]
        slot.refcount += 1
        lease.slot, lease.future = idx, slot.future
        if lease.account is None:
            done = slot.future.done() and slot.future.exception() is None
            lease.account = LoadAccount(lease.revision, "resident") if done else None
            if done:
                self.hits["resident"] += 1
        lease._dispatched.set()
        return True

    def _free_slot(self) -> int | None:
        best, best_used = None, None
        for i, s in enumerate(self._slots):
            if s.revision is None:
                return i
            if s.refcount == 0 and s.future is not None and s.future.done() and (best_used is None or s.last_used < best_used):
                best, best_used = i, s.last_used
        return best

    def _assign(self, idx: int, lease: Lease) -> None:
        slot = self._slots[idx]
        if slot.revision is not None:
            self._by_rev.pop(slot.revision, None)
        queued_ms = 0.0 if lease._queued_at is None else (time.perf_counter() - lease._queued_at) * 1e3
        slot.revision, slot.refcount = lease.revision, 1
        slot.future = self._pool.submit(self._load_into_slot, idx, lease, queued_ms)
        self._by_rev[lease.revision] = idx
        lease.slot, lease.future = idx, slot.future
        lease._dispatched.set()

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._released:
                return
            lease._released = True
            if lease.future is None:  # still queued
                self._queue.remove(lease)
                return
            slot = self._slots[lease.slot]
            if slot.revision == lease.revision and slot.future is lease.future:  # not reset by a failed load
                slot.refcount -= 1
                slot.last_used = time.monotonic()
            self._dispatch()

    def _dispatch(self) -> None:
        while self._queue:
            lease = self._queue[0]
            if self._attach(lease):
                self._queue.popleft()
                continue
            idx = self._free_slot()
            if idx is None:
                return
            self._queue.popleft()
            self._assign(idx, lease)

    # ---- loading (runs in the pool) ----
    def _cpu_future(self, rev: str) -> Future:
        return self._pool.submit(self._get_cpu, rev)

    def _get_cpu(self, rev: str) -> tuple[LoadedRevision, str]:
        """CPU-tier hit, or read from disk — coalescing concurrent reads of the same revision."""
        with self._lock:
            hit = self.cpu.get(rev)
            if hit is not None:
                return hit, "cpu"
            pending = self._cpu_inflight.get(rev)
            if pending is None:
                # Registered only by a thread that is already running the read, so waiters never
                # wait on a task still sitting in the pool queue (no deadlock with workers=1).
                pending = self._cpu_inflight[rev] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            if not self.store.blobs.exists(rev):
                raise LifecycleError(f"revision {rev[:12]} is registered but its bytes are missing from {self.store.blobs.root}")
            loaded = read_revision_blob(self.store.blobs, rev, verify=self.verify, pin_memory=self._pin, resident_base=self.resident_base)
            self.cpu.put(loaded)
            pending.set_result((loaded, "disk"))
            return loaded, "disk"
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                self._cpu_inflight.pop(rev, None)

    def _load_into_slot(self, idx: int, lease: Lease, queued_ms: float) -> int:
        t0, cpu0, wait0 = time.perf_counter(), time.thread_time(), thread_core_wait_ms()
        with self._lock:
            self.loading += 1
            self.loading_peak = max(self.loading_peak, self.loading)
        try:
            return self._load_timed(idx, lease, queued_ms, (t0, cpu0, wait0))
        finally:
            with self._lock:
                self.loading -= 1

    def _load_timed(self, idx: int, lease: Lease, queued_ms: float, start: tuple[float, float, float]) -> int:
        t0, cpu0, wait0 = start
        try:
            loaded, source = self._get_cpu(lease.revision)
            t1 = time.perf_counter()
            manifest = loaded.manifest
            scaling = (manifest.alpha / manifest.rank) if manifest.alpha and manifest.rank else 1.0
            tensors, meta = self.prepare(loaded) if self.prepare is not None else (loaded.tensors, None)
            self.slots.write(idx, tensors, scaling, source=f"revision {lease.revision[:12]}")
            with self._lock:
                self._slots[idx].meta = meta
            t2 = time.perf_counter()
        except BaseException:
            with self._lock:
                slot = self._slots[idx]
                if slot.revision == lease.revision:
                    self._by_rev.pop(lease.revision, None)
                    slot.revision, slot.refcount = None, 0
                self._dispatch()
            raise
        acct = LoadAccount(lease.revision, source, loaded.nbytes, len(loaded.tensors), queued_ms=queued_ms,
                           read_ms=loaded.account.read_ms if source == "disk" else 0.0,
                           unpack_ms=loaded.account.unpack_ms if source == "disk" else 0.0,
                           device_ms=(t2 - t1) * 1e3, total_ms=queued_ms + (t2 - t0) * 1e3,
                           cpu_ms=(time.thread_time() - cpu0) * 1e3, core_wait_ms=thread_core_wait_ms() - wait0)
        with self._lock:
            self.accounts.append(acct)
            del self.accounts[:-10000]  # a long-running server keeps the recent ones
            self.hits[source] += 1
            lease.account = acct
        return idx
