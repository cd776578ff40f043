"""`dsv4flash serve` through the real tinker SDK vs the in-process service core, on the tiny model.

latency: per-call p50/p99 of `forward_backward`+`optim_step` and of `sample` through HTTP and in-process on the
same work; the floor of the HTTP figure is the in-process time plus one loopback round trip per HTTP exchange
(submit + retrieve for each future). fairness: a light tenant's loop alone, then beside a tenant flooding the
server (its p99 should stay within 3x), with `/healthz` latency and the server's RSS during the flood. grpo: 3
GRPO clients (each its own `ServiceClient`, reward function that sleeps) run concurrently through the server (its
`PhaseScheduler`) vs one after another (MinT: 1.77×), and concurrently through a second server started with
`--scheduler lock` (the base lock alone), side by side.
The machine's load average is reported with the figures: on a shared machine it moves them more than anything.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dsv4flash.bench.report import BenchReport
from dsv4flash.bench.sdk_workloads import (KEY, MINT_GRPO, concurrent, pct, sequential_vs_concurrent, sl_data,
                                          timed)

TARGET_OVERHEAD_MS = 10.0  # HTTP p50 over in-process p50, per fwd+bwd+optim call
_FLOOD_KEY = "tml-flood-000000000000000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Bench options."""
    parser.add_argument("--part", choices=("all", "latency", "grpo", "fairness"), default="all")
    parser.add_argument("--calls", type=int, default=30, help="timed calls per latency figure")
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--reward-latency", type=float, default=0.05, help="seconds per reward call")
    parser.add_argument("--flood-requests", type=int, default=200, help="requests the flooding tenant sends")
    parser.add_argument("--plot", metavar="PNG", help="also write a chart of the comparisons")
    parser.add_argument("--trainer", choices=("local", "megatron"), default="local",
                        help="megatron: the Megatron compute plane against --trainer local instead "
                             "(dsv4flash/bench/service_http_megatron.py)")
    parser.add_argument("--trainer-layout", default="ep=2", help="with --trainer megatron (default ep=2)")
    parser.add_argument("--sampler", default="dsv4flash", help="with --trainer megatron (default dsv4flash)")


def _latency(url: str, rep: BenchReport, calls: int, progress) -> dict:
    import httpx
    import tinker
    from tinker import types

    import dsv4flash.service as core

    sdk = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    local = core.ServiceClient("tiny", root=tempfile.mkdtemp(prefix="dsv4flash-bench-"))
    ltc = local.create_lora_training_client(rank=4)
    http_data, local_data = sl_data(types), sl_data(core.types)

    def http_step():
        fb, opt = tc.forward_backward(http_data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), opt.result()

    def local_step():
        fb, opt = ltc.forward_backward(local_data, "cross_entropy"), ltc.optim_step(core.types.AdamParams(1e-3))
        fb.result(), opt.result()

    sampler = tc.save_weights_and_get_sampling_client().result()
    lsampler = ltc.save_weights_and_get_sampling_client()
    prompt, lprompt = types.ModelInput.from_ints([0, 10, 11, 12]), core.types.ModelInput.from_ints([0, 10, 11, 12])
    http_sample = lambda: sampler.sample(prompt, 4, types.SamplingParams(max_tokens=4, seed=1)).result()  # noqa: E731
    local_params = core.types.SamplingParams(max_tokens=4, seed=1)
    local_sample = lambda: lsampler.sample(lprompt, 4, local_params).result()  # noqa: E731
    with httpx.Client() as h:
        rtt = timed(lambda: h.get(f"{url}/api/v1/healthz"), calls, progress, "loopback round trip")
    t = {"step_http": timed(http_step, calls, progress, "fwd+bwd+optim via HTTP"),
         "step_local": timed(local_step, calls, progress, "fwd+bwd+optim in-process"),
         "sample_http": timed(http_sample, calls, progress, "sample via HTTP"),
         "sample_local": timed(local_sample, calls, progress, "sample in-process")}
    rtt50 = pct(rtt, 50)
    rep.add("loopback_rtt_p50", rtt50, "ms", note="GET /healthz on 127.0.0.1 (one HTTP exchange)")
    for what, exchanges in (("step", 4), ("sample", 2)):
        for q in (50, 99):
            rep.add(f"{what}_local_p{q}", pct(t[f"{what}_local"], q), "ms", note="in-process service core")
            rep.add(f"{what}_floor_p{q}", pct(t[f"{what}_local"], q) + exchanges * rtt50, "ms",
                    note=f"in-process + {exchanges} round trips")
            rep.add(f"{what}_http_p{q}", pct(t[f"{what}_http"], q), "ms", baseline=f"{what}_local_p{q}",
                    limit=f"{what}_floor_p{q}", note="tinker SDK 0.38 -> dsv4flash serve")
    overhead = rep.value("step_http_p50") - rep.value("step_local_p50")
    rep.target(f"HTTP overhead of one fwd+bwd+optim call {overhead:.1f} ms at p50 (target <= {TARGET_OVERHEAD_MS} ms)",
               overhead <= TARGET_OVERHEAD_MS)
    return {k: (pct(v, 50), pct(v, 99)) for k, v in t.items()}


