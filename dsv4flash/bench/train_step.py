"""LoRA training step time: `decoder_half` with early stop vs `full_linear` at the same rank (tiny model, CPU).

One step = forward, backward and AdamW update of the adapters on a fixed geometry batch (SFT loss). The
two placements are timed interleaved (A, B, A, B, ...) so machine load drifts hit both alike; figures are
medians. Also shown: decoder_half without early stop (what stopping the backward buys) and a no-grad
forward of the whole model (a step cannot be faster: the limit). Target (the study's step-time saving,
carried to this CPU): decoder_half ≤ 0.65 × full_linear.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from dsv4flash.bench.report import BenchReport

TARGET_RATIO = 0.65


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of both placements (default 16)")
    parser.add_argument("--batch", type=int, default=16, help="rows per step (default 16)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per placement (default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per placement (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart of the step times")


def _setup(preset: str, rank: int, early_stop: bool, batch):
    from dsv4flash.engine.losses import sft_loss, token_logprobs
    from dsv4flash.lora import LoraConfig, apply_lora, forward_with_early_stop, param_groups
    from dsv4flash.model.transformer import Transformer

    model = Transformer("tiny", seed=0)
    handle = apply_lora(model, LoraConfig(preset=preset, rank=rank))
    opt = torch.optim.AdamW(param_groups(model, handle, 1e-3))
    forward = partial(forward_with_early_stop, model) if early_stop else model

    def step() -> float:
        t0 = time.perf_counter()
        logits = forward(batch.input_ids, batch.token_types, batch.images)
        loss = sft_loss(token_logprobs(logits, batch.input_ids), batch.target_mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return model, handle, step


def run(args: argparse.Namespace) -> BenchReport:
    """Time the placements side by side and report the ratio against the target."""
    from dsv4flash.config import load_config
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import Encoder, TaskMixture, TaskTokenizer, build_task

    torch.set_num_threads(args.threads)
    cfg = load_config("tiny")
    mix = TaskMixture({"geometry": build_task("geometry")}, {"geometry": 1.0}, seed=0, val_size=0)
    batch = Encoder(TaskTokenizer(cfg), cfg).batch([ex for _, ex in mix.train_batch(0, args.batch)])
    runs = {
        "full_linear": _setup("full_linear", args.rank, False, batch),
        "decoder_half": _setup("decoder_half", args.rank, True, batch),
        "decoder_half_no_early_stop": _setup("decoder_half", args.rank, False, batch),
    }
    plain = Transformer("tiny", seed=0).requires_grad_(False)

    def forward_only() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            plain(batch.input_ids, batch.token_types, batch.images)
        return time.perf_counter() - t0

    timers = {name: step for name, (_, _, step) in runs.items()}
    timers["forward_no_grad"] = forward_only
    for _ in range(args.warmup):
        for fn in timers.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(args.repeats):
        for name, fn in timers.items():
            samples[name].append(fn())
    med = {name: statistics.median(v) for name, v in samples.items()}

    rep = BenchReport(f"LoRA train step, tiny model, rank {args.rank}, batch {args.batch} "
                      f"(seq {batch.input_ids.shape[1]}), {args.threads} thread(s), median of {args.repeats}")
    full_params = runs["full_linear"][1].trainable_params
    dec_params = runs["decoder_half"][1].trainable_params
    rep.add("full_linear_step", med["full_linear"] * 1e3, "ms", limit="forward_no_grad",
            note=f"{full_params:,} adapter params")
    rep.add("decoder_half_step", med["decoder_half"] * 1e3, "ms", baseline="full_linear_step",
            limit="forward_no_grad", note=f"early stop at layer {cfg.decoder_start}; {dec_params:,} adapter params")
    rep.add("decoder_half_no_early_stop_step", med["decoder_half_no_early_stop"] * 1e3, "ms",
            baseline="full_linear_step", note="same adapters, backward through the frozen encoder")
    rep.add("forward_no_grad", med["forward_no_grad"] * 1e3, "ms", note="whole model, no autograd (floor)")
    ratio = med["decoder_half"] / med["full_linear"]
    rep.target(f"decoder_half / full_linear step time {ratio:.3f} <= {TARGET_RATIO}", ratio <= TARGET_RATIO)
    if args.plot:
        _plot(med, args.plot, rep.title)
    return rep


def _plot(med: dict[str, float], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["full_linear", "decoder_half", "decoder_half_no_early_stop", "forward_no_grad"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bars = ax.barh(names, [med[n] * 1e3 for n in names], color=["#888", "#2a7", "#7a2", "#aaa"])
    ax.bar_label(bars, fmt="%.0f ms")
    ax.axvline(med["full_linear"] * 1e3 * TARGET_RATIO, ls="--", color="r",
               label=f"target {TARGET_RATIO}× full_linear")
    ax.set_xlabel("step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
