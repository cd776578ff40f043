"""Incremental decode with the CSA2 cache vs full recompute per token, and the shared-prefill cache memory.

decode: one prompt, then n tokens teacher-forced from a fixed random stream (the work per step does not depend
on which token comes), on the tiny model and one thread. `cached` = `prefill` once + one `decode` step per
token; `full` = today's recompute: one full forward over prompt + generated tokens per token. Both run in this
process, one after the other. The cached run is timed at every step, so its cumulative time at 64, 256 and
1024 tokens comes from one run; full-recompute steps are timed exactly up to `--exact-upto` tokens and beyond
that at `--full-samples` evenly spaced lengths, linearly interpolated between them (a full step's cost is a
smooth function of its length), which the note of each figure says. The bound of a decode step is one forward
over a single token with no history (what a step would cost if the cache were free).

memory: N decoder-only adapters with the KV write frozen share one prompt prefill (`multi_adapter_logits(...,
caches=True)`): bytes per extra adapter vs a full per-adapter prompt cache, measured at tiny size and computed
at the V4.1 shape (bf16 cache entries) for `--v41-prompt` tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dsv4flash.bench.report import BenchReport

TARGET_RATIO = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the `decode` benchmark."""
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024], help="generated tokens")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--exact-upto", type=int, default=256, help="time every full-recompute step up to here")
    parser.add_argument("--full-samples", type=int, default=16, help="timed full-recompute steps beyond that")
    parser.add_argument("--adapters", type=int, default=8, help="adapters sharing one prompt prefill")
    parser.add_argument("--v41-prompt", type=int, default=8192, help="prompt length of the computed V4.1 figures")
    parser.add_argument("--plot", metavar="PNG", help="also draw tokens/s vs generated length")


