"""Streaming conversion between the release layout and BF16/FP32 checkpoints (`dsv4flash convert`).

Import decodes every quantized weight (DENSE_FP8, EXPERT_MXFP4, ENGRAM_FP8) to BF16 or FP32 and copies
everything else bit for bit, source shard by source shard and tensor by tensor, each tensor in row chunks of
about `chunk_bytes`, so memory stays bounded by the chunk, not the checkpoint or the largest tensor (the
Engram tables included). Names stay the release names, which are the reference model's. It also keeps what
a bit-exact export needs in `DST/release/`: the E8M0 scales (verbatim) and `layout.json` (the release's
shard headers, index and config.json, verbatim).

Export reverses it: every release shard is rebuilt from its recorded header, quantized weights re-encoded
with the recorded scales as `like_scale`, so an unmodified import exports to byte-identical shards, and a
changed block gets a fresh canonical scale (docs/bridge.md). Both directions write into `DST.partial` and
rename it to DST at the end; a failure removes it, unless `resume` is set, in which case a rerun keeps the
shards already completed (each shard is renamed into place only when complete) and produces the same bytes.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4flash.quant_plan import QuantRole, quant_role, scale_name
from dsv4flash_bridge import codecs
from dsv4flash_bridge.safetensors_io import (SafetensorsWriter, TensorInfo, TensorSpec, dtype_name, library_order,
                                             parse_header)
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader, write_index

__all__ = ["ConvertError", "Summary", "import_release", "export_release", "SIDECAR", "LAYOUT_FILE", "bench_convert"]

SIDECAR = "release"
LAYOUT_FILE = "layout.json"
LAYOUT_FORMAT = "dsv4flash-release-layout/1"
DEFAULT_CHUNK_BYTES = 256 << 20
QUANTIZED = (QuantRole.DENSE_FP8, QuantRole.EXPERT_MXFP4, QuantRole.ENGRAM_FP8)
_STORED_DTYPE = {QuantRole.DENSE_FP8: "F8_E4M3", QuantRole.EXPERT_MXFP4: "I8", QuantRole.ENGRAM_FP8: "F8_E4M3"}


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message names the tensor or file."""


@dataclass
class Summary:
    """What a conversion did."""

    tensors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ helpers
def _logical_shape(role: QuantRole, stored: tuple[int, ...]) -> tuple[int, ...]:
    """Float shape of a stored quantized weight."""
    return (stored[0], stored[1] * 2) if role is QuantRole.EXPERT_MXFP4 else stored


