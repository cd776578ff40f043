"""Tiny reference model step time: forward and forward+backward at S=64, next to this machine's sgemm rate."""

from __future__ import annotations

import argparse
import time

import torch

from dsv4flash.bench.report import BenchReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the `model` benchmark."""
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)


def _best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _model_flops(model, tokens: int) -> float:
    # 2 FLOPs per weight use; experts counted at top-k/n_experts of their weights, tables not at all.
    text = model.cfg.text
    active = 0
    for name, p in model.named_parameters():
        if name.startswith(("vision.", "aligner.", "embed.")) or "engram.embed" in name or p.dim() < 2:
            continue
        share = text.num_experts_per_tok / text.n_routed_experts if ".experts." in name else 1.0
        active += p.numel() * share
    return 2.0 * active * tokens


def run(args: argparse.Namespace) -> BenchReport:
    """Measure the tiny model's forward and forward+backward time and compare with a plain sgemm."""
    from dsv4flash.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer("tiny", seed=0)
    ids = torch.randint(3, 500, (args.batch, args.seq))

    def forward():
        with torch.no_grad():
            model(ids)

    def step():
        model.zero_grad(set_to_none=True)
        model(ids).logsumexp(-1).mean().backward()

    fwd = _best_of(forward, args.repeats)
    fwd_bwd = _best_of(step, args.repeats)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    gemm = _best_of(lambda: a @ b, 20)
    gemm_gflops = 2 * 512**3 / gemm / 1e9
    flops = 3 * _model_flops(model, args.batch * args.seq)
    report = BenchReport(f"tiny reference model, B={args.batch} S={args.seq}, {torch.get_num_threads()} threads")
    report.add("forward_ms", fwd * 1e3, "ms")
    report.add("fwd_bwd_ms", fwd_bwd * 1e3, "ms", baseline="forward_ms")
    report.add("tokens_per_s", args.batch * args.seq / fwd_bwd, "tok/s")
    report.add("sgemm_gflops", gemm_gflops, "GFLOP/s", note="512³ fp32 matmul: the compute bound")
    report.add("model_gflops", flops / fwd_bwd / 1e9, "GFLOP/s", limit="sgemm_gflops",
               note="dense-equivalent FLOPs of the step (tiny shapes are op-overhead bound)")
    report.target("tiny forward+backward at S=64 well under a second", fwd_bwd < 1.0)
    return report