def _progress(total: int, what: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
    return bar, bar.add_task(what, total=total)


@torch.no_grad()
def _cached_steps(model, stream: torch.Tensor, prompt: int, n: int) -> tuple[float, list[float]]:
    """-> (prefill seconds, cumulative seconds after each of n decode steps)."""
    t0 = time.perf_counter()
    _, cache = model.prefill(stream[:, :prompt])
    prefill_s = time.perf_counter() - t0
    cumulative, total = [], 0.0
    bar, task = _progress(n, "cached decode")
    with bar:
        for i in range(n):
            t0 = time.perf_counter()
            _, cache = model.decode(cache, stream[:, prompt + i])
            total += time.perf_counter() - t0
            cumulative.append(total)
            bar.advance(task)
    return prefill_s, cumulative


@torch.no_grad()
def _full_step_times(model, stream: torch.Tensor, prompt: int, n: int, exact_upto: int,
                     samples: int) -> tuple[list[float], int]:
    """Seconds of full-recompute step i (a forward over prompt + i tokens) for i < n -> (times, steps timed)."""
    exact = list(range(min(n, exact_upto)))
    sampled = []
    if n > exact_upto:
        span = n - exact_upto
        sampled = sorted({exact_upto + round(k * (span - 1) / max(samples - 1, 1)) for k in range(samples)})
    timed: dict[int, float] = {}
    bar, task = _progress(len(exact) + len(sampled), "full recompute")
    with bar:
        for i in exact + sampled:
            t0 = time.perf_counter()
            model(stream[:, : prompt + i + 1])
            timed[i] = time.perf_counter() - t0
            bar.advance(task)
    known = sorted(timed)
    times = []
    for i in range(n):
        if i in timed:
            times.append(timed[i])
            continue
        hi = next(k for k in known if k > i)
        lo = max(k for k in known if k < i)
        times.append(timed[lo] + (timed[hi] - timed[lo]) * (i - lo) / (hi - lo))
    return times, len(known)


def _decode_part(args, rep: BenchReport) -> dict:
    from dsv4flash.model.transformer import Transformer

    model = Transformer("tiny", seed=0).eval()
    longest = max(args.lengths)
    stream = torch.randint(3, model.cfg.text.vocab_size, (1, args.prompt + longest),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(stream[:, :1])  # warm-up
        bound_s = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            model(stream[:, :1])
            bound_s = min(bound_s, time.perf_counter() - t0)
        t0 = time.perf_counter()
        model.prefill(stream[:, : args.prompt + longest])
        long_prefill_s = time.perf_counter() - t0
    prefill_s, cumulative = _cached_steps(model, stream, args.prompt, longest)
    full, n_timed = _full_step_times(model, stream, args.prompt, longest, args.exact_upto, args.full_samples)
    rep.add("one_token_forward_tok_s", 1 / bound_s, "tok/s", note="forward over 1 token, no history: a step's bound")
    rep.add("prefill_tok_s", args.prompt / prefill_s, "tok/s", note=f"prefill of the {args.prompt}-token prompt")
    rep.add(f"prefill_{args.prompt + longest}_tok_s", (args.prompt + longest) / long_prefill_s, "tok/s",
            note=f"prefill of {args.prompt + longest} tokens in one chunk")
    ratios = {}
    for n in sorted(args.lengths):
        full_s = sum(full[:n])
        estimated = n > args.exact_upto
        rep.add(f"full_{n}_tok_s", n / full_s, "tok/s",
                note=(f"{n_timed} of {n} steps timed, rest interpolated" if estimated else f"all {n} steps timed"))
        rep.add(f"cached_{n}_tok_s", n / cumulative[n - 1], "tok/s", baseline=f"full_{n}_tok_s",
                limit="one_token_forward_tok_s", note=f"prefill {args.prompt} + {n} decode steps, all timed")
        ratios[n] = full_s / cumulative[n - 1]
    longest_ratio = ratios[max(ratios)]
    grows = all(ratios[a] < ratios[b] for a, b in zip(sorted(ratios), sorted(ratios)[1:]))
    rep.target(f"cached vs full recompute at {max(ratios)} tokens: {longest_ratio:.1f}x >= {TARGET_RATIO:.0f}x",
               longest_ratio >= TARGET_RATIO)
    rep.target("the ratio grows with length: " + ", ".join(f"{n}: {r:.1f}x" for n, r in sorted(ratios.items())),
               grows)
    return {"cumulative": cumulative, "full": full, "lengths": sorted(args.lengths)}


def v41_prompt_cache_bytes(prompt: int, elem: int = 2) -> tuple[int, int]:
    """(full prompt cache bytes, bytes one extra shared adapter adds) at the release shape, `elem` bytes/entry."""
    from dsv4flash.config import load_config

    cfg = load_config("flash")
    text = cfg.text
    window = min(prompt, text.sliding_window - 1) * text.head_dim * elem
    sources = sum((prompt // cfg.backbone_plan[l].ratio) * (text.head_dim + text.index_head_dim) * elem
                  for l in text.kv_source_layer_ids)
    layers = len(cfg.backbone_plan)
    return layers * window + sources, (layers - cfg.decoder_start) * window


def _memory_part(args, rep: BenchReport) -> None:
    from dsv4flash.lora import LoraConfig
    from dsv4flash.model.cache import storage_bytes
    from dsv4flash.engine.resident import ResidentBase
    from dsv4flash.service.compute.shared_encoder import multi_adapter_logits

    resident = ResidentBase("tiny", device="cpu")  # the CPU figures
    pc = LoraConfig(preset="decoder_half", rank=4)
    gen = torch.Generator().manual_seed(0)
    adapters = [(pc, {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in resident.fresh_adapter(pc).items()})
                for _ in range(args.adapters)]
    ids = torch.randint(3, 400, (1, 256), generator=gen)
    caches = multi_adapter_logits(resident, ids, adapters, caches=True).caches
    alone = storage_bytes(caches[0])
    extra = (storage_bytes(*caches) - alone) / max(len(caches) - 1, 1)
    rep.add("tiny_prompt_cache_bytes", alone, "B", note="one adapter's full prompt cache, 256 tokens, fp32")
    rep.add("tiny_extra_adapter_bytes", extra, "B", baseline="tiny_prompt_cache_bytes",
            note=f"each of {len(caches) - 1} more adapters sharing the prefill: its decoder windows")
    full, per = v41_prompt_cache_bytes(args.v41_prompt)
    rep.add("v41_prompt_cache_bytes", full, "B", note=f"computed: {args.v41_prompt}-token prompt, bf16 entries")
    rep.add("v41_extra_adapter_bytes", per, "B", baseline="v41_prompt_cache_bytes",
            note="computed: 20 decoder layers x 127 window entries")


def run(args: argparse.Namespace) -> BenchReport:
    """Cached decode vs full recompute, then the shared-prefill memory figures."""
    torch.set_num_threads(args.threads)
    rep = BenchReport(f"incremental decode, tiny model, {args.threads} thread(s), prompt {args.prompt}")
    curves = _decode_part(args, rep)
    _memory_part(args, rep)
    if args.plot:
        _plot(curves, Path(args.plot), rep.title)
    return rep


def _plot(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(curves["cumulative"]) + 1)
    full_cum, total = [], 0.0
    for t in curves["full"]:
        total += t
        full_cum.append(total)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [n / t for n, t in zip(steps, curves["cumulative"])], label="cached decode")
    ax.plot(steps, [n / t for n, t in zip(steps, full_cum)], label="full recompute")
    for n in curves["lengths"]:
        ax.axvline(n, color="#ccc", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("tokens/s (cumulative)")
    ax.set_title(title, fontsize=8)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
