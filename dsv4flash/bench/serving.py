"""The serving path, timed in-process (`Serving`: tiers + continuous batcher, what `dsv4flash serve` runs).

Throughput: `--requests` sampling calls submitted at once (random prompts of one length, `--tokens` tokens each)
over a catalog of 1, 8, 64 and 1,000 adapters (decoder-half, ranks 2 and 4, published in a temporary store;
with more adapters than requests each request gets a distinct one), the adapter of each request drawn
uniformly or Zipf-skewed (s = 1.1), against the same load on one adapter and on the bare base: decode tokens/s (every generated token over the wall time from the first submit to the last
answer) and p50/p99 time to first token (the wait for the adapter's slot plus submit-to-first-token in the
batcher). Slots: `--max-loras`; CPU tier: `--max-cpu-loras`, so with 1,000 adapters most loads are cold.

Cold-load staircase: 16 adapters missing from the CPU tier and the slots, requested at once; the k-th request's
time until its adapter is in a slot (the staircase the target judges) and its time to first token, for k = 1..16,
with one loader (serial), `--workers` loaders (pipelined) and after
`POST /v1/adapters/prewarm`'s `Serving.prewarm` (prewarmed), against a warm (resident) adapter. The page
cache is warm (the blobs were just written), so "cold" is CPU tier and slots empty, reads from page cache.
Beside it, the same 16 loads alone (`Serving.prewarm` on empty tiers: the same per-load code, no decoding beside
it), serial and pipelined, with each load's CPU time (`LoadAccount.cpu_ms`): their sum over the cores is the
least time any pipelining can take, and CPU over wall says how host-bound a cold load is. Serial and pipelined
runs alternate `--repeats` times; each figure is the median run's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv4flash.bench.report import BenchReport

TARGET_8 = 0.8  # throughput with 8 distinct adapters / single adapter
TARGET_1000 = 0.5
TARGET_STAIRCASE = 0.5  # pipelined / serial, 16 missing adapters
TARGET_PREWARM = 1.2  # prewarmed first token / warm adapter's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--adapters", default="1,8,64,1000", help="distinct-adapter counts (comma-separated)")
    parser.add_argument("--requests", type=int, default=64, help="requests per load (with more adapters than "
                        "requests the uniform mix draws that many distinct adapters of the catalog)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per request")
    parser.add_argument("--prompt", type=int, default=8, help="prompt length")
    parser.add_argument("--max-loras", type=int, default=64, help="device slots")
    parser.add_argument("--max-cpu-loras", type=int, default=128, help="CPU-tier adapters")
    parser.add_argument("--workers", type=int, default=4, help="loader threads (pipelined)")
    parser.add_argument("--staircase", type=int, default=16, help="missing adapters of the staircase")
    parser.add_argument("--staircase-rank", type=int, default=64,
                        help="rank of the staircase's adapters (larger files: a load is mostly read and hash)")
    parser.add_argument("--repeats", type=int, default=3, help="staircase runs of each kind, alternating (median)")
    parser.add_argument("--parts", default="throughput,staircase", type=_parts_arg,
                        help="what to run: throughput, staircase or both (comma-separated)")
    parser.add_argument("--mode", default="exact", choices=["exact", "fast"], help="batcher mode")
    parser.add_argument("--plot", default="docs/serving_bench.png", help="PNG of the staircase and throughput")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test): 1,4 adapters, 8 requests")


def _parts(text: str) -> set[str]:
    """`--parts` -> the parts named (ValueError naming the flag otherwise)."""
    parts = {p.strip() for p in text.split(",") if p.strip()}
    if not parts or parts - {"throughput", "staircase"}:
        raise ValueError(f"--parts: expected throughput and/or staircase (comma-separated), got {text!r}")
    return parts


def _parts_arg(text: str) -> str:
    try:
        _parts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--parts: ")) from None
    return text


def _publish(service, count: int, rank: int | None = None, prefix: str = "bench") -> list[str]:
    """`count` decoder-half adapters (ranks 2 and 4, or all `rank`) as trained policies -> their revision ids."""
    from dsv4flash.lora import LoraConfig

    revs = []
    for i in range(count):
        pc = LoraConfig(preset="decoder_half", rank=rank or (2 if i % 2 else 4), seed=i)
        gen = torch.Generator().manual_seed(i)
        tensors = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in service.base.fresh_adapter(pc).items()}
        service.store.create_policy(f"{prefix}{i}", service.fingerprint(), {"origin": "bench serving"})
        revs.append(service.store.publish(f"{prefix}{i}", tensors, parent=None, tags=["latest"],
                                          extra={"placement": pc.to_dict()}).id)
    return revs


def _pick(n_adapters: int, n_requests: int, mix: str, rng: random.Random) -> list[int]:
    """The adapter of each request: uniform (every adapter at least once when there are enough requests) or
    Zipf-skewed (s = 1.1)."""
    if mix == "uniform":
        if n_adapters > n_requests:
            return rng.sample(range(n_adapters), n_requests)
        picks = [i % n_adapters for i in range(n_requests)]
        rng.shuffle(picks)
        return picks
    weights = [1.0 / (k + 1) ** 1.1 for k in range(n_adapters)]
    return rng.choices(range(n_adapters), weights=weights, k=n_requests)


def _load(service, clients: list, args, rng: random.Random) -> dict:
    """Submit one sampling call per client at once -> tokens/s, p50/p99 time to first token, wall seconds."""
    from dsv4flash.service.types import ModelInput, SamplingParams, load_of

    vocab = service.base.cfg.text.vocab_size
    batcher = service.serving.batcher
    seen = len(batcher.stats.ttft_s)
    t0 = time.perf_counter()
    futures = [c.sample(ModelInput.from_ints([rng.randrange(3, vocab) for _ in range(args.prompt)]), 1,
                        SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=j)) for j, c in enumerate(clients)]
    results = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for r in results for s in r.sequences)
    waits = [(load_of(r) or {}).get("wait_ms", 0.0) / 1e3 for r in results]
    # the batcher's submit-to-first-token of these requests, in completion order; plus each one's slot wait
    ttft_batch = batcher.stats.ttft_s[seen:]
    ttft = sorted(w + b for w, b in zip(sorted(waits), sorted(ttft_batch)))
    q = (lambda f: ttft[min(len(ttft) - 1, int(f * len(ttft)))])
    return {"tok_s": tokens / wall, "p50": q(0.5), "p99": q(0.99), "wall": wall, "ttft": ttft, "ready": sorted(waits)}


def _serving(service, args, *, slots: int, workers: int):
    from dsv4flash.service.compute.serving import Serving

    if service.serving is not None:
        service.serving.close()
    service.serving = Serving(service, max_loras=slots, max_cpu_loras=args.max_cpu_loras, loader_workers=workers,
                              max_queue=None, exact=args.mode == "exact")
    return service.serving


def bench_throughput(service, revs: list[str], args, report: BenchReport) -> dict:
    from dsv4flash.service.compute.sampling import SamplingClient

    rng = random.Random(0)
    curves: dict[str, list[tuple[int, float]]] = {"uniform": [], "zipf": []}
    counts = [int(x) for x in args.adapters.split(",")]
    n_req = args.requests
    _serving(service, args, slots=args.max_loras, workers=args.workers)
    base = [SamplingClient(service, None, None, "base") for _ in range(n_req)]
    _load(service, base[:4], args, rng)  # warm-up: threads, first kernels, and the adapters' placement shells
    _load(service, [SamplingClient(service, None, None, f"w{i}", revision=revs[i]) for i in (0, 1)], args, rng)
    res = _load(service, base, args, rng)
    report.add("base.tok_s", res["tok_s"], "tok/s", note=f"{n_req} requests on the bare base")
    report.add("base.ttft_p50_s", res["p50"], "s")
    report.add("base.ttft_p99_s", res["p99"], "s")
    single = None
    for mix in ("uniform", "zipf"):
        for n in counts:
            if mix == "zipf" and n == 1:
                continue
            _serving(service, args, slots=args.max_loras, workers=args.workers)  # CPU tier and slots empty
            picks = _pick(n, n_req, mix, rng)
            clients = [SamplingClient(service, None, None, f"a{i}", revision=revs[i]) for i in picks]
            res = _load(service, clients, args, rng)
            name = f"{mix}.{n}"
            if n == 1:
                single = name
                report.add(f"{name}.tok_s", res["tok_s"], "tok/s", baseline="base.tok_s",
                           note=f"{n_req} requests, one adapter")
                curves["zipf"].append((1, res["tok_s"]))
            else:
                report.add(f"{name}.tok_s", res["tok_s"], "tok/s", baseline=f"{single}.tok_s" if single else None,
                           note=f"{n_req} requests over {n} adapters ({len(set(picks))} distinct drawn)")
            report.add(f"{name}.ttft_p50_s", res["p50"], "s")
            report.add(f"{name}.ttft_p99_s", res["p99"], "s")
            curves[mix].append((n, res["tok_s"]))
    return curves


def _loads_alone(service, revs: list[str], args, workers: int) -> dict:
    """The staircase's loads with nothing else running: `Serving.prewarm` of every revision on empty tiers."""
    serving = _serving(service, args, slots=len(revs), workers=workers)
    t0 = time.perf_counter()
    serving.prewarm(revs)
    wall = time.perf_counter() - t0
    loads = [a for a in serving.cache.accounts if a.source == "disk"]
    return {"wall": wall, "cpu_ms": sum(a.cpu_ms for a in loads), "load_ms": sum(a.total_ms - a.queued_ms for a in loads),
            "core_wait_ms": sum(a.core_wait_ms for a in loads), "n": len(loads)}