# The flood's bound on the server's resident growth: one compression bomb decompressed in full grows it by GiBs.
RSS_GROWTH_MIB = 256


def _rss_mib(pid: int) -> float:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def flood_vs_light(url: str, light_key: str, flood_key: str, *, calls: int = 10, flood_requests: int = 200,
                   pid: int | None = None, call_timeout_s: float = 120.0) -> dict:
    """A light tenant's loop (fwd+bwd+optim, then a 4-token sample; beside the flood a pause as long as a step
    after each) timed alone, beside a tenant flooding the server with `flood_requests` requests (samples to the
    context limit and forward_backward, through raw HTTP, past its queue bound), and alone again once the flood
    is cancelled (`calls` steps each; `alone` holds both alone phases); `/healthz` and the server's RSS (`pid`)
    are watched during the flood -> the raw figures."""
    import itertools
    import json

    import httpx
    import tinker
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    data, prompt = sl_data(types), [0, 10, 11, 12]
    with tinker.ServiceClient(base_url=url, api_key=light_key) as light, \
            tinker.ServiceClient(base_url=url, api_key=flood_key) as flood:
        tc = light.create_lora_training_client(base_model="tiny", rank=4).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        flood_model = flood.create_lora_training_client(base_model="tiny", rank=4).result().model_id
        context = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"X-API-Key": light_key}
                            ).json()["supported_models"][0]["max_context_length"]

        def light_step() -> float:
            t0 = time.perf_counter()
            fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-3))
            fb.result(timeout=call_timeout_s), opt.result(timeout=call_timeout_s)
            sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1)
                           ).result(timeout=call_timeout_s)
            return time.perf_counter() - t0

        light_step()  # warm-up: placement shell, connections
        alone = [light_step() for _ in range(calls)]
        # a light tenant leaves the base idle between steps (as long as a step takes: scoring, a user); a loop
        # without pauses is as much a flood as the other tenant and gets half the base, i.e. twice the latency
        think = float(np.median(alone))

        headers = {"X-API-Key": flood_key}
        sample_body = json.dumps({"type": "sample", "base_model": "tiny", "num_samples": 2,
                                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                                  "sampling_params": {"max_tokens": context - len(prompt), "temperature": 1.0}})
        fb_body = forward_backward_request_to_proto(types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
            model_id=flood_model, seq_id=1)).SerializeToString()
        posts = itertools.count()
        accepted: list[str] = []
        refused: list[int] = []
        health: list[float] = []
        rss = [_rss_mib(pid)] if pid else []
        stop = threading.Event()

        def flooder() -> None:
            with httpx.Client(timeout=30) as h:
                while not stop.is_set():
                    i = next(posts)
                    if i >= flood_requests:  # bounded in count (and in time, by `stop`)
                        return
                    if i % 2:
                        r = h.post(f"{url}/api/v1/forward_backward", content=fb_body,
                                   headers={**headers, "Content-Type": "application/x-protobuf"})
                    else:
                        r = h.post(f"{url}/api/v1/asample", content=sample_body,
                                   headers={**headers, "Content-Type": "application/json"})
                    if r.status_code == 200:
                        accepted.append(r.json()["request_id"])
                    else:  # 429 past its queue bound: back off a little (the SDK waits 1 s, then longer)
                        refused.append(r.status_code)
                        stop.wait(0.2)

        def watch() -> None:
            with httpx.Client() as h:
                while not stop.wait(0.2):
                    t0 = time.perf_counter()
                    try:  # a poll is unanswered past 10 s (a stalled server); the 1 s target is the table's
                        ok = h.get(f"{url}/api/v1/healthz", timeout=10.0).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    health.append(time.perf_counter() - t0 if ok else float("inf"))
                    if pid:
                        rss.append(_rss_mib(pid))

        threads = [threading.Thread(target=flooder) for _ in range(2)] + [threading.Thread(target=watch)]
        for th in threads:
            th.start()
        try:
            while not refused and any(th.is_alive() for th in threads[:2]):
                time.sleep(0.05)  # the flood fills its queue before the light loop starts
            beside = []
            for _ in range(calls):
                beside.append(light_step())
                stop.wait(think)
        finally:
            stop.set()
            for th in threads:
                th.join()
            with httpx.Client(timeout=30) as h:  # the flood's backlog would run on for minutes: cancel it
                for rid in accepted:
                    h.post(f"{url}/api/v1/cancel_future", json={"request_id": rid}, headers=headers)
        # alone again: the machine's other load, drifting over the run, then weighs on both sides alike
        alone += [light_step() for _ in range(calls)]
    return {"alone": alone, "beside": beside, "health": health, "rss_mib": rss, "accepted": len(accepted),
            "refused": len(refused)}


