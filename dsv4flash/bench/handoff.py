"""Trainer -> sampler handoff: an adapter revision vs a merged full checkpoint, bytes and wall time.

Measured at tiny size, both in this process, side by side, best of `--repeats`:
- adapter: the trainer writes its PEFT directory (`save_peft_adapter`: temp dir, fsync, rename) and a sampler
  model with the same placement loads it (`load_peft_adapter`);
- merged: the trainer folds every adapter into the base (`merged_state_dict`), writes one safetensors file
  (temp, fsync, rename) and a fresh base model loads it (`load_state_dict`).
Tiny stores everything in fp32, so the merged file is the fp32 model, not the release's FP8/FP4 layout.

Computed at the V4.1 shape: merged = the release census bytes (every tensor in its stored FP8/FP4/BF16/F32
format, Engram tables included, as a full checkpoint handoff ships them); adapter = the placement's factors
(`plan_lora` on the `meta`-built release model) in the LoRA dtype (fp32 by default, as `save_peft_adapter`
writes them). Times at V4.1 = bytes / the write+read bandwidth measured here on a `--probe-mib` file (disk +
page cache of this machine; merge compute is left out, which favours the merged side).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dsv4flash.bench.report import BenchReport

MINT = {"4B dense": 18.3, "30B MoE": 2.85}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the `handoff` benchmark."""
    parser.add_argument("--presets", nargs="+", default=["decoder_half", "full_linear"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-mib", type=int, default=256, help="file size of the bandwidth probe")
    parser.add_argument("--workdir", help="where files are written (default: a temp dir, removed after)")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _write_file(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from dsv4flash.lifecycle.safetensors_io import write_safetensors

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write_safetensors(f, tensors)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _adapted_model(preset: str, rank: int):
    from dsv4flash.lora import LoraConfig, apply_lora, lora_parameters
    from dsv4flash.model.transformer import Transformer

    model = Transformer("tiny", seed=0).eval()
    handle = apply_lora(model, LoraConfig(preset=preset, rank=rank))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)  # a trained revision: B ≠ 0
    return model, handle


def _measure_tiny(preset: str, rank: int, repeats: int, work: Path) -> dict:
    from dsv4flash.lora import LoraConfig, apply_lora, load_peft_adapter, merged_state_dict, save_peft_adapter
    from dsv4flash.lifecycle.safetensors_io import read_safetensors
    from dsv4flash.model.transformer import Transformer

    trainer, handle = _adapted_model(preset, rank)
    sampler = Transformer("tiny", seed=0).eval()
    apply_lora(sampler, LoraConfig(preset=preset, rank=rank))
    fresh = Transformer("tiny", seed=0).eval()
    adapter_dir, merged_file = work / f"{preset}-adapter", work / f"{preset}-merged.safetensors"

    def adapter_handoff():
        save_peft_adapter(trainer, handle, adapter_dir, overwrite=True)
        load_peft_adapter(sampler, adapter_dir)

    def merged_handoff():
        _write_file(merged_file, merged_state_dict(trainer))
        tensors, _ = read_safetensors(merged_file)
        fresh.load_state_dict(tensors, strict=True)

    t_adapter = _best(adapter_handoff, repeats)
    t_merged = _best(merged_handoff, repeats)
    with torch.no_grad():  # both handoffs deliver the same policy
        ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(2))
        diff = float((sampler(ids) - fresh(ids)).abs().max())
    return {"adapter_s": t_adapter, "merged_s": t_merged, "adapter_bytes": _dir_bytes(adapter_dir),
            "merged_bytes": merged_file.stat().st_size, "params": handle.trainable_params, "max_abs_diff": diff}


def v41_bytes(preset: str, rank: int) -> tuple[int, int]:
    """(adapter bytes, merged full checkpoint bytes) at the release shape (see the module docstring)."""
    from dsv4flash.release.census import census
    from dsv4flash.lora import LoraConfig, plan_lora
    from dsv4flash.model.transformer import Transformer

    model = Transformer("flash", device="meta")
    handle = plan_lora(model, LoraConfig(preset=preset, rank=rank))
    return handle.master_bytes, sum(t.nbytes for t in census("flash"))


def _bandwidth(mib: int, work: Path) -> float:
    """Bytes/s of writing (fsync'd) and reading back one `mib` MiB safetensors file."""
    from dsv4flash.lifecycle.safetensors_io import read_safetensors

    blob = {"x": torch.zeros(mib << 18, dtype=torch.float32)}  # mib MiB
    path = work / "probe.safetensors"

    def roundtrip():
        _write_file(path, blob)
        read_safetensors(path)

    seconds = _best(roundtrip, 2)
    path.unlink()
    return (mib << 20) / seconds


def run(args: argparse.Namespace) -> BenchReport:
    """Tiny handoffs measured side by side, then the V4.1 figures computed from the census."""
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dsv4flash-handoff-"))
    work.mkdir(parents=True, exist_ok=True)
    rep = BenchReport(f"trainer -> sampler handoff, adapter revision vs merged full checkpoint, rank {args.rank}")
    try:
        bandwidth = _bandwidth(args.probe_mib, work)
        rep.add("disk_roundtrip_GBps", bandwidth / 1e9, "GB/s",
                note=f"write+fsync+read of a {args.probe_mib} MiB file here: the V4.1 time basis")
        for preset in args.presets:
            tiny = _measure_tiny(preset, args.rank, args.repeats, work)
            p = f"tiny_{preset}"
            rep.add(f"{p}_merged_bytes", tiny["merged_bytes"], "B", note="fp32 merged model, one safetensors file")
            rep.add(f"{p}_adapter_bytes", tiny["adapter_bytes"], "B", baseline=f"{p}_merged_bytes",
                    note=f"PEFT dir, {tiny['params']:,} params")
            rep.add(f"{p}_merged_s", tiny["merged_s"], "s", note="merge + write + fsync + read + load_state_dict")
            rep.add(f"{p}_adapter_s", tiny["adapter_s"], "s", baseline=f"{p}_merged_s",
                    note=f"save_peft_adapter + load_peft_adapter; outputs equal to {tiny['max_abs_diff']:.1e}")
            adapter_b, merged_b = v41_bytes(preset, args.rank)
            v = f"v41_{preset}"
            rep.add(f"{v}_merged_bytes", merged_b, "B", note="census: the release's stored bytes")
            rep.add(f"{v}_adapter_bytes", adapter_b, "B", baseline=f"{v}_merged_bytes", note="plan_lora factors, fp32")
            rep.add(f"{v}_merged_s", merged_b / bandwidth, "s", note="computed: bytes / disk_roundtrip")
            rep.add(f"{v}_adapter_s", adapter_b / bandwidth, "s", baseline=f"{v}_merged_s",
                    note="computed: bytes / disk_roundtrip")
            rep.target(f"{preset}: V4.1 adapter handoff {merged_b / adapter_b:.1f}x smaller than the merged "
                       f"checkpoint, tiny measured {tiny['merged_s'] / tiny['adapter_s']:.1f}x faster "
                       f"(MinT: {MINT['4B dense']}x 4B dense, {MINT['30B MoE']}x 30B MoE)",
                       merged_b / adapter_b >= MINT["30B MoE"])
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return rep