def _median_run(runs: list[dict], key) -> dict:
    return sorted(runs, key=key)[len(runs) // 2]


def bench_staircase(service, revs: list[str], args, report: BenchReport) -> dict[str, list[float]]:
    from dsv4flash.service.compute.sampling import SamplingClient

    rng = random.Random(1)
    k = args.staircase
    alone: dict[str, list[dict]] = {"serial": [], "pipelined": []}
    served: dict[str, list[dict]] = {"serial": [], "pipelined": []}
    for _ in range(max(1, args.repeats)):
        for label, workers in (("serial", 1), ("pipelined", args.workers)):
            alone[label].append(_loads_alone(service, revs[:k], args, workers))
            _serving(service, args, slots=k, workers=workers)
            clients = [SamplingClient(service, None, None, f"s{i}", revision=revs[i]) for i in range(k)]
            served[label].append(_load(service, clients, args, rng))
    stairs, ready = {}, {}
    for label, runs in served.items():
        run = _median_run(runs, lambda r: r["ready"][-1])
        stairs[label], ready[label] = run["ttft"], run["ready"]
    serving = _serving(service, args, slots=k + 1, workers=args.workers)
    serving.prewarm(revs[:k])
    clients = [SamplingClient(service, None, None, f"p{i}", revision=revs[i]) for i in range(k)]
    res = _load(service, clients, args, rng)
    stairs["prewarmed"], ready["prewarmed"] = res["ttft"], res["ready"]
    warm = SamplingClient(service, None, None, "warm", revision=revs[k])
    _load(service, [warm], args, rng)  # now resident
    warm_ttft = statistics.median(_load(service, [warm], args, rng)["ttft"][0] for _ in range(3))
    # the first request on each of three more prewarmed adapters, one at a time
    pre_one = statistics.median(_load(service, [clients[i]], args, rng)["ttft"][0] for i in (1, 2, 3))
    # loads are read + hash + decode on the host: pipelining gains at most the cores it can run them on
    lanes = max(1, min(args.workers, os.cpu_count() or 1))
    serial = _median_run(alone["serial"], lambda r: r["wall"])
    pipelined = _median_run(alone["pipelined"], lambda r: r["wall"])
    report.add("staircase.load_cpu_ms", serial["cpu_ms"] / serial["n"], "ms",
               note="one cold load's CPU time (read, sha256, header, views, decode; serial loads alone)")
    report.add("staircase.load_wall_ms", serial["load_ms"] / serial["n"], "ms", note="its wall time")
    report.add("staircase.load_core_wait_ms", serial["core_wait_ms"] / serial["n"], "ms",
               note="of which runnable, waiting for a core (LoadAccount.core_wait_ms: other work, not the load)")
    report.add("staircase.load_cpu_fraction", serial["cpu_ms"] / (serial["load_ms"] - serial["core_wait_ms"]), "",
               note="CPU over wall less the waits for a core: 1 is a purely host-bound load (no I/O or lock waits)")
    report.add(f"loads.limit_{k}_s", serial["cpu_ms"] / 1e3 / lanes, "s",
               note=f"the serial loads' CPU time over {lanes} cores: no pipelining finishes sooner")
    report.add(f"loads.serial_{k}_s", serial["wall"], "s", note=f"{k} loads alone (prewarm, nothing decoding), 1 loader")
    report.add(f"loads.pipelined_{k}_s", pipelined["wall"], "s", baseline=f"loads.serial_{k}_s",
               limit=f"loads.limit_{k}_s", note=f"the same with {args.workers} loaders")
    report.add(f"staircase.limit_{k}_s", ready["serial"][-1] / lanes, "s",
               note=f"the serial staircase over {lanes} cores (min of loaders and this machine's cores)")
    for label, ys in ready.items():
        report.add(f"staircase.{label}_{k}_s", ys[-1], "s", baseline=f"staircase.serial_{k}_s" if label != "serial"
                   else None, limit=f"staircase.limit_{k}_s" if label == "pipelined" else None,
                   note=f"{k} missing adapters at once: until the last is in its slot")
    for label, ys in stairs.items():
        report.add(f"staircase.{label}_{k}_ttft_s", ys[-1], "s", baseline=f"staircase.serial_{k}_ttft_s"
                   if label != "serial" else None, note=f"{k} missing adapters at once: the last one's first token")
    report.add("first_token.warm_s", warm_ttft, "s", note="one request, adapter resident")
    report.add("first_token.prewarmed_s", stairs["prewarmed"][0], "s", baseline="first_token.warm_s",
               note=f"the first of {k} requests on prewarmed adapters")
    report.add("first_token.prewarmed_alone_s", pre_one, "s", baseline="first_token.warm_s",
               note="one request on a prewarmed adapter (its first)")
    return {"ready": ready, "ttft": stairs}


def _plot(stairs: dict | None, curves: dict | None, path: str, args, report: BenchReport) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (stairs, curves) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    axes = list(axes[0])
    if stairs is not None:
        left = axes.pop(0)
        for (label, ys), color in zip(stairs["ready"].items(), ("C0", "C1", "C2")):
            left.plot(range(1, len(ys) + 1), ys, "o-", color=color, label=f"{label}: in its slot")
            ttft = stairs["ttft"][label]
            left.plot(range(1, len(ttft) + 1), ttft, ":", color=color, label=f"{label}: first token")
        left.set_xlabel("k-th of the missing adapters requested at once")
        left.set_ylabel("seconds from the requests")
        left.set_title(f"Cold-load staircase ({len(stairs['ready']['serial'])} adapters, tiny model)", fontsize=10)
        left.grid(alpha=0.3)
        left.legend()
    if curves is not None:
        right = axes.pop(0)
        for mix, pts in curves.items():
            if pts:
                right.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{mix} mix")
        right.axhline(report.value("base.tok_s"), color="grey", ls="--", label="bare base")
        right.set_xscale("log")
        right.set_xlabel("distinct adapters in the load")
        right.set_ylabel("decode tokens/s")
        right.set_title(f"Throughput, {args.mode} batching, {args.max_loras} slots", fontsize=10)
        right.grid(alpha=0.3)
        right.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> BenchReport:
    """Both parts (or those `--parts` names) on one resident tiny base and one temporary store."""
    from dsv4flash.service.client import ServiceClient

    parts = _parts(args.parts)
    if args.quick:
        args.adapters, args.requests, args.tokens, args.staircase, args.repeats = "1,4", 8, 3, 4, 1
        args.max_loras, args.max_cpu_loras, args.staircase_rank = 4, 4, 8
    torch.set_num_threads(1)
    report = BenchReport(f"serving: continuous batching over adapters + tiers ({args.mode} mode)")
    with tempfile.TemporaryDirectory(prefix="dsv4flash-bench-serving-") as root:
        service = ServiceClient("tiny", root=Path(root))
        curves = stairs = None
        try:
            if "throughput" in parts:
                revs = _publish(service, max(int(x) for x in args.adapters.split(",")))
                curves = bench_throughput(service, revs, args, report)
            if "staircase" in parts:
                stair_revs = _publish(service, args.staircase + 1, rank=args.staircase_rank, prefix="stair")
                report.add("staircase.adapter_mb", service.store.blobs.path(stair_revs[0]).stat().st_size / 2**20,
                           "MiB", note=f"one staircase adapter (decoder-half, rank {args.staircase_rank})")
                stairs = bench_staircase(service, stair_revs, args, report)
        finally:
            if service.serving is not None:
                service.serving.close()
    fig = report.as_dict()
    single = fig.get("uniform.1.tok_s")
    for n, target in ((8, TARGET_8), (1000, TARGET_1000)):
        for mix in ("uniform", "zipf"):
            if f"{mix}.{n}.tok_s" in fig and single:
                ratio = fig[f"{mix}.{n}.tok_s"] / single
                report.target(f"{mix} mix, {n} distinct adapters: {ratio:.2f}x single-adapter tokens/s "
                              f"(target >= {target})", ratio >= target)
    k = args.staircase
    if stairs is not None:
        ratio = fig[f"staircase.pipelined_{k}_s"] / fig[f"staircase.serial_{k}_s"]
        bound = fig[f"staircase.limit_{k}_s"] / fig[f"staircase.serial_{k}_s"]
        alone = fig[f"loads.pipelined_{k}_s"] / fig[f"loads.serial_{k}_s"]
        report.target(f"pipelined staircase: {ratio:.2f}x serial for {k} missing adapters, until all are in their "
                      f"slots (target <= {TARGET_STAIRCASE}; this machine's core bound {bound:.2f}x; the loads alone "
                      f"{alone:.2f}x; a cold load is {fig['staircase.load_cpu_fraction']:.0%} CPU once it has a core)",
                      ratio <= TARGET_STAIRCASE)
        ratio = fig["first_token.prewarmed_alone_s"] / fig["first_token.warm_s"]
        report.target(f"prewarmed first token: {ratio:.2f}x a warm adapter's (target <= {TARGET_PREWARM})",
                      ratio <= TARGET_PREWARM)
    if args.plot:
        _plot(stairs, curves, args.plot, args, report)
    return report
