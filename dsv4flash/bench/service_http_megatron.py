"""`python -m dsv4flash.bench service_http --trainer megatron`: the Megatron compute plane against the local trainer.

Two servers on one fresh store each, started side by side in one run: `--trainer local` (the resident base in the
server) and `--trainer megatron --trainer-layout ep=2 --sampler dsv4flash` (veRL's Megatron workers on Ray, fp32
over gloo on a CPU machine, a dsv4flash sampler replica). Figures, all through the real tinker SDK on the same
work: the per-call time of forward_backward+optim_step on each (the Megatron plane's overhead: Ray round trips,
the batch through veRL's engine, the slot commits); the slot-swap cost per call (two policies alternating on the
group against one policy, with the swapped bytes and seconds from `/metrics`); and 3 concurrent GRPO clients
against the same clients one after another through the group (MinT: 1.77×), beside the zero-idle bound.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from dsv4flash.bench.report import BenchReport
from dsv4flash.bench.sdk_workloads import KEY, MINT_GRPO, pct, sequential_vs_concurrent, sl_data, timed

START_S = 1800  # a loaded machine starts the Megatron workers slowly


def _metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", headers={"X-API-Key": KEY}, timeout=120).text.splitlines():
        if line.startswith("dsv4flash_trainer_") and "{" not in line:
            name, value = line.split()
            out[name.removeprefix("dsv4flash_trainer_")] = float(value)
    return out


def _step_fn(url: str, seed: int):
    import tinker
    from tinker import types

    tc = tinker.ServiceClient(base_url=url, api_key=KEY).create_lora_training_client(
        base_model="tiny", rank=4, seed=seed).result()
    data = sl_data(types)

    def step():
        fb, opt = tc.forward_backward(data, "cross_entropy"), tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), opt.result()

    return step


def run_megatron(args, progress) -> BenchReport:
    """Start both servers, measure, stop them."""
    import os

    from dsv4flash.service.protocol.launch import ServerProcess

    rep = BenchReport(f"dsv4flash serve --trainer megatron ({args.trainer_layout}, --sampler {args.sampler}) vs "
                      f"--trainer local (tiny, CPU)")
    root = Path(tempfile.mkdtemp(prefix="dsv4flash-bench-megatron-"))
    (root / "keys").write_text(f"bench {KEY}\n")
    plane = ("--trainer", "megatron", "--trainer-layout", args.trainer_layout, "--sampler", args.sampler)
    t0 = time.perf_counter()
    with ServerProcess(root / "store-local", root / "keys", poll_s=30.0) as local, \
            ServerProcess(root / "store-megatron", root / "keys", poll_s=30.0, args=plane,
                          start_timeout_s=START_S) as megatron:
        rep.add("megatron_server_start", time.perf_counter() - t0, "s", note="Ray, veRL's Megatron engine on every "
                "rank, the adapter map, the sampler replica (the local server started beside it)")
        task = progress.add_task("per call: local, megatron", total=2)
        local_step = timed(_step_fn(local.url, 1), args.calls, progress, "fwd+bwd+optim, --trainer local")
        progress.advance(task)
        meg_step = timed(_step_fn(megatron.url, 1), args.calls, progress, "fwd+bwd+optim, --trainer megatron")
        progress.advance(task)
        for q in (50, 99):
            rep.add(f"step_local_p{q}", pct(local_step, q), "ms", note="tinker SDK -> --trainer local")
            rep.add(f"step_megatron_p{q}", pct(meg_step, q), "ms", baseline=f"step_local_p{q}",
                    limit=f"step_local_p{q}", note=f"same work -> --trainer megatron ({args.trainer_layout}); the "
                    f"limit is the local figure (a plane that added nothing)")
        rep.add("megatron_overhead_p50", rep.value("step_megatron_p50") - rep.value("step_local_p50"), "ms",
                note="per fwd+bwd+optim call: Ray round trips, veRL's batch path, slot commits, 2-rank collectives")

        # slot swaps: two policies alternating (every call swaps) against one policy (no swap)
        a, b = _step_fn(megatron.url, 2), _step_fn(megatron.url, 3)
        before = _metrics(megatron.url)
        alternating = timed(lambda: (a(), b()), args.calls // 2, progress, "two policies alternating")
        after = _metrics(megatron.url)
        swaps = after["swaps_total"] - before["swaps_total"]
        rep.add("step_two_policies_alternating_p50", pct(alternating, 50) / 2, "ms", baseline="step_megatron_p50",
                note="per call, each call swapping the other policy's slot in")
        rep.add("swap_bytes_per_swap", (after["swap_bytes_total"] - before["swap_bytes_total"]) / max(swaps, 1) / 1024,
                "KiB", note=f"adapter values, Adam moments, pending gradients, all ranks ({swaps:.0f} swaps)")
        rep.add("swap_ms_per_swap", 1e3 * (after["swap_seconds_total"] - before["swap_seconds_total"]) / max(swaps, 1),
                "ms", note="host slot -> live tensors, slowest rank")
        rep.add("live_adapter_bytes", after["live_bytes"] / 1024, "KiB", note=f"one policy's live tensors per rank "
                f"with {after['policies']:.0f} policies holding slots")

        task = progress.add_task("GRPO through the worker group: sequential, 3 concurrent", total=2)
        load0 = os.getloadavg()[0]
        runs = sequential_vs_concurrent(megatron.url, args.grpo_steps, args.reward_latency,
                                        lambda: progress.advance(task))
        seq, con, scoring, bound = runs["sequential"], runs["concurrent"], runs["scoring"], runs["bound"]
        rep.add("grpo_megatron_sequential_makespan", seq, "s", note=f"3 clients x {args.grpo_steps} steps one after "
                f"another; scoring {scoring:.1f}s of it")
        rep.add("grpo_megatron_concurrent_bound", bound, "s", note="zero-idle bound: max(sequential minus scoring, "
                "one client's makespan)")
        rep.add("grpo_megatron_concurrent_makespan", con, "s", baseline="grpo_megatron_sequential_makespan",
                limit="grpo_megatron_concurrent_bound", note="3 SDK clients at once: rollouts on the sampler "
                "replica overlap updates on the trainer group and rewards")
        rep.add("load_average_1min", (load0 + os.getloadavg()[0]) / 2, "", note="2 cores shared: above ~2, other "
                "jobs take CPU from the runs")
        ratio = seq / con
        rep.target(f"3 concurrent GRPO clients through the Megatron group {ratio:.2f}x faster than sequential "
                   f"(MinT: {MINT_GRPO}x; zero-idle bound {seq / bound:.2f}x)", ratio >= MINT_GRPO)
    return rep