def _step(role: QuantRole, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk: about chunk_bytes of the larger side, whole 32-row block rows for dense FP8."""
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    return max(32, rows // 32 * 32) if role is QuantRole.DENSE_FP8 else rows


def _scale_rows(role: QuantRole, r0: int, r1: int) -> tuple[int, int]:
    """Scale rows covering weight rows [r0, r1)."""
    return (r0 // 32, -(-r1 // 32)) if role is QuantRole.DENSE_FP8 else (r0, r1)


def _quantized_pairs(names, info) -> dict[str, tuple[QuantRole, str]]:
    """weight name -> (role, scale name) for every quantized weight; checks dtypes and that scales pair up."""
    names = set(names)
    pairs = {}
    for name in sorted(names):
        role = quant_role(name)
        if role in QUANTIZED:
            scale = scale_name(name)
            if scale not in names:
                raise ConvertError(f"{name}: quantized ({role.value}) but its scale {scale} is missing")
            if info(name).dtype != _STORED_DTYPE[role] or info(scale).dtype != "F8_E8M0":
                raise ConvertError(f"{name}: {role.value} must be stored as {_STORED_DTYPE[role]} + F8_E8M0 scale, "
                                   f"found {info(name).dtype} + {info(scale).dtype}")
            pairs[name] = (role, scale)
        elif name.endswith(".scale") and name[: -len(".scale")] + ".weight" not in names:
            raise ConvertError(f"{name}: a scale without its weight")
        elif name.endswith(".weight") and scale_name(name) in names:
            raise ConvertError(f"{name}: has a .scale sibling but quant_plan says it is {role.value}")
    return pairs


@contextmanager
def _staging(dst: Path, overwrite: bool, resume: bool):
    """Yield DST.partial; rename it to DST on success, remove it on failure unless resuming."""
    partial = dst.with_name(dst.name + ".partial")
    if dst.exists() and not overwrite:
        raise ConvertError(f"{dst}: already exists (pass overwrite to replace it)")
    if partial.exists() and not resume:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    for stale in partial.rglob(".*.partial"):  # temp files of a crashed writer
        stale.unlink()
    try:
        yield partial
    except BaseException:
        if not resume:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if dst.exists():
        old = dst.with_name(dst.name + ".old")
        dst.rename(old)
        partial.rename(dst)
        shutil.rmtree(old)
    else:
        partial.rename(dst)


def _progress(enabled: bool, description: str, total: int):
    """A rich progress bar with bytes and bytes/s (a no-op display when disabled)."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), disable=not enabled)
    return progress, progress.add_task(description, total=total)


def _copy_rows(ckpt: CheckpointReader, info: TensorInfo, write, chunk_bytes: int, cast=None) -> int:
    """Copy an unquantized tensor in row chunks (optionally cast); returns bytes read."""
    if not info.shape:
        value = ckpt.read(info.name)
        write(value.to(cast) if cast is not None else value)
        return info.nbytes
    step = max(1, chunk_bytes // max(info.row_bytes, 1))
    for r0 in range(0, info.rows, step):
        rows = ckpt.read_rows(info.name, r0, min(info.rows, r0 + step))
        write(rows.to(cast) if cast is not None else rows)
    return info.nbytes


def _copy_files(src: Path, dst: Path, skip: set[str]) -> None:
    """Copy the other top-level files (tokenizer, generation config, ...)."""
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in skip and not path.name.endswith(".safetensors"):
            shutil.copy2(path, dst / path.name)


# ------------------------------------------------------------------------------------------- import
def import_release(src, dst, *, dtype: torch.dtype = torch.bfloat16, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   verify: bool = False, progress: bool = True, overwrite: bool = False, resume: bool = False) -> Summary:
    """Release layout (SRC) -> BF16/FP32 checkpoint with release names (DST), plus DST/release/ for export."""
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConvertError(f"import dtype must be bfloat16 or float32, got {dtype}")
    start, summary = time.perf_counter(), Summary()
    with CheckpointReader(src) as ckpt, _staging(dst, overwrite, resume) as out:
        pairs = _quantized_pairs(ckpt.names(), ckpt.info)
        scales = {s for _, s in pairs.values()}
        shards = ckpt.index.shards
        layout = {"format": LAYOUT_FORMAT, "shards": {s: ckpt.reader(s).header_blob.decode("utf-8") for s in shards},
                  "index": _read_text(src / INDEX_FILE), "config": _read_text(src / "config.json")}
        bar, task = _progress(progress, f"import {src.name}", sum(ckpt.info(n).nbytes for n in ckpt.names()))
        with bar:
            for shard in shards:
                names = ckpt.reader(shard).names()
                summary.bytes_read += _import_shard(ckpt, shard, names, pairs, out, dtype, chunk_bytes,
                                                   lambda n: bar.advance(task, n))
                summary.tensors += sum(n not in scales for n in names)
        side = out / SIDECAR
        side.mkdir(exist_ok=True)
        (side / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")
        write_index(side, {s: ckpt.shard_of(s) for s in sorted(scales)}, sum(ckpt.info(s).nbytes for s in scales))
        weight_map = {n: ckpt.shard_of(n) for n in ckpt.names() if n not in scales}
        out_sizes = {n: _out_spec(ckpt.info(n), pairs, dtype).nbytes for n in weight_map}
        write_index(out, weight_map, sum(out_sizes.values()), {"format": "pt"})
        summary.bytes_written = sum(out_sizes.values())
        if layout["config"] is not None:
            config = json.loads(layout["config"])
            config.pop("quantization_config", None)  # the imported weights are no longer quantized
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _copy_files(src, out, {INDEX_FILE, "config.json"})
        if verify:
            summary.notes.append(_verify_import(ckpt, out, pairs, chunk_bytes))
    summary.seconds = time.perf_counter() - start
    return summary


def _read_text(path: Path) -> str | None:
    """A file's text, or None if absent."""
    return path.read_text(encoding="utf-8") if path.exists() else None


def _out_spec(info: TensorInfo, pairs, dtype: torch.dtype) -> TensorSpec:
    """The imported tensor's spec."""
    if info.name in pairs:
        return TensorSpec(info.name, dtype_name(dtype), _logical_shape(pairs[info.name][0], info.shape))
    return TensorSpec(info.name, info.dtype, info.shape)


def _import_shard(ckpt, shard, names, pairs, out: Path, dtype, chunk_bytes, advance) -> int:
    """Decode/copy one source shard into DST/<shard> and its scales into DST/release/<shard>."""
    scales = [n for n in names if n.endswith(".scale") and n[: -len(".scale")] + ".weight" in pairs]
    weights = [n for n in names if n not in scales]
    target, side = out / shard, out / SIDECAR / shard
    if target.exists() and (side.exists() or not scales):  # completed before a resume
        done = sum(ckpt.info(n).nbytes for n in names)
        advance(done)
        return done
    read = 0
    if scales:
        with SafetensorsWriter(side, library_order([TensorSpec(n, "F8_E8M0", ckpt.info(n).shape) for n in scales])) as w:
            for name in scales:
                read += _copy_rows(ckpt, ckpt.info(name), lambda t, n=name: w.write_rows(n, t), chunk_bytes)
                advance(ckpt.info(name).nbytes)
    specs = library_order([_out_spec(ckpt.info(n), pairs, dtype) for n in weights])
    with SafetensorsWriter(target, specs, {"format": "pt"}) as writer:
        for name in weights:
            info = ckpt.info(name)
            if name not in pairs:
                read += _copy_rows(ckpt, info, lambda t, n=name: writer.write_rows(n, t), chunk_bytes)
                advance(info.nbytes)
                continue
            role, scale = pairs[name]
            cols = _logical_shape(role, info.shape)[1]
            step = _step(role, cols * dtype.itemsize, chunk_bytes)
            buffer = torch.empty(min(step, info.rows), cols, dtype=dtype)
            for r0 in range(0, info.rows, step):
                r1 = min(info.rows, r0 + step)
                q = ckpt.read_rows(name, r0, r1)
                s = ckpt.read_rows(scale, *_scale_rows(role, r0, r1))
                writer.write_rows(name, codecs.decode(role, q, s, dtype=dtype, out=buffer[: r1 - r0], name=name))
                advance(q.numel())
            read += info.nbytes
    return read


def _verify_import(ckpt: CheckpointReader, out: Path, pairs, chunk_bytes: int) -> str:
    """Re-read the import and prove it lossless: re-encoding with the source scales gives the source bytes."""
    with CheckpointReader(out) as result:
        for name in result.names():
            if name not in pairs:
                _check_copy(ckpt, result, name, chunk_bytes, out)
                continue
            role, scale = pairs[name]
            step = _step(role, result.info(name).row_bytes, chunk_bytes)
            for r0 in range(0, result.info(name).rows, step):
                r1 = min(result.info(name).rows, r0 + step)
                s = ckpt.read_rows(scale, *_scale_rows(role, r0, r1))
                q2, s2 = codecs.encode(role, result.read_rows(name, r0, r1), like_scale=s, name=name)
                if not (_same_bytes(q2, ckpt.read_rows(name, r0, r1)) and _same_bytes(s2, s)):
                    raise ConvertError(f"{out}: verify failed, {name} rows [{r0}, {r1}) do not re-encode to the source")
    return f"verified: all {len(pairs)} quantized weights re-encode to their source bytes, the rest is identical"


def _check_copy(src: CheckpointReader, dst: CheckpointReader, name: str, chunk_bytes: int, where: Path) -> None:
    """An unquantized tensor must be identical (after casting the source to the stored dtype)."""
    a, b = src.info(name), dst.info(name)
    if not a.shape or not b.shape:
        same = _same_bytes(src.read(name).to(b.torch_dtype), dst.read(name))
    else:
        step = max(1, chunk_bytes // max(a.row_bytes, 1))
        same = a.shape == b.shape and all(
            _same_bytes(src.read_rows(name, r0, min(a.rows, r0 + step)).to(b.torch_dtype),
                        dst.read_rows(name, r0, min(a.rows, r0 + step))) for r0 in range(0, a.rows, step))
    if not same:
        raise ConvertError(f"{where}: verify failed, {name} differs from the source")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical tensors."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


# ------------------------------------------------------------------------------------------- export
def export_release(src, dst, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = False, progress: bool = True,
                   overwrite: bool = False, resume: bool = False) -> Summary:
    """BF16/FP32 checkpoint made by import (SRC, with SRC/release/) -> release layout (DST)."""
    src, dst = Path(src), Path(dst)
    side = src / SIDECAR
    if not (side / LAYOUT_FILE).exists():
        raise ConvertError(f"{src}: no {SIDECAR}/{LAYOUT_FILE}; export needs a checkpoint made by `convert import`")
    layout = json.loads((side / LAYOUT_FILE).read_text(encoding="utf-8"))
    if layout.get("format") != LAYOUT_FORMAT:
        raise ConvertError(f"{side / LAYOUT_FILE}: unknown layout format {layout.get('format')!r}")
    start, summary = time.perf_counter(), Summary()
    headers = {shard: parse_header(blob.encode("utf-8"), side / LAYOUT_FILE / shard)[0]
               for shard, blob in layout["shards"].items()}
    where = {i.name: (shard, i) for shard, infos in headers.items() for i in infos}
    pairs = _quantized_pairs(where, lambda n: where[n][1])
    scales = {s for _, s in pairs.values()}
    with CheckpointReader(src) as ckpt, CheckpointReader(side) as stored_scales, _staging(dst, overwrite, resume) as out:
        extra = sorted(set(ckpt.names()) - set(where))
        if extra:
            raise ConvertError(f"{src}: {len(extra)} tensors are not part of the release layout, e.g. {extra[0]}")
        writers = {shard: SafetensorsWriter.from_header(out / shard, blob.encode("utf-8"))
                   for shard, blob in layout["shards"].items() if not (out / shard).exists()}

        def write(name: str, rows: torch.Tensor) -> None:  # shards completed before a resume are skipped
            if where[name][0] in writers:
                writers[where[name][0]].write_rows(name, rows)

        bar, task = _progress(progress, f"export {src.name}", sum(ckpt.info(n).nbytes for n in ckpt.names()))
        try:
            with bar:
                for name, (shard, info) in where.items():
                    if name in scales:
                        continue
                    if name not in ckpt:
                        raise ConvertError(f"{src}: release tensor {name} is missing")
                    if name in pairs:
                        summary.bytes_read += _export_quantized(ckpt, stored_scales, name, pairs[name], info, where,
                                                                write, chunk_bytes, lambda n: bar.advance(task, n))
                    else:
                        got = ckpt.info(name)
                        if got.shape != info.shape:
                            raise ConvertError(f"{name}: shape {list(got.shape)} but the release has {list(info.shape)}")
                        summary.bytes_read += _copy_rows(ckpt, got, lambda t, n=name: write(n, t), chunk_bytes,
                                                         cast=info.torch_dtype if got.dtype != info.dtype else None)
                        bar.advance(task, got.nbytes)
                    summary.tensors += 1
            for writer in writers.values():
                writer.close()
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
        summary.bytes_written = sum(i.nbytes for infos in headers.values() for i in infos)
        for name, text in ((INDEX_FILE, layout["index"]), ("config.json", layout["config"])):
            if text is not None:
                (out / name).write_text(text, encoding="utf-8")
        _copy_files(src, out, {INDEX_FILE, "config.json"})
        if verify:
            summary.notes.append(_verify_export(ckpt, out, pairs, chunk_bytes))
    summary.seconds = time.perf_counter() - start
    return summary


def _export_quantized(ckpt, stored_scales, name, pair, info, where, write, chunk_bytes, advance) -> int:
    """Encode one weight chunk by chunk with the recorded scales as like_scale; returns bytes read."""
    role, scale = pair
    got = ckpt.info(name)
    logical = _logical_shape(role, info.shape)
    if got.shape != logical:
        raise ConvertError(f"{name}: shape {list(got.shape)} but the release weight is {list(logical)}")
    if stored_scales.info(scale).shape != where[scale][1].shape:
        raise ConvertError(f"{scale}: recorded scale shape differs from the release header")
    step = _step(role, got.row_bytes, chunk_bytes)
    for r0 in range(0, got.rows, step):
        r1 = min(got.rows, r0 + step)
        like = stored_scales.read_rows(scale, *_scale_rows(role, r0, r1))
        q, s = codecs.encode(role, ckpt.read_rows(name, r0, r1), like_scale=like, name=name)
        write(name, q)
        write(scale, s)
        advance((r1 - r0) * got.row_bytes)
    return got.nbytes


def _verify_export(ckpt: CheckpointReader, out: Path, pairs, chunk_bytes: int) -> str:
    """Re-read the export: every header valid, every weight decodes; count values that differ from SRC."""
    lossy = 0
    with CheckpointReader(out) as result:
        for name in ckpt.names():
            if name not in pairs:
                _check_copy(ckpt, result, name, chunk_bytes, out)
                continue
            role, scale = pairs[name]
            info = ckpt.info(name)
            step = _step(role, info.row_bytes, chunk_bytes)
            for r0 in range(0, info.rows, step):
                r1 = min(info.rows, r0 + step)
                decoded = codecs.decode(role, result.read_rows(name, r0, r1),
                                        result.read_rows(scale, *_scale_rows(role, r0, r1)), name=name)
                lossy += int((decoded != ckpt.read_rows(name, r0, r1).float()).sum())
    return f"verified: the export re-reads and decodes; {lossy} weight values differ from the source (0 = lossless)"


# ------------------------------------------------------------------------------------------ bench
def bench_convert(scale: float = 1.0, chunk_bytes: int = 32 << 20) -> tuple[int, int, int]:
    """Import a synthetic release checkpoint in a fresh process. Returns (peak RSS growth during the
    conversion, the process's peak RSS, the largest tensor's decoded bytes), all in bytes."""
    import subprocess
    import sys
    import tempfile

    from dsv4flash.quant_plan import stored_layout
    from dsv4flash_bridge.synthetic import largest_tensor_bytes, write_release_checkpoint

    logical = {"layers.1.engram.embed.weight": (1 << 18, 256), "layers.0.attn.wo_b.weight": (4096, 4096),
               "layers.0.ffn.experts.0.w1.weight": (2304, 5120), "embed.weight": (16384, 1024)}
    rows = [stored for name, (r, c) in logical.items()
            for stored in stored_layout(name, (max(32, int(r * scale) // 32 * 32), c))]
    # Linux: writing 5 to clear_refs resets the peak (VmHWM), so the peak below is the conversion's own.
    script = f"""
import re, sys
from dsv4flash_bridge.convert import import_release
def status(key): return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
import_release(sys.argv[1], sys.argv[2], chunk_bytes={chunk_bytes}, progress=False)
print(status("VmHWM") - base, status("VmHWM"))
"""
    with tempfile.TemporaryDirectory() as tmp:
        write_release_checkpoint(Path(tmp) / "release", rows=rows, shards=2)
        done = subprocess.run([sys.executable, "-c", script, str(Path(tmp) / "release"), str(Path(tmp) / "bf16")],
                              capture_output=True, text=True, check=True)
        growth, peak = (int(v) for v in done.stdout.split()[-2:])
        return growth, peak, largest_tensor_bytes(rows)
