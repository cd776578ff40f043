"""`python -m dsv4flash.bench recompute`: activation memory and step time, full recompute vs none, side by side.

The model is the tiny V4.1 config built from megatron-core pieces (`DSV41ModelProvider`) with the
reference weights; both runs see the same batch. Activation memory is measured exactly, not sampled: every
tensor autograd saves for backward passes through `saved_tensors_hooks`, and the meter keeps the bytes of
the distinct storages alive at each moment (parameters excluded). Reported are the bytes held after the
forward and the peak over forward + backward (with recompute that peak includes the one chunk being
recomputed). Step time is the median forward+backward wall time over interleaved steps (the modes take
turns, so a load change on a shared machine hits all of them). For reference the report also gives the
naive cost of recompute, one more forward per recomputed layer; the stack's recompute is cheaper than that
because it replays the indexer's discrete selections instead of recomputing them.

On a CUDA machine megatron-core runs natively. On a CPU-only machine megatron-core needs the CUDA redirect
that lives with the tests (`tests/mcore_cpu/shim.py`, source checkouts only); the benchmark installs it in
its own process, which it discards afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from dsv4flash.bench.report import BenchReport

MIB = 2.0**20
MEMORY_TARGET = 3.0  # at least 3× less activation memory ...
TIME_TARGET = 1.4  # ... for at most 1.4× the step time
RECOMPUTED = ("full", "block", "block_target", "selective")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Batch shape, repetitions, recompute chunking and an optional plot."""
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size (default 2)")
    parser.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per mode, interleaved (default 9)")
    parser.add_argument("--chunk", type=int, default=1, help="layers per checkpointed chunk (uniform; default 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: stable timings on a shared machine)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the side-by-side bars to this PNG")


class SavedActivationMeter:
    """Live bytes of distinct storages saved for backward (parameters excluded), and their peak."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _acquire(self, key: int, nbytes: int) -> None:
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.sizes.pop(key)
            del self.refs[key]

    @contextlib.contextmanager
    def watch(self) -> Iterator["SavedActivationMeter"]:
        """Count every tensor saved for backward inside the block (and during its backward)."""
        import torch

        meter = self

        class Held:
            """A saved tensor and its meter key; releasing it drops the storage's reference."""

            __slots__ = ("tensor", "key")

            def __init__(self, tensor: Any, key: int | None) -> None:
                self.tensor, self.key = tensor, key

            def __del__(self) -> None:
                if self.key is not None:
                    meter._release(self.key)

        def pack(tensor: Any) -> Held:
            """Count a saved tensor's storage once (parameters and empty storages are not activations)."""
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in meter.exclude or storage.nbytes() == 0:
                return Held(tensor, None)
            meter._acquire(key, storage.nbytes())
            return Held(tensor, key)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor):
            yield self


@contextlib.contextmanager
def _megatron_session() -> Iterator[str]:
    """Single-rank megatron-core state on CUDA, or on CPU through the tests' CUDA redirect."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    on_gpu = torch.cuda.is_available()
    redirect = contextlib.nullcontext()
    if not on_gpu:  # the CPU development mode's megatron-core redirect (never active with a GPU)
        from dsv4flash.cpu_mode.mcore_redirect import cuda_redirect

        redirect = cuda_redirect()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with redirect, tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(1234)
            yield "cuda" if on_gpu else "cpu"
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def _activation_bytes(model: Any, ids: Any, probe: Any) -> dict[str, float]:
    """One instrumented step: bytes held after the forward and the peak over forward + backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    meter = SavedActivationMeter(params)
    with meter.watch():
        logits = model(ids)
        held = meter.live
        (logits * probe).sum().backward()
    model.zero_grad(set_to_none=True)
    return dict(held=held, peak=meter.peak)


def _timed_step(model: Any, ids: Any, probe: Any, device: str) -> tuple[float, float]:
    """(forward seconds, forward + backward seconds) of one step."""
    import torch

    def sync() -> None:
        """Wait for queued GPU work (no-op on CPU)."""
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    start = time.perf_counter()
    logits = model(ids)
    sync()
    middle = time.perf_counter()
    (logits * probe).sum().backward()
    sync()
    end = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return middle - start, end - start