def _fairness(url: str, flood_key: str, rep: BenchReport, calls: int, flood_requests: int, pid: int,
              progress) -> dict:
    task = progress.add_task("light tenant alone, then beside a flooding tenant", total=1)
    out = flood_vs_light(url, KEY, flood_key, calls=calls, flood_requests=flood_requests, pid=pid)
    progress.advance(task)
    for q in (50, 99):
        rep.add(f"light_step_alone_p{q}", pct(out["alone"], q), "ms", note="fwd+bwd+optim + 4-token sample, "
                "the only tenant (before and after the flood)")
        rep.add(f"light_step_beside_flood_p{q}", pct(out["beside"], q), "ms", baseline=f"light_step_alone_p{q}",
                note=f"same, while another tenant floods ({out['accepted']} requests queued, {out['refused']} "
                     f"refused with 429; samples to the context limit)")
    rep.add("healthz_max_during_flood", max(out["health"]) * 1e3, "ms", note=f"{len(out['health'])} polls")
    rep.add("server_rss_before_flood", out["rss_mib"][0], "MiB")
    rep.add("server_rss_peak_during_flood", max(out["rss_mib"]), "MiB", baseline="server_rss_before_flood")
    ratio = rep.value("light_step_beside_flood_p99") / rep.value("light_step_alone_p99")
    rep.target(f"light tenant's p99 beside a flooding tenant {ratio:.2f}x its p99 alone (target <= 3x)", ratio <= 3)
    late = sum(h >= 1.0 for h in out["health"])  # a poll that failed or timed out counts as inf
    rep.target(f"/healthz during the flood: {late} of {len(out['health'])} polls took 1 s or more or went unanswered "
               f"(target: none)", late == 0)
    growth = max(out["rss_mib"]) - out["rss_mib"][0]
    rep.target(f"server RSS grew by {growth:.0f} MiB during the flood (target: bounded, < {RSS_GROWTH_MIB} MiB)",
               growth < RSS_GROWTH_MIB)
    return out


