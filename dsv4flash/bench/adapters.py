"""`python -m dsv4flash.bench adapters`: packed vs per-expert MoE LoRA loads, the catalog at 10^6
revisions, and the cold-load staircase (pipelined vs serial).

1. **Load into the engine layout.** A V4.1-shape rank-1 routed-expert adapter (40 MoE layers × 384
   experts × w1/w2/w3, hidden 5120, moe_inter 2304: 92 160 tensors / 684 MB BF16) is loaded from disk
   into preallocated stacked buffers `[E, r, in]` / `[E, out, r]` (one device slot, as vLLM's
   `lora_*_stacked`): from the per-expert PEFT file (safetensors `load_file`, then one copy per expert
   tensor) and from the packed file (one scatter `preadv` straight into the slot). Both are compared
   with a plain memory copy of the same bytes into the same buffers (the physical limit). Files sit in
   the page cache (warm) for the headline figures; a cold-cache pass (`posix_fadvise(DONTNEED)`) follows.
2. **Catalog at 10^6.** 10^6 revisions (1 000 policies × 1 000-deep chains) are bulk-inserted into a
   SQLite catalog; then single-transaction `register` calls (head compare-and-set included) and
   `lookup`/prefix `resolve`/`policy` reads are timed at that size (p50/p99).
3. **Cold-load staircase.** 1…N adapters missing from the CPU tier and the device slots are brought
   into slots with verification (sha256), serially (one loader) and pipelined (a loader pool), and
   plotted. By default every step starts from a cold page cache (read from disk); the N-adapter step
   is repeated with the files page-cached (`--staircase-cache warm` swaps the two).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv4flash.bench.report import BenchReport

V41 = {"layers": 40, "experts": 384, "hidden": 5120, "moe_inter": 2304}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options (defaults: V4.1 shape, 10^6 revisions, 16-step staircase)."""
    parser.add_argument("--layers", type=int, default=V41["layers"], help="MoE layers with expert LoRA")
    parser.add_argument("--experts", type=int, default=V41["experts"], help="routed experts per layer")
    parser.add_argument("--hidden", type=int, default=V41["hidden"])
    parser.add_argument("--moe-inter", type=int, default=V41["moe_inter"])
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per load variant (median reported)")
    parser.add_argument("--revisions", type=int, default=1_000_000, help="catalog size")
    parser.add_argument("--registers", type=int, default=2_000, help="timed single registers at full size")
    parser.add_argument("--catalog", default=None, metavar="URL",
                        help="catalog to benchmark (an empty PostgreSQL database, postgresql://…); default: a SQLite file")
    parser.add_argument("--lookups", type=int, default=20_000, help="timed lookups at full size")
    parser.add_argument("--staircase", type=int, default=16, help="largest number of missing adapters")
    parser.add_argument("--staircase-layers", type=int, default=2, help="MoE layers of each staircase adapter")
    parser.add_argument("--workers", type=int, default=4, help="loader threads of the pipelined staircase")
    parser.add_argument("--staircase-cache", choices=("cold", "warm"), default="cold",
                        help="cold: drop the adapters from the page cache before every step (default); warm: leave "
                             "them cached (the other setting is measured once, at the last step)")
    parser.add_argument("--plot", default="adapters_staircase.png", help="PNG of the staircase")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test of the benchmark itself)")


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _synthetic_adapter(layers: int, experts: int, hidden: int, inter: int, rank: int):
    """Random BF16 bit patterns in the packed layout (content is irrelevant to load speed)."""
    from dsv4flash.lifecycle.packed import PackedMoELoRA

    io = {"w1": (hidden, inter), "w2": (inter, hidden), "w3": (hidden, inter)}
    bits = lambda *shape: torch.empty(*shape, dtype=torch.int16).random_().view(torch.bfloat16)  # noqa: E731
    return PackedMoELoRA(rank=rank, alpha=2.0 * rank, num_experts=experts,
                         experts={(l, p): (bits(experts, rank, i), bits(experts, o, rank)) for l in range(layers) for p, (i, o) in io.items()})