def _modes(args: argparse.Namespace, layers: int) -> dict[str, dict[str, Any]]:
    """The configurations: no recompute; uniform chunks; block over all but the last layer; selective."""
    return {
        "none": dict(recompute="none", overrides={}),
        "full": dict(recompute="full", overrides={"recompute_num_layers": args.chunk}),
        # The last layer's activations are consumed as soon as its forward ends: recomputing it buys nothing.
        "block": dict(recompute="full_block", overrides={"recompute_num_layers": layers - 1}),
        # Just enough layers for the memory target: the last L/target layers keep their activations (with one
        # layer being recomputed at the peak, L − ⌊L/target⌋ + 1 layers are checkpointed).
        "block_target": dict(recompute="full_block", overrides={
            "recompute_num_layers": min(layers - 1, layers - int(layers // MEMORY_TARGET) + 1)}),
        # Recompute only the wide parts (the sparse-attention core with its [S, window + top-k] scores, the
        # MoE with its dispatched copies); keep the narrow ones (projections, compressed KV, top-k ids, mHC).
        "selective": dict(recompute="none", overrides={"recompute_granularity": "selective",
                                                        "recompute_modules": ["core_attn", "moe"]}),
    }


def run(args: argparse.Namespace) -> BenchReport:
    """Measure the four modes on one batch and report them side by side."""
    import torch

    from dsv4flash.model.transformer import Transformer

    torch.set_num_threads(args.threads)
    report = BenchReport(f"activation recompute: tiny V4.1 on megatron-core, batch {args.batch} × seq {args.seq}")
    with _megatron_session() as device:
        from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

        ref = Transformer("tiny", seed=0)
        layers = ref.cfg.text.num_hidden_layers
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, ref.cfg.text.vocab_size, (args.batch, args.seq), generator=gen).to(device)
        probe = torch.randn(args.batch, args.seq, ref.cfg.text.vocab_size, generator=gen).to(device)
        modes = _modes(args, layers)
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(modes) * (args.steps + 2), desc="recompute bench", file=sys.stderr)
        except ImportError:  # progress is a nicety; the numbers do not depend on it
            bar = None
        tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)
        models, results = {}, {}
        for mode, options in modes.items():
            model = DSV41ModelProvider(ref.cfg, **options).provide().to(device)
            load_reference_state(model, ref.state_dict())
            model.train()
            _timed_step(model, ids, probe, device)  # warm-up (allocator, lazy buffers)
            tick()
            results[mode] = _activation_bytes(model, ids, probe)
            tick()
            models[mode] = model
        # Round robin over the modes, so a load change on a shared machine hits every mode alike.
        times: dict[str, list] = {mode: [] for mode in modes}
        for _ in range(args.steps):
            for mode, model in models.items():
                times[mode].append(_timed_step(model, ids, probe, device))
                tick()
        for mode, samples in times.items():
            results[mode]["forward"] = statistics.median(f for f, _ in samples)
            results[mode]["step"] = statistics.median(t for _, t in samples)
        if bar is not None:
            bar.close()

    none = results["none"]
    target_layers = modes["block_target"]["overrides"]["recompute_num_layers"]
    notes = {"full": f"uniform, {args.chunk} layer(s) per chunk", "block": f"block, first {layers - 1} layers",
             "block_target": f"block, first {target_layers} layers (just enough for the memory target)",
             "selective": "selective: core_attn + moe"}
    report.add("activations_peak_none", none["peak"] / MIB, "MiB", note="saved for backward, peak")
    for mode in RECOMPUTED:
        report.add(f"activations_peak_{mode}", results[mode]["peak"] / MIB, "MiB", baseline="activations_peak_none",
                   note=notes[mode])
    report.add("activations_held_none", none["held"] / MIB, "MiB", note="held between forward and backward")
    for mode in RECOMPUTED:
        report.add(f"activations_held_{mode}", results[mode]["held"] / MIB, "MiB", baseline="activations_held_none")
    report.add("forward_none", none["forward"], "s")
    report.add("step_none", none["step"], "s", note=f"median of {args.steps}, {device}, {args.threads} thread(s)")
    # Naive recompute costs one more forward per recomputed layer; the selection replay makes it cheaper
    # than that (the indexer's scoring and top-k are not re-run), so these are references, not bounds.
    report.add("step_plus_forward", none["step"] + none["forward"], "s", baseline="step_none",
               note="step + one whole forward (naive full recompute)")
    report.add("step_plus_forward_block", none["step"] + none["forward"] * (layers - 1) / layers, "s",
               baseline="step_none", note=f"step + {layers - 1}/{layers} of a forward (naive block)")
    for mode, naive in (("full", "step_plus_forward"), ("block", "step_plus_forward_block")):
        report.add(f"step_{mode}", results[mode]["step"], "s", baseline="step_none", limit=naive,
                   note="vs limit = vs the naive-recompute reference")
    report.add("step_plus_forward_block_target", none["step"] + none["forward"] * target_layers / layers, "s",
               baseline="step_none", note=f"step + {target_layers}/{layers} of a forward (naive)")
    report.add("step_block_target", results["block_target"]["step"], "s", baseline="step_none",
               limit="step_plus_forward_block_target", note="vs limit = vs the naive-recompute reference")
    report.add("step_selective", results["selective"]["step"], "s", baseline="step_none",
               note="recomputes the attention core and the MoE only")
    for mode in RECOMPUTED:
        memory_ratio = none["peak"] / results[mode]["peak"]
        time_ratio = results[mode]["step"] / none["step"]
        met = memory_ratio >= MEMORY_TARGET and time_ratio <= TIME_TARGET
        report.target(f"{notes[mode]}: peak activation memory {memory_ratio:.2f}× lower "
                      f"(target ≥ {MEMORY_TARGET}×), "
                      f"step time {time_ratio:.2f}× (target ≤ {TIME_TARGET}×)", met)
    if args.plot:
        _plot(args.plot, results, notes, args)
    return report


def _plot(path: str, results: dict, notes: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    none = results["none"]
    labels = ("no recompute", "full (uniform)", "full (block)", "block (target)", "selective")
    keys = ("none", *RECOMPUTED)
    colors = ("tab:gray", "tab:blue", "tab:cyan", "tab:green", "tab:purple")
    fig, (mem, step) = plt.subplots(1, 2, figsize=(13, 3.8))
    mem.bar(labels, [results[k]["peak"] / MIB for k in keys], color=colors)
    mem.set_ylabel("peak activation memory (MiB)")
    mem.set_title(f"target: ≥ {MEMORY_TARGET}× less")
    step.bar(labels, [results[k]["step"] for k in keys], color=colors)
    step.axhline(none["step"] + none["forward"], color="tab:red", linestyle="--", label="+ one whole forward")
    step.axhline(none["step"] * TIME_TARGET, color="tab:green", linestyle=":", label=f"{TIME_TARGET}× target")
    step.set_ylabel("step time (s)")
    fig.legend(*step.get_legend_handles_labels(), loc="lower right", ncol=2, fontsize=8)
    fig.suptitle(f"tiny V4.1 on megatron-core, batch {args.batch} × seq {args.seq}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, out)