def _grpo(url: str, lock_url: str, rep: BenchReport, steps: int, latency: float, progress) -> dict:
    import os

    task = progress.add_task("GRPO: sequential, 3 concurrent clients (phase scheduler, base lock)", total=3)
    load0 = os.getloadavg()[0]
    runs = sequential_vs_concurrent(url, steps, latency, lambda: progress.advance(task))
    seq, con, scoring, bound = runs["sequential"], runs["concurrent"], runs["scoring"], runs["bound"]
    con_lock = concurrent(lock_url, steps, latency)
    progress.advance(task)
    load1 = os.getloadavg()[0]
    rep.add("grpo_http_sequential_makespan", seq, "s", note=f"3 clients x {steps} steps, one after another; "
            f"scoring {scoring:.1f}s of it")
    rep.add("grpo_http_concurrent_bound", bound, "s", note="max(sequential minus scoring, one client's makespan); "
            "client-side work overlaps too, so not a hard floor")
    rep.add("grpo_http_concurrent_makespan", con, "s", baseline="grpo_http_sequential_makespan",
            limit="grpo_http_concurrent_bound", note="3 SDK clients at once through one server (PhaseScheduler)")
    rep.add("grpo_http_concurrent_lock_makespan", con_lock, "s", baseline="grpo_http_sequential_makespan",
            limit="grpo_http_concurrent_bound", note="same, second server with --scheduler lock (base lock only)")
    rep.add("load_average_1min", (load0 + load1) / 2, "", note=f"machine load: {load0:.1f} at start, {load1:.1f} "
            f"at end of the GRPO part (2 cores shared: above ~2, other jobs take CPU from the runs)")
    ratio = seq / con
    rep.target(f"3 concurrent GRPO clients through the server {ratio:.2f}x faster than sequential "
               f"(MinT: {MINT_GRPO}x)", ratio >= MINT_GRPO)
    return {"makespan": (seq, con, con_lock), "bound": bound}


def run(args: argparse.Namespace) -> BenchReport:
    """Start a server on a fresh store, measure, stop it."""
    from rich.progress import Progress

    from dsv4flash.service.protocol.launch import ServerProcess

    torch.set_num_threads(1)
    if args.trainer == "megatron":
        from dsv4flash.bench.service_http_megatron import run_megatron

        with Progress(transient=True) as progress:
            return run_megatron(args, progress)
    rep = BenchReport("dsv4flash serve vs in-process service (tiny, 1 thread each side)")
    root = Path(tempfile.mkdtemp(prefix="dsv4flash-bench-http-"))
    (root / "keys").write_text(f"bench {KEY}\nflood {_FLOOD_KEY}\n")
    lat = grpo = None
    with ServerProcess(root / "store", root / "keys", poll_s=30.0) as server, Progress(transient=True) as progress:
        if args.part in ("all", "latency"):
            lat = _latency(server.url, rep, args.calls, progress)
        if args.part in ("all", "fairness"):
            _fairness(server.url, _FLOOD_KEY, rep, args.calls, args.flood_requests, server.proc.pid, progress)
        if args.part in ("all", "grpo"):
            with ServerProcess(root / "store-lock", root / "keys", poll_s=30.0,
                               args=("--scheduler", "lock")) as lock_server:
                grpo = _grpo(server.url, lock_server.url, rep, args.grpo_steps, args.reward_latency, progress)
    if args.plot:
        _plot(lat, grpo, args.plot, rep.title)
    return rep


def _plot(lat, grpo, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (lat, grpo) if p]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5)) if len(panels) == 2 else plt.subplots(1, 1, figsize=(5.5, 3.5))
    axes = list(axes) if len(panels) == 2 else ([axes, None] if lat else [None, axes])
    if lat:
        names = ["step_local", "step_http", "sample_local", "sample_http"]
        x = np.arange(len(names))
        axes[0].bar(x - 0.2, [lat[n][0] for n in names], 0.4, label="p50")
        axes[0].bar(x + 0.2, [lat[n][1] for n in names], 0.4, label="p99")
        axes[0].set_xticks(x, [n.replace("_", "\n") for n in names])
        axes[0].set_ylabel("ms per call")
        axes[0].legend()
    if grpo:
        axes[1].bar(["sequential", "concurrent\n(phase)", "concurrent\n(lock)", "bound"],
                    [*grpo["makespan"], grpo["bound"]], color=["C0", "C1", "C2", "k"])
        axes[1].set_ylabel("GRPO makespan (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
