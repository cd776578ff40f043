"""`python -m dsv4flash.bench codecs`: stored-format decode/encode bandwidth next to memcpy and a naive decode.

Every operation runs `--repeats` times, interleaved round by round so a busy machine slows all of them alike,
and the best time counts. Bandwidth is bytes written per second: decoded output bytes for decode (into a
reused buffer, as a streaming converter does), input bytes for encode, and bytes copied for memcpy (a torch
`copy_` between two warm buffers as large as the largest decoded output). The naive decode is the
per-element reference of `dsv4flash_bridge.naive_codecs` timed on a small sample and scaled per element.
The streaming-convert peak-RSS figure imports a synthetic release-format checkpoint (`--convert-config`,
by default a mid-size one with the release's structure) in a fresh process and compares the peak RSS growth
with the checkpoint's largest decoded tensor (`dsv4flash_bridge.convert.bench_convert`).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from dsv4flash.bench.report import BenchReport

# name -> (logical shape, release example); the default sizes are one real tensor of each layout.
LAYOUTS = {
    "dense_fp8": ((5120, 8192), "layers.*.attn.wo_b.weight"),
    "mxfp4": ((2304, 5120), "layers.*.ffn.experts.*.w1.weight"),
    "engram_fp8": ((65536, 256), "a 65 536-row slice of layers.1.engram.embed.weight"),
}
DECODE_TARGET = 0.25  # decode >= 25% of memcpy bandwidth
RSS_TARGET = 3.0  # streaming-convert peak RSS <= 3× the largest tensor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per operation (best counts)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every tensor's row count")
    parser.add_argument("--naive-elements", type=int, default=4096, help="elements decoded by the naive reference")
    parser.add_argument("--plot", metavar="PNG", help="also draw decode bandwidth per layout as a bar chart")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave as is)")
    parser.add_argument("--convert-config", default="mid",
                        help="checkpoint for the streaming-convert RSS figure: 'mid' (release structure, hidden 512, "
                             "4 experts, Engram tables of 2^18·scale rows) or a flavour name / config.json path")
    parser.add_argument("--convert-naming", choices=("release", "megatron"), default="release",
                        help="output naming of the measured import")


def _stored(layout: str, rows: int, cols: int):
    """A stored (weight, scale) pair of the layout from Gaussian weights, plus the bf16 weights."""
    from dsv4flash_bridge import codecs

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    encode = {"dense_fp8": codecs.encode_dense_fp8, "mxfp4": codecs.encode_mxfp4,
              "engram_fp8": codecs.encode_engram_fp8}[layout]
    return w, *encode(w)


def _naive_seconds_per_element(layout: str, q: torch.Tensor, s: torch.Tensor, elements: int) -> float:
    """Time the per-element Python reference on the first rows of the tensor (about `elements` values)."""
    from dsv4flash_bridge import naive_codecs

    if layout == "dense_fp8":  # one 32-row block row, as many 32-column blocks as the sample allows
        rows, cols = min(32, q.shape[0]), min(q.shape[1], max(32, elements // 32 // 32 * 32))
        codes, scale = q[:rows, :cols].view(torch.uint8).tolist(), s[:1, : -(-cols // 32)].view(torch.uint8).tolist()
    else:
        width = q.shape[1] * (2 if layout == "mxfp4" else 1)
        rows = max(1, min(q.shape[0], elements // width))
        cols = width
        codes, scale = q[:rows].view(torch.uint8).tolist(), s[:rows].view(torch.uint8).tolist()
    fn = {"dense_fp8": naive_codecs.decode_dense_fp8, "mxfp4": naive_codecs.decode_mxfp4,
          "engram_fp8": naive_codecs.decode_engram_fp8}[layout]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn(codes, scale)
        best = min(best, time.perf_counter() - start)
    return best / (rows * cols)


def _time(fn: Callable[[], object], best: dict, key: str) -> None:
    """Run once and keep the best time under `key`."""
    start = time.perf_counter()
    fn()
    best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)


def run(args: argparse.Namespace) -> BenchReport:
    """Measure memcpy, naive decode and vectorised decode/encode for every layout in one run."""
    from dsv4flash_bridge import codecs

    if args.threads:
        torch.set_num_threads(args.threads)
    report = BenchReport(f"stored-format codecs (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    cases, ops = {}, {}
    for layout, ((rows, cols), example) in LAYOUTS.items():
        rows = max(32, int(rows * args.scale))
        w, q, s = _stored(layout, rows, cols)
        decode = {"dense_fp8": codecs.decode_dense_fp8, "mxfp4": codecs.decode_mxfp4,
                  "engram_fp8": codecs.decode_engram_fp8}[layout]
        encode = {"dense_fp8": codecs.encode_dense_fp8, "mxfp4": codecs.encode_mxfp4,
                  "engram_fp8": codecs.encode_engram_fp8}[layout]
        outs = {dt: torch.empty(rows, cols, dtype=dt) for dt in (torch.bfloat16, torch.float32)}
        cases[layout] = (rows, cols, example, q, s)
        for dt, out in outs.items():
            ops[f"{layout} decode {_short(dt)}"] = (lambda d=decode, q=q, s=s, o=out, t=dt: d(q, s, dtype=t, out=o))
        ops[f"{layout} encode"] = lambda e=encode, w=w: e(w)
        ops[f"{layout} encode like_scale"] = lambda e=encode, w=w, s=s: e(w, like_scale=s)
    largest = max(r * c * 4 for r, c, *_ in cases.values())
    src, dst = torch.randn(largest // 4), torch.empty(largest // 4)
    ops = {"memcpy": lambda: dst.copy_(src), **ops}
    best: dict[str, float] = {}
    for name, fn in ops.items():  # warm-up (page faults, lazy init) outside the timed rounds
        fn()
    for _ in range(max(1, args.repeats)):
        for name, fn in ops.items():
            _time(fn, best, name)
    report.add("memcpy", largest / best["memcpy"] / 1e9, "GB/s", note=f"torch copy_ of {largest / 2**20:.0f} MiB")
    for layout, (rows, cols, example, q, s) in cases.items():
        per_element = _naive_seconds_per_element(layout, q, s, args.naive_elements)
        stored = q.numel() * q.element_size() + s.numel()
        for dt in (torch.bfloat16, torch.float32):
            naive = f"{layout} naive decode {_short(dt)}"
            report.add(naive, dt.itemsize / per_element / 1e9, "GB/s", note="per-element Python reference, scaled")
            fig = f"{layout} decode {_short(dt)}"
            report.add(fig, rows * cols * dt.itemsize / best[fig] / 1e9, "GB/s", baseline=naive, limit="memcpy",
                       note=f"{rows}×{cols} ({example}); {stored / 2**20:.1f} MiB stored")
            report.target(f"{fig} >= {DECODE_TARGET:.0%} of memcpy",
                          report.value(fig) >= DECODE_TARGET * report.value("memcpy"))
        for kind in ("encode", "encode like_scale"):
            fig = f"{layout} {kind}"
            report.add(fig, rows * cols * 2 / best[fig] / 1e9, "GB/s", limit="memcpy", note="bf16 input bytes")
    _convert_rss(report, args)
    if args.plot:
        _plot(report, list(cases), args.plot)
    return report


def _short(dtype: torch.dtype) -> str:
    """'bf16' / 'fp32'."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def _convert_rss(report: BenchReport, args: argparse.Namespace) -> None:
    """Streaming-convert peak RSS vs the largest tensor, importing a synthetic release-format checkpoint."""
    from dsv4flash_bridge.convert import bench_convert  # (RSS growth, process peak, largest, stored, tensors)

    growth, peak, largest, stored, tensors = bench_convert(args.convert_config, args.scale,
                                                           naming=args.convert_naming)
    report.add("convert largest tensor", largest / 2**20, "MiB",
               note=f"decoded BF16 bytes; {args.convert_config} checkpoint, {tensors} tensors, "
                    f"{stored / 2**20:.0f} MiB stored")
    report.add("convert peak RSS growth", growth / 2**20, "MiB", baseline="convert largest tensor",
               note=f"peak RSS during import ({args.convert_naming} naming, 32 MiB chunks) minus RSS before it")
    report.add("convert process peak RSS", peak / 2**20, "MiB", baseline="convert largest tensor",
               note="includes the Python + torch baseline")
    report.target(f"streaming-convert peak RSS growth <= {RSS_TARGET:g}× largest tensor", growth <= RSS_TARGET * largest)


def _plot(report: BenchReport, layouts: list[str], path: str) -> None:
    """Bar chart: per layout, naive / bf16 / fp32 decode, with memcpy and the 25% target as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = [("naive decode bf16", "naive (Python)"), ("decode bf16", "decode → bf16"), ("decode fp32", "decode → fp32")]
    width = 0.8 / len(series)
    for i, (suffix, label) in enumerate(series):
        values = [report.value(f"{layout} {suffix}") for layout in layouts]
        ax.bar([x + i * width for x in range(len(layouts))], values, width, label=label)
    memcpy = report.value("memcpy")
    ax.axhline(memcpy, color="k", linestyle="--", label=f"memcpy {memcpy:.1f} GB/s")
    ax.axhline(DECODE_TARGET * memcpy, color="r", linestyle=":", label=f"target {DECODE_TARGET:.0%} of memcpy")
    ax.set_xticks([x + width for x in range(len(layouts))], layouts)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s written (log)")
    ax.set_title(report.title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
