"""Host-table Engram lookup: gathered GB/s of `HostTable.gather` next to a same-size memcpy, in one run.

The bound is a contiguous copy of as many bytes as the gather must move (the distinct rows of one micro-batch):
pinned host -> device on a CUDA machine, host -> host otherwise. `HostTable.gather_stored` (rows in the stored
format, the target figure) adds id dedup on the device, the id copy to the host, a random-row gather out of a
table far larger than any cache, overlapped with the chunked copy, and the per-token expand on the device.
`lookup` is the full `HostTable.gather` (plus FP8 -> BF16 dequantization on the device). The naive baseline
copies every (token, column) row id to the host, gathers every row with advanced indexing and copies them over.
On a CPU-only machine rows land on the host itself: nothing is deduplicated or transferred.

Row ids (`--ids tasks`, the default) are the real layer-1 n-gram hashes (`EngramHasher` of the release config:
its primes, offsets and multipliers) over the built-in tasks' token streams (every task's prompts and
answers, image spans DEAD), folded into the bench table's rows by `mod rows` (the release table has 384 M
rows; the fold keeps which tokens share a row). The task tokens are compressed ids themselves (an identity
token map onto the 99 092 compressed ids; no release tokenizer is downloaded). `--ids uniform` draws uniform
random ids instead. `limit_GBps` is the physical limit for a random-row gather measured over the same
distinct ids: the best of plain `index_select` into a preallocated buffer over sorted and over unsorted ids.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dsv4flash.bench.report import BenchReport
from dsv4flash.integrations.mcore.host_table import FP8_BLOCK, HostTable

_FORMATS = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the `engram` benchmark."""
    parser.add_argument("--table-gib", type=float, default=1.0, help="host table size (GiB, values + scales)")
    parser.add_argument("--dim", type=int, default=256, help="row width (the release: 256)")
    parser.add_argument("--format", choices=sorted(_FORMATS), default="fp8", help="stored row format")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--cols", type=int, default=24, help="row ids per token (3 orders x 8 heads)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="auto", help="where row ids live and rows land: auto, cpu, cuda")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for the host gather (0: torch's default)")
    parser.add_argument("--ids", choices=("tasks", "uniform"), default="tasks",
                        help="row ids: real n-gram hashes of the built-in tasks' token streams, or uniform random")
    parser.add_argument("--plot", metavar="PNG", help="also draw the GB/s figures as a bar chart")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up: staging buffers, allocator, page faults
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _random_table(rows: int, dim: int, dtype: torch.dtype, seed: int) -> HostTable:
    table = HostTable.empty(rows, dim, dtype, name="bench table")
    gen = torch.Generator().manual_seed(seed)
    if table.fp8:
        # Random E4M3 bit patterns without the NaN codes (0x7F/0xFF), random E8M0 scales near 2^0.
        bits = torch.randint(0, 0x7F, (rows, dim), dtype=torch.uint8, generator=gen)
        table.weight.view(torch.uint8).copy_(bits)
        table.scale.copy_(torch.randint(120, 128, table.scale.shape, dtype=torch.uint8, generator=gen))
    else:
        table.weight.copy_(torch.randn(rows, dim, generator=gen).to(dtype))
    return table


def task_row_ids(tokens: int, cols: int, rows: int, seed: int = 0) -> torch.Tensor:
    """[tokens, cols] layer-1 Engram row ids of the built-in tasks' token streams, folded into `rows` rows."""
    from dsv4flash.config import load_config
    from dsv4flash.model.engram import EngramHasher
    from dsv4flash.tasks import TASKS, Encoder, TaskMixture, TaskTokenizer, build_task

    flash, tiny = load_config("flash"), load_config("tiny")
    hasher = EngramHasher(flash)
    text = flash.text
    hasher.set_token_map(torch.arange(text.vocab_size) % text.engram_compressed_vocab_size)
    encoder = Encoder(TaskTokenizer(tiny), tiny)
    mixture = TaskMixture({name: build_task(name) for name in TASKS}, dict.fromkeys(TASKS, 1.0), seed=seed, val_size=0)
    ids, types, step = [], [], 0
    while sum(t.numel() for t in ids) < tokens:
        batch = encoder.batch([ex for _, ex in mixture.train_batch(step, 64)])
        for row, row_types, n in zip(batch.input_ids, batch.token_types, batch.lengths.tolist()):
            ids.append(row[:n])
            types.append(row_types[:n])
        step += 1
    stream, stream_types = torch.cat(ids)[:tokens], torch.cat(types)[:tokens]
    row_ids = hasher(stream[None], stream_types[None])[0][0]  # [tokens, 24]: orders 2..4 x 8 heads
    if cols > row_ids.shape[1]:
        raise ValueError(f"--cols {cols}: the release hashes {row_ids.shape[1]} row ids per token")
    return row_ids[:, :cols] % rows


def run(args: argparse.Namespace) -> BenchReport:
    """Measure memcpy, the deduplicating host gather and the naive per-token gather at one micro-batch size."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = _FORMATS[args.format]
    scale_bytes = args.dim // FP8_BLOCK if args.format == "fp8" else 0
    row_bytes = args.dim * torch.empty(0, dtype=dtype).element_size() + scale_bytes
    rows = max(1, int(args.table_gib * 2**30 // row_bytes))
    table = _random_table(rows, args.dim, dtype, seed=0)
    if args.ids == "tasks":
        ids = task_row_ids(args.tokens, args.cols, rows).to(device)
    else:
        ids = torch.randint(0, rows, (args.tokens, args.cols), generator=torch.Generator().manual_seed(1)).to(device)
    out_dtype = torch.bfloat16 if table.fp8 else None

    table.gather_stored(ids)
    unique = table.stats.unique
    moved = table.stats.bytes_moved  # rows actually gathered x (values + scales)

    # The bound reads from the table itself (DRAM, not cache): a different contiguous slice each repeat.
    flat = table.weight.view(torch.uint8).reshape(-1)
    dst = torch.empty(moved, dtype=torch.uint8, device=device)
    slices = iter(range(10**9))

    def memcpy():
        start = (next(slices) * 3 * moved) % max(1, flat.numel() - moved)
        dst.copy_(flat[start:start + moved], non_blocking=table.pinned)

    t_copy = _best_of(memcpy, args.repeats, device)
    t_gather = _best_of(lambda: table.gather_stored(ids), args.repeats, device)
    t_lookup = _best_of(lambda: table.gather(ids, out_dtype), args.repeats, device)

    def naive():
        host_ids = ids.reshape(-1).to("cpu")
        values = table.weight[host_ids].to(device)
        if table.fp8:
            table.scale[host_ids].to(device)
        return values

    t_naive = _best_of(naive, args.repeats, device)

    # The limit: the best plain random-row gather of the same distinct rows on this machine, into host buffers.
    distinct = torch.unique(ids.reshape(-1).cpu())
    shuffled = distinct[torch.randperm(distinct.numel(), generator=torch.Generator().manual_seed(2))]
    bufs = [torch.empty(distinct.numel(), *t.shape[1:], dtype=t.dtype) for t in (table.weight, table.scale)
            if t is not None]

    def plain(order):
        def gather():
            for src, buf in zip((table.weight, table.scale), bufs):
                torch.index_select(src, 0, order, out=buf)
        return gather

    t_limit = min(_best_of(plain(distinct), args.repeats, device), _best_of(plain(shuffled), args.repeats, device))

    report = BenchReport(f"engram host-table gather ({args.ids} ids, {args.format} rows of {args.dim}, table "
                         f"{rows * row_bytes / 2**30:.2f} GiB, {args.tokens} tokens x {args.cols} ids, device {device.type}, "
                         f"{'pinned' if table.pinned else 'pageable'} host memory, {torch.get_num_threads()} threads)")
    gbps = moved / 1e9
    report.add("memcpy_GBps", gbps / t_copy, "GB/s",
               note=f"contiguous {moved / 1e6:.1f} MB of the table, host->{device.type}")
    report.add("limit_GBps", gbps / t_limit, "GB/s", limit="memcpy_GBps",
               note="best plain index_select of the same distinct rows (sorted or not): the gather limit")
    report.add("gather_GBps", gbps / t_gather, "GB/s", baseline="limit_GBps", limit="memcpy_GBps",
               note="HostTable.gather_stored: dedup, id copy, chunked gather+copy, expand")
    report.add("lookup_GBps", gbps / t_lookup, "GB/s", limit="memcpy_GBps",
               note="HostTable.gather: the same + dequantize to bf16" if table.fp8 else "HostTable.gather")
    report.add("naive_GBps", gbps / t_naive, "GB/s", limit="memcpy_GBps",
               note="every (token, column) row, advanced indexing (same useful bytes)")
    report.add("gather_ms", t_gather * 1e3, "ms", baseline="naive_ms")
    report.add("lookup_ms", t_lookup * 1e3, "ms")
    report.add("naive_ms", t_naive * 1e3, "ms")
    report.add("distinct_rows", unique, "rows", note=f"of {ids.numel()} requested")
    ratio, vs_limit = t_copy / t_gather, t_limit / t_gather
    report.target(f"gathered GB/s >= 50% of the memcpy bound ({ratio:.0%}) or >= 90% of the measured gather "
                  f"limit ({vs_limit:.0%})", ratio >= 0.5 or vs_limit >= 0.9)
    if args.plot:
        _plot(report, Path(args.plot))
    return report


def _plot(report: BenchReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["memcpy_GBps", "limit_GBps", "gather_GBps", "lookup_GBps", "naive_GBps"]
    values = [report.value(n) for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(["memcpy (bound)", "gather limit", "gather_stored", "gather (+dequant)", "naive"], values,
                  color=["#888888", "#bbbbbb", "#1f77b4", "#2ca02c", "#ff7f0e"])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel("GB/s of distinct rows")
    ax.set_title(report.title, fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
