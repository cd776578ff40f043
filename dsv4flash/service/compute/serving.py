"""The serving path of `dsv4flash serve`: adapters acquired through the lifecycle's tiers, decoded in one batch.

`Serving` ties three things together for every sampling call of the server (the Tinker `sample`, the OpenAI
routes): the tiers (`lifecycle.tiers.AdapterCache`: catalog → CPU cache → `max_loras` device slots, FIFO
queue bounded at `max_queue`, every load accounted), the continuous batcher (`batcher.py`: one pass a step
for every request, whatever its adapter), and the counters `/metrics` reports.

A call waits for its adapter's lease on its own thread (one of `threads`), never on the batcher's: a cold load
runs in the loader pool while every adapter already in a slot keeps decoding, and a request joins the batch
only once its adapter is READY. A request holds its lease (so its slot) until its last token; a slot nobody
holds stays resident until another adapter needs it (LRU), and an evicted adapter is simply loaded again by
the next request (from the CPU tier when it is still there, else from disk). With every slot held and the
queue full, `acquire` raises `SlotQueueFull` (HTTP 429 with Retry-After).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from dsv4flash.service import calls
from dsv4flash.service.calls import StopToken
from dsv4flash.service.compute.batcher import ContinuousBatcher
from dsv4flash.service.futures import APIFuture

COLD_LOAD_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


def decode_loaded(loaded, source: str) -> tuple[dict, object]:
    """A revision read from the store -> (the adapter tensors the resident shell binds, its placement)."""
    from dsv4flash.lifecycle.packed import PackedMoELoRA
    from dsv4flash.lifecycle.revision import decode_adapter
    from dsv4flash.lora import LoraConfig

    adapter = decode_adapter(loaded.tensors, loaded.manifest, source=source)
    tensors = adapter.to_packed_tensors() if isinstance(adapter, PackedMoELoRA) else dict(adapter)
    return tensors, LoraConfig.from_dict(dict(loaded.manifest.extra["placement"]))


@dataclass
class LoadFigure:
    """How a request got its adapter: the tier that served it and the milliseconds it waited for it."""

    tier: str  # resident, cpu or disk ("loading": it joined a load another request started)
    wait_ms: float
    load_ms: float = 0.0  # the load's own time (read + unpack + device copy), 0 for a resident hit

    def as_dict(self) -> dict:
        """JSON form (the per-response cold-load figure)."""
        return {"tier": self.tier, "wait_ms": round(self.wait_ms, 3), "load_ms": round(self.load_ms, 3)}


class Serving:
    """Tiers + batcher + metrics over one `ServiceClient` (its store and resident base)."""

    def __init__(self, service, *, max_loras: int = 8, max_cpu_loras: int | None = 64,
                 cpu_budget_bytes: int = 4 << 30, loader_workers: int = 4, max_queue: int | None = 64,
                 exact: bool = True, max_rows: int = 512, threads: int = 128) -> None:
        from dsv4flash.lifecycle.slots import ExactSlots
        from dsv4flash.lifecycle.tiers import AdapterCache

        self.service = service
        self.cache = AdapterCache(service.store, ExactSlots(max_loras, device="cpu"), cpu_budget_bytes=cpu_budget_bytes,
                                  cpu_max_entries=max_cpu_loras, workers=loader_workers,
                                  resident_base=service.fingerprint(), max_queue=max_queue,
                                  prepare=lambda loaded: decode_loaded(loaded, f"revision {loaded.id[:12]}"))
        self.batcher = ContinuousBatcher(service.base, exact=exact, max_rows=max_rows)
        self.max_loras = max_loras
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dsv4flash-serving")
        # Start every thread now: a burst of calls would otherwise wait on thread creation one by one and reach
        # the batcher spread out, as separate cohorts (one pass each per step) instead of one.
        barrier = threading.Barrier(threads)
        for _ in range(threads):
            self._pool.submit(barrier.wait)
        self._lock = threading.Lock()
        self._cold = [0] * (len(COLD_LOAD_BUCKETS_MS) + 1)
        self._cold_sum = 0.0
        self._counts: Counter = Counter()  # requests, rejected (429)
        self._started = time.perf_counter()

    # ---- calls ----
    def submit(self, fn, *args, **kwargs) -> APIFuture:
        """Run `fn(*args, **kwargs)` as a call on the serving threads (cancel / deadline like a client's call)."""
        fut: Future = Future()
        stop = StopToken()

        def work():
            if not fut.set_running_or_notify_cancel():
                return
            try:
                with calls.running(stop):
                    stop.start()
                    stop.check()
                    result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - the caller sees it from .result()
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        with self._lock:
            self._counts["requests"] += 1
            number = self._counts["requests"]
        self._pool.submit(work)
        return APIFuture(fut, f"serving:{number}", stop)

    @contextmanager
    def adapter(self, revision: str):
        """Hold `revision` in a device slot for the block -> (placement, tensors, LoadFigure)."""
        from dsv4flash.lifecycle.errors import SlotQueueFull

        t0 = time.perf_counter()
        try:
            lease = self.cache.acquire(revision)
        except SlotQueueFull:
            with self._lock:
                self._counts["rejected"] += 1
            raise
        try:
            token = calls.current()
            while True:  # wait in slices, so a cancelled call leaves the queue
                try:
                    lease.wait(timeout=0.5)
                    break
                except TimeoutError:
                    if token is not None:
                        token.check()
            account = lease.account
            wait_ms = (time.perf_counter() - t0) * 1e3
            if account is None:
                figure = LoadFigure("loading", wait_ms)
            else:
                figure = LoadFigure(account.source, wait_ms, 0.0 if account.source == "resident" else account.total_ms)
                if account.source != "resident":
                    self._observe_cold(account.total_ms)
            placement = lease.meta  # what `decode_loaded` returned beside the tensors
            yield placement, lease.tensors(), figure
        finally:
            lease.release()

    def prewarm(self, revisions: list[str]) -> list[dict]:
        """Load revisions into slots now (left resident, evictable) -> per revision its tier and load time."""
        out = []
        leases = [(rev, time.perf_counter(), self.cache.acquire(rev)) for rev in revisions]
        for rev, t0, lease in leases:
            try:
                lease.wait()
                account = lease.account
                tier = account.source if account is not None else "loading"
                load_ms = account.total_ms if account is not None and tier != "resident" else 0.0
                if account is not None and tier != "resident":
                    self._observe_cold(load_ms)
                out.append({"revision": rev, "tier": tier, "load_ms": round(load_ms, 3),
                            "wait_ms": round((time.perf_counter() - t0) * 1e3, 3)})
            finally:
                lease.release()
        return out

    def close(self) -> None:
        """Stop the batcher and the loader pool."""
        self.batcher.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()

    # ---- metrics ----
    def _observe_cold(self, ms: float) -> None:
        with self._lock:
            for i, bound in enumerate(COLD_LOAD_BUCKETS_MS):
                if ms <= bound:
                    self._cold[i] += 1
                    break
            else:
                self._cold[-1] += 1
            self._cold_sum += ms

    def metrics(self) -> str:
        """The serving counters in Prometheus text format."""
        st = self.batcher.stats
        ttft = sorted(t for t in st.ttft_s if t is not None)
        q = (lambda f: ttft[min(len(ttft) - 1, int(f * len(ttft)))] if ttft else 0.0)
        lines = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP dsv4flash_{name} {help_text}")
            lines.append(f"# TYPE dsv4flash_{name} {kind}")
            for labels, value in samples:
                lines.append(f"dsv4flash_{name}{labels} {value:g}" if isinstance(value, float) else
                             f"dsv4flash_{name}{labels} {value}")

        metric("tokens_total", "counter", "Tokens generated by the batcher.", [("", st.tokens)])
        metric("tokens_per_second", "gauge", "Tokens generated per second of batcher work.",
               [("", st.tokens / st.busy_s if st.busy_s else 0.0)])
        metric("decode_steps_total", "counter", "Batched decode passes (one per cohort per step).", [("", st.steps)])
        metric("batch_rows", "gauge", "Rows in the last decode pass.", [("", st.last_rows)])
        metric("batch_occupancy", "gauge", "Mean rows per decode pass.",
               [("", st.rows / st.steps if st.steps else 0.0)])
        metric("adapters_per_batch", "gauge", "Mean distinct adapters per decode pass.",
               [("", st.adapters / st.steps if st.steps else 0.0)])
        metric("adapters_in_last_batch", "gauge", "Distinct adapters in the last decode pass.",
               [("", st.last_adapters)])
        metric("prefills_total", "counter", "Prompt prefills (shared ones counted per request).", [("", st.prefills)])
        metric("shared_prefills_total", "counter", "Requests whose prefill came from a shared encoder pass.",
               [("", st.shared_prefills)])
        metric("adapter_cache_hits_total", "counter", "Adapter acquires by the tier that served them.",
               [(f'{{tier="{tier}"}}', self.cache.hits.get(tier, 0)) for tier in ("resident", "cpu", "disk")])
        with self._lock:
            cold, total = list(self._cold), self._cold_sum
        running, samples = 0, []
        for bound, count in zip(COLD_LOAD_BUCKETS_MS, cold):
            running += count
            samples.append((f'_bucket{{le="{bound}"}}', running))
        running += cold[-1]
        samples += [('_bucket{le="+Inf"}', running), ("_sum", total), ("_count", running)]
        metric("cold_load_ms", "histogram", "Milliseconds of each adapter load into a slot (CPU tier or disk).",
               samples)
        metric("adapter_loads_in_flight", "gauge", "Adapter loads running now, and the most that ran at once.",
               [('{stat="now"}', self.cache.loading), ('{stat="peak"}', self.cache.loading_peak)])
        metric("slot_queue_depth", "gauge", "Requests waiting for a device slot.", [("", self.cache.queued())])
        metric("slots", "gauge", "Device slots (--max-loras) and how many hold an adapter.",
               [('{state="total"}', self.max_loras), ('{state="resident"}', len(self.cache.resident()))])
        metric("cpu_cache_adapters", "gauge", "Adapters in the CPU tier.", [("", len(self.cache.cpu.keys()))])
        metric("requests_live", "gauge", "Requests decoding or waiting to join the batch.", [("", self.batcher.live())])
        metric("requests_total", "counter", "Sampling calls taken.", [("", self._counts["requests"])])
        metric("requests_rejected_total", "counter", "Calls answered 429: the slot queue was full.",
               [("", self._counts["rejected"])])
        metric("time_to_first_token_seconds", "summary", "Submit to first token of recent requests.",
               [('{quantile="0.5"}', float(q(0.5))), ('{quantile="0.99"}', float(q(0.99))),
                ("_count", len(ttft))])
        return "\n".join(lines) + "\n"
