"""Cache tiers: CPU LRU budget, device slot pool, leases with READY/LOADING/QUEUED, accounting, prefetch,
prewarm, pipelined loads, failure isolation; a GPU variant runs the same path on CUDA."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from dsv4flash.lifecycle.cpu_cache import CpuCache
from dsv4flash.lifecycle.errors import AdapterFormatError, BaseMismatchError, IntegrityError
from dsv4flash.lifecycle.loader import LoadAccount, LoadedRevision
from dsv4flash.lifecycle.slots import SlotPool
from dsv4flash.lifecycle.store import AdapterStore
from dsv4flash.lifecycle.tiers import AdapterCache, LeaseState


def _entry(key: str, nbytes: int) -> LoadedRevision:
    return LoadedRevision(key, {}, None, nbytes, LoadAccount(key, "disk"))


def test_cpu_cache_lru_budget_pin_admission():
    c = CpuCache(100)
    for k in "abc":
        assert c.put(_entry(k, 30))
    c.get("a")  # a becomes most recent: b is the LRU now
    assert c.put(_entry("d", 30)) and c.keys() == ["c", "a", "d"] and c.stats.evicted == ["b"]
    c.pin("c")
    assert c.put(_entry("e", 50)) and "c" in c and "a" not in c and "d" not in c
    assert not c.put(_entry("huge", 101)) and c.stats.rejected == 1  # never flush everything for one entry
    assert not c.put(_entry("f", 80))  # only 50 evictable around the pinned 30
    assert c.used_bytes == 80 and c.stats.hits == 1
    c.unpin("c")
    assert c.put(_entry("f", 80)) and c.keys() == ["f"]


def test_slot_pool_padding_and_errors():
    a = torch.randn(3, 4, 8)
    b = torch.randn(3, 6, 4)
    pool = SlotPool.for_adapter({"m.lora_A.weight": a, "m.lora_B.weight": b, "n.lora_A.weight": a}, 2, device="cpu")
    r2_a, r2_b = torch.randn(3, 2, 8), torch.randn(3, 6, 2)
    assert pool.write(1, {"m.lora_A.weight": r2_a, "m.lora_B.weight": r2_b}, scaling=0.5) == (r2_a.numel() + r2_b.numel()) * 4
    view = pool.view(1)
    torch.testing.assert_close(view["m.lora_B.weight"] @ view["m.lora_A.weight"], r2_b @ r2_a)  # zero padding keeps B@A
    assert not view["n.lora_A.weight"].any() and pool.scaling[1] == 0.5  # absent module contributes nothing
    with pytest.raises(AdapterFormatError, match="not in this slot pool's layout"):
        pool.write(0, {"x.lora_A.weight": a})
    with pytest.raises(AdapterFormatError, match="only lower ranks are padded"):
        pool.write(0, {"m.lora_A.weight": torch.randn(3, 5, 8)})
    with pytest.raises(AdapterFormatError, match="float64"):
        pool.write(0, {"m.lora_A.weight": a.double()})


@pytest.fixture()
def setup(tmp_path, base_fp, adapter_factory):
    store = AdapterStore(tmp_path / "store")
    store.create_policy("pol", base_fp)
    adapters = [adapter_factory(i) for i in range(6)]
    revs = [store.publish("pol", ad, parent=None, step=i).id for i, ad in enumerate(adapters)]
    template = adapters[0].to_packed_tensors()

    def make(slots=2, budget=10**7, workers=2, device="cpu", **kw):
        return AdapterCache(store, SlotPool.for_adapter(template, slots, device=device), cpu_budget_bytes=budget, workers=workers, **kw)

    return store, adapters, revs, make


def _assert_slot_holds(cache, slot, adapter):
    view = cache.slots.view(slot)
    for name, t in adapter.to_packed_tensors().items():
        assert torch.equal(view[name].cpu(), t), name
    assert float(cache.slots.scaling[slot]) == adapter.scaling


def test_backpressure_queues_then_dispatches_in_order(setup):
    store, adapters, revs, make = setup
    with make(slots=2) as cache:
        l0, l1, l2, l3 = cache.acquire_many(revs[:4])
        assert l2.state == LeaseState.QUEUED and l3.state == LeaseState.QUEUED and l2.slot is None
        assert cache.queued() == 2
        s0, s1 = l0.wait(), l1.wait()
        assert {s0, s1} == {0, 1} and l0.state == LeaseState.READY
        with pytest.raises(TimeoutError, match="still queued"):
            l2.wait(timeout=0.05)
        l1.release()
        assert l2.wait(5) == s1 and l3.state == LeaseState.QUEUED  # FIFO: l2 before l3
        _assert_slot_holds(cache, s1, adapters[2])
        l3.release()  # a queued lease can give up its place
        l0.release()
        l2.release()
        assert cache.queued() == 0 and set(cache.resident().values()) == {revs[0], revs[2]}


def test_accounting_tiers_and_attach(setup):
    store, adapters, revs, make = setup
    with make(slots=1) as cache:
        with cache.acquire(revs[0]) as lease:
            acct = lease.account
            assert acct.source == "disk" and acct.nbytes == store.blobs.path(revs[0]).stat().st_size
            assert acct.n_tensors == len(adapters[0].to_packed_tensors()) and acct.total_ms >= acct.read_ms > 0
            assert 0 < acct.cpu_ms <= acct.total_ms - acct.queued_ms + 1.0  # the loading thread's share of its wall
            assert 0 <= acct.core_wait_ms <= acct.total_ms - acct.queued_ms + 1.0
            twin = cache.acquire(revs[0])  # same revision while held: shares the slot, no load
            assert twin.wait() == lease.slot and twin.account.source == "resident"
            twin.release()
        with cache.acquire(revs[1]) as other:  # evicts revs[0] from the only slot
            assert other.account.source == "disk"
        with cache.acquire(revs[0]) as back:  # back from the CPU tier, not disk
            assert back.account.source == "cpu" and back.account.read_ms == 0.0
            _assert_slot_holds(cache, back.slot, adapters[0])
        assert [a.source for a in cache.accounts] == ["disk", "disk", "cpu"]


def test_prefetch_and_prewarm(setup):
    store, adapters, revs, make = setup
    with make(slots=2) as cache:
        assert [f.result(10)[1] for f in cache.prefetch(revs[2:4])] == ["disk", "disk"]
        assert all(r in cache.cpu for r in revs[2:4])
        slots = [f.result(10) for f in cache.prewarm([revs[2], revs[3]])]
        assert sorted(slots) == [0, 1] and all(a.source == "cpu" for a in cache.accounts)
        # prewarmed slots are resident but not held: a new request can evict them
        with cache.acquire(revs[5]) as lease:
            _assert_slot_holds(cache, lease.slot, adapters[5])


def test_cpu_budget_evicts_but_loads_stay_correct(setup):
    store, adapters, revs, make = setup
    one = store.blobs.path(revs[0]).stat().st_size
    with make(slots=2, budget=int(2.5 * one)) as cache:
        for i in [0, 1, 2, 3, 0, 4, 5, 1]:
            with cache.acquire(revs[i]) as lease:
                _assert_slot_holds(cache, lease.slot, adapters[i])
        assert cache.cpu.used_bytes <= int(2.5 * one) and cache.cpu.stats.evictions > 0


@pytest.mark.parametrize("workers", [1, 4])
def test_many_threads_many_adapters(setup, workers):
    store, adapters, revs, make = setup
    errors = []
    with make(slots=3, workers=workers) as cache:
        cache.prefetch(revs[::2])  # prefetch racing with slot loads must not deadlock a 1-worker pool

        def client(seed):
            rng = random.Random(seed)
            try:
                for _ in range(15):
                    i = rng.randrange(len(revs))
                    with cache.acquire(revs[i]) as lease:
                        _assert_slot_holds(cache, lease.slot, adapters[i])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and cache.queued() == 0
        assert all(s.refcount == 0 for s in cache._slots)


def test_failed_load_is_isolated(setup, other_fp):
    store, adapters, revs, make = setup
    path = store.blobs.path(revs[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    with make(slots=1) as cache:
        bad = cache.acquire(revs[1])
        waiting = cache.acquire(revs[2])
        with pytest.raises(IntegrityError):
            bad.wait(10)
        assert bad.state == LeaseState.FAILED
        assert waiting.wait(10) == 0  # the freed slot went to the next request
        _assert_slot_holds(cache, 0, adapters[2])
        bad.release()
        waiting.release()
    with make(slots=1, resident_base=other_fp) as cache:
        lease = cache.acquire(revs[0])
        with pytest.raises(BaseMismatchError):
            lease.wait(10)


@pytest.mark.gpu
def test_device_slots_on_cuda(setup):
    store, adapters, revs, make = setup
    with make(slots=2, device="cuda") as cache:
        assert cache.slots.buffers["layers.0.ffn.experts.w1.lora_A.weight"].is_cuda
        leases = cache.acquire_many(revs[:4])
        for lease in leases[:2]:
            lease.wait(30)
        for i, lease in enumerate(leases):
            slot = lease.wait(30)
            _assert_slot_holds(cache, slot, adapters[i])
            lease.release()
        loaded = cache.cpu.get(revs[0])
        assert next(iter(loaded.tensors.values())).is_pinned()


def test_bounded_queue_exact_slots_and_cpu_entry_bound(setup):
    """A full slot queue refuses with a retry-after; exact slots hold each adapter at its own shapes, with the
    `prepare` hook's meta; the CPU tier keeps at most `cpu_max_entries` adapters."""
    from dsv4flash.lifecycle.errors import SlotQueueFull
    from dsv4flash.lifecycle.slots import ExactSlots

    store, adapters, revs, _ = setup
    prepared = lambda loaded: (loaded.tensors, ("meta", loaded.id))  # noqa: E731
    with AdapterCache(store, ExactSlots(1, device="cpu"), cpu_budget_bytes=10**7, workers=2, max_queue=1,
                      cpu_max_entries=2, prepare=prepared) as cache:
        held = cache.acquire(revs[0])
        queued = cache.acquire(revs[1])
        with pytest.raises(SlotQueueFull, match="queue holds 1") as refused:
            cache.acquire(revs[2])
        assert refused.value.retry_after_s >= 1.0
        assert held.wait(10) == 0 and held.meta == ("meta", revs[0])
        loaded = store.load(revs[0])
        assert all(torch.equal(held.tensors()[k], t) for k, t in loaded.tensors.items())
        held.release()
        assert queued.wait(10) == 0 and queued.meta == ("meta", revs[1])
        queued.release()
        with cache.acquire(revs[2]) as third:
            assert third.account.source == "disk"
        assert len(cache.cpu.keys()) == 2 and revs[0] not in cache.cpu  # the oldest left the CPU tier
        assert cache.hits["disk"] == 3 and cache.loading == 0 and cache.loading_peak >= 1