# ---- 1. packed vs per-expert -------------------------------------------------------------------
def bench_load(args, work: Path, report: BenchReport) -> None:
    """Per-expert vs packed load into a preallocated slot, vs memcpy."""
    from safetensors.torch import load_file

    from dsv4flash.lifecycle.export import PEFT_PREFIX, WEIGHTS_NAME, export_peft
    from dsv4flash.lifecycle.packed import _PER_EXPERT, packed_key
    from dsv4flash.lifecycle.safetensors_io import read_into, write_safetensors
    from dsv4flash.lifecycle.slots import SlotPool

    ad = _synthetic_adapter(args.layers, args.experts, args.hidden, args.moe_inter, args.rank)
    packed_path, peft_dir = work / "packed.safetensors", work / "peft"
    with open(packed_path, "wb") as f:
        write_safetensors(f, ad.to_packed_tensors())
    export_peft(ad, peft_dir)
    per_expert_path = peft_dir / WEIGHTS_NAME
    nbytes, n_packed, n_per_expert = ad.nbytes(), ad.tensors_packed_layout(), ad.tensors_per_expert_layout()
    pool = SlotPool.for_adapter(ad.to_packed_tensors(), 1, device="cpu")  # the engine's stacked buffers
    slot = pool.view(0)
    del ad
    gc.collect()

    def per_expert() -> None:
        tensors = load_file(per_expert_path)
        for name, t in tensors.items():
            m = _PER_EXPERT.fullmatch(name.removeprefix(PEFT_PREFIX))
            slot[packed_key(int(m[1]), m[3], m[4])][int(m[2])].copy_(t)

    per_expert_slot = {}
    for name in _header_names(per_expert_path):
        m = _PER_EXPERT.fullmatch(name.removeprefix(PEFT_PREFIX))
        per_expert_slot[name] = slot[packed_key(int(m[1]), m[3], m[4])][int(m[2])]

    def per_expert_scatter() -> None:
        read_into(per_expert_path, per_expert_slot, threads=2)

    def packed_safetensors() -> None:
        for name, t in load_file(packed_path).items():
            slot[name].copy_(t)

    def packed() -> None:
        read_into(packed_path, slot, threads=2)

    flat_dst = torch.empty(nbytes, dtype=torch.uint8)
    flat_src = torch.empty(nbytes, dtype=torch.uint8).random_()
    flat_dst.copy_(flat_src)  # fault both in: the baseline measures copying, not first-touch

    def memcpy() -> None:
        flat_dst.copy_(flat_src)

    for fn in (per_expert, per_expert_scatter, packed_safetensors, packed, memcpy):
        fn()  # warm page cache and destination pages
    t_memcpy = _median_time(memcpy, args.repeats)
    t_packed = _median_time(packed, args.repeats)
    t_packed_st = _median_time(packed_safetensors, args.repeats)
    t_per_expert = _median_time(per_expert, max(1, args.repeats // 2))
    t_per_expert_scatter = _median_time(per_expert_scatter, max(1, args.repeats // 2))
    report.add("load.bytes", nbytes, "B", note=f"{args.layers}L × {args.experts}E × w1/w2/w3, rank {args.rank}, BF16")
    report.add("load.tensors_per_expert", n_per_expert, "tensors")
    report.add("load.tensors_packed", n_packed, "tensors", baseline="load.tensors_per_expert")
    report.add("load.memcpy_s", t_memcpy, "s", note=f"{nbytes / t_memcpy / 1e9:.2f} GB/s, same bytes, same destination")
    report.add("load.per_expert_s", t_per_expert, "s", limit="load.memcpy_s", note="safetensors load_file + one copy per expert tensor")
    report.add("load.per_expert_scatter_s", t_per_expert_scatter, "s", baseline="load.per_expert_s", limit="load.memcpy_s",
               note="per-expert file through the dsv4flash scatter reader: the fanout cost alone")
    report.add("load.packed_safetensors_s", t_packed_st, "s", baseline="load.per_expert_s", limit="load.memcpy_s",
               note="safetensors load_file (mmap) + one copy per packed tensor")
    report.add("load.packed_s", t_packed, "s", baseline="load.per_expert_s", limit="load.memcpy_s",
               note="dsv4flash scatter preadv straight into the slot")
    report.target(f"packed ≥ 10× faster than per-expert: {t_per_expert / t_packed:.1f}×", t_per_expert / t_packed >= 10)
    report.target(f"packed within 1.5× of memcpy: {t_packed / t_memcpy:.2f}×", t_packed / t_memcpy <= 1.5)
    # cold page cache: the disk is now part of the path for both formats
    for name, fn, path in (("packed", packed, packed_path), ("per_expert", per_expert, per_expert_path)):
        _drop_page_cache(path)
        t0 = time.perf_counter()
        fn()
        report.add(f"load.cold.{name}_s", time.perf_counter() - t0, "s", note="after posix_fadvise(DONTNEED)")
    shutil.rmtree(peft_dir)
    packed_path.unlink()


def _header_names(path: Path) -> list[str]:
    from dsv4flash.lifecycle.safetensors_io import read_header

    return [e.name for e in read_header(path).entries]


# ---- 2. catalog at 10^6 ------------------------------------------------------------------------
def _rev_id(i: int) -> str:
    return hashlib.sha256(b"bench-revision-%d" % i).hexdigest()


def bench_catalog(args, work: Path, report: BenchReport) -> None:
    """Bulk-load N revisions, then time register / lookup / resolve / policy at that size."""
    from dsv4flash.lifecycle.catalog import RevisionRecord, open_catalog
    from dsv4flash.lifecycle.fingerprint import fingerprint_from_parts

    n = args.revisions
    n_policies = max(1, min(1000, n // 1000))
    per_policy = n // n_policies
    n = n_policies * per_policy
    base = fingerprint_from_parts({"model_type": "bench"}, [("w", "BF16", (1,))])
    from dsv4flash.lifecycle.catalog.sqlite import SQLiteCatalog

    url = args.catalog or str(work / "catalog.sqlite")
    # SQLite bulk phase only: no fsync per batch and a big page cache (a fresh import, redone on a crash).
    cat = open_catalog(url) if args.catalog else SQLiteCatalog(url, synchronous="OFF", cache_mb=512)
    for p in range(n_policies):
        cat.create_policy(f"policy-{p}", base)

    def rows(progress, task):
        for i in range(n):
            p, depth = divmod(i, per_policy)
            yield RevisionRecord(_rev_id(i), f"policy-{p}", _rev_id(i - 1) if depth else None, base.digest, "packed_moe_lora/1",
                                 684_000_000, 240, depth, 1.7e9 + i)
            if i % 10_000 == 0:
                progress.update(task, completed=i)

    with _progress() as progress:
        task = progress.add_task(f"catalog: bulk insert {n:,} revisions", total=n)
        t0 = time.perf_counter()
        added = cat.bulk_register(rows(progress, task), batch=50_000)
        t_bulk = time.perf_counter() - t0
    cat.close()
    cat = open_catalog(url)  # the default durable settings for the timed part
    heads = {f"policy-{p}": _rev_id(p * per_policy + per_policy - 1) for p in range(n_policies)}
    rng = random.Random(0)
    reg_times = []
    for j in range(args.registers):
        pol = f"policy-{rng.randrange(n_policies)}"
        rid = hashlib.sha256(b"bench-new-%d" % j).hexdigest()
        rec = RevisionRecord(rid, pol, heads[pol], base.digest, "packed_moe_lora/1", 684_000_000, 240, per_policy + j)
        t0 = time.perf_counter()
        cat.register(rec, expect_head=heads[pol])
        reg_times.append(time.perf_counter() - t0)
        heads[pol] = rid

    def timed(fn, count):
        out = []
        for _ in range(count):
            arg = fn.arg()
            t0 = time.perf_counter()
            fn(arg)
            out.append(time.perf_counter() - t0)
        out.sort()
        return out[len(out) // 2] * 1e6, out[min(len(out) - 1, int(len(out) * 0.99))] * 1e6

    lookup = lambda rid: cat.lookup(rid)  # noqa: E731
    lookup.arg = lambda: _rev_id(rng.randrange(n))
    prefix = lambda p: cat.resolve(p)  # noqa: E731
    prefix.arg = lambda: _rev_id(rng.randrange(n))[:12]
    policy = lambda p: cat.policy(p)  # noqa: E731
    policy.arg = lambda: f"policy-{rng.randrange(n_policies)}"
    lk50, lk99 = timed(lookup, args.lookups)
    px50, px99 = timed(prefix, max(1, args.lookups // 4))
    po50, po99 = timed(policy, max(1, args.lookups // 20))
    count = cat.count()
    cat.close()
    report.add("catalog.revisions", count, "rows", note=f"{n_policies} policies × {per_policy}-deep chains (+ registers)")
    report.add("catalog.bulk_insert_per_s", added / t_bulk, "rows/s",
               note="batched 50k-row transactions" + ("" if args.catalog else ", synchronous=OFF (import)"))
    backend = "PostgreSQL" if args.catalog else "SQLite WAL, synchronous=NORMAL"
    report.add("catalog.register_per_s", len(reg_times) / sum(reg_times), "ops/s", note=f"one durable transaction each, head CAS ({backend})")
    report.add("catalog.register_p99_ms", sorted(reg_times)[int(len(reg_times) * 0.99) - 1] * 1e3, "ms")
    report.add("catalog.lookup_p50_us", lk50, "µs", note="by full id")
    report.add("catalog.lookup_p99_us", lk99, "µs")
    report.add("catalog.resolve_prefix_p50_us", px50, "µs", note="12-hex prefix")
    report.add("catalog.resolve_prefix_p99_us", px99, "µs")
    report.add("catalog.policy_record_p50_us", po50, "µs", note="head, tags, state, evals, rollout count")
    report.add("catalog.policy_record_p99_us", po99, "µs")
    if not args.catalog:
        report.add("catalog.file_mb", sum(p.stat().st_size for p in work.glob("catalog.sqlite*")) / 2**20, "MiB")
    report.target(f"catalog addresses 10^6 revisions: {count:,}", count >= 1_000_000)


# ---- 3. cold-load staircase --------------------------------------------------------------------
def bench_staircase(args, work: Path, report: BenchReport) -> dict[str, list[float]]:
    """1…N missing adapters into device slots from a cold page cache: serial vs pipelined."""
    from dsv4flash.lifecycle.fingerprint import fingerprint_from_parts
    from dsv4flash.lifecycle.slots import SlotPool
    from dsv4flash.lifecycle.store import AdapterStore
    from dsv4flash.lifecycle.tiers import AdapterCache

    n = args.staircase
    store = AdapterStore(work / "store")
    store.create_policy("stair", fingerprint_from_parts({"model_type": "bench"}, [("w", "BF16", (1,))]))
    revs = []
    for i in range(n):
        ad = _synthetic_adapter(args.staircase_layers, args.experts, args.hidden, args.moe_inter, args.rank)
        revs.append(store.publish("stair", ad, parent=None, step=i).id)
    pool = SlotPool.for_adapter(ad.to_packed_tensors(), n, device="cpu")
    size = store.blobs.path(revs[0]).stat().st_size
    del ad
    curves: dict[str, list[float]] = {"serial": [], "pipelined": []}
    accounts = []

    def load_all(k: int, workers: int, cold: bool) -> tuple[float, list]:
        if cold:
            for rid in revs[:k]:
                _drop_page_cache(store.blobs.path(rid))
        gc.collect()
        with AdapterCache(store, pool, cpu_budget_bytes=(n + 1) * size, workers=workers) as cache:
            t0 = time.perf_counter()
            leases = cache.acquire_many(revs[:k])
            for lease in leases:
                lease.wait()
            elapsed = time.perf_counter() - t0
            for lease in leases:
                lease.release()
            return elapsed, list(cache.accounts)

    modes = (("serial", 1), ("pipelined", args.workers))
    cold = args.staircase_cache == "cold"
    other = "warm" if cold else "cold"
    with _progress() as progress:
        task = progress.add_task(f"staircase ({args.staircase_cache} page cache)", total=2 * n + 2)
        for k in range(1, n + 1):
            for mode, workers in modes:
                elapsed, accts = load_all(k, workers, cold)
                curves[mode].append(elapsed)
                if k == n and mode == "serial":
                    accounts = accts
                progress.advance(task)
        last_other = {}
        for mode, workers in modes:
            last_other[mode] = load_all(n, workers, not cold)[0]
            progress.advance(task)
    for mode in ("serial", "pipelined"):
        for k, t in enumerate(curves[mode], 1):
            report.add(f"staircase.{mode}_{k}_s", t, "s", baseline=f"staircase.serial_{k}_s" if mode == "pipelined" else None)
    for mode, elapsed in last_other.items():
        report.add(f"staircase.{other}_{mode}_{n}_s", elapsed, "s", baseline=f"staircase.{other}_serial_{n}_s" if mode == "pipelined" else None,
                   note="page cache dropped: disk-bound" if other == "cold" else "files page-cached: CPU/page-fault-bound")
    slope = {m: _slope(curves[m]) for m in curves}
    cache_note = "cold page cache (disk)" if cold else "files in the page cache, not in the CPU tier or slots"
    report.add("staircase.adapter_mb", size / 2**20, "MiB", note=f"{args.staircase_layers}L × {args.experts}E rank {args.rank}, sha256-verified; {cache_note}")
    report.add("staircase.serial_s_per_adapter", slope["serial"], "s", note="least-squares slope; MinT reports ≈1.46 s for its adapter size")
    report.add("staircase.pipelined_s_per_adapter", slope["pipelined"], "s", baseline="staircase.serial_s_per_adapter")
    if accounts:
        report.add("staircase.read_ms_mean", statistics.mean(a.read_ms for a in accounts), "ms", note="read + sha256 per adapter (serial)")
        report.add("staircase.device_ms_mean", statistics.mean(a.device_ms for a in accounts), "ms", note="copy into the slot")
    report.target(f"pipelined loads cost less per missing adapter than serial ones (least-squares slope): "
                  f"{slope['pipelined']:.3f} vs {slope['serial']:.3f} s", slope["pipelined"] < slope["serial"])
    store.close()
    return curves


def _slope(ys: list[float]) -> float:
    xs = list(range(1, len(ys) + 1))
    if len(xs) < 2:
        return ys[0] if ys else float("nan")
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _plot(curves: dict[str, list[float]], path: str, args, adapter_mb: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ks = list(range(1, len(curves["serial"]) + 1))
    ax.plot(ks, curves["serial"], "o-", label="serial (1 loader)")
    ax.plot(ks, curves["pipelined"], "s-", label=f"pipelined ({args.workers} loaders)")
    ax.set_xlabel("missing adapters requested at once")
    ax.set_ylabel("time until all are in device slots [s]")
    cache = "cold page cache: read from disk" if args.staircase_cache == "cold" else "page cache warm, CPU tier + slots empty"
    ax.set_title(f"Cold-load staircase: {adapter_mb:.0f} MiB adapters, sha256-verified, CPU tier + slots empty\n({cache})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> BenchReport:
    """Run all three parts and return the report."""
    if args.quick:
        args.layers, args.experts, args.repeats = min(args.layers, 2), min(args.experts, 16), min(args.repeats, 2)
        args.revisions, args.registers, args.lookups = min(args.revisions, 20_000), min(args.registers, 200), min(args.lookups, 2_000)
        args.staircase, args.staircase_layers = min(args.staircase, 4), 1
    report = BenchReport(f"adapters: MoE LoRA {args.layers}L × {args.experts}E rank {args.rank}; catalog {args.revisions:,}; staircase 1…{args.staircase}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dsv4flash-bench-adapters-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        bench_load(args, work, report)
        bench_catalog(args, work, report)
        curves = bench_staircase(args, work, report)
        _plot(curves, args.plot, args, report.value("staircase.adapter_mb"))
        report.targets.append(f"plot  {os.path.abspath(args.plot)}")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    report.add("mem.peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "MiB")
    return report
