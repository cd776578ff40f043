"""`convert import`: release layout -> BF16/FP32 with release names, plus what a bit-exact export needs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dsv4flash_bridge import codecs
from dsv4flash_bridge.convert_common import (DEFAULT_CHUNK_BYTES, LAYOUT_FILE, LAYOUT_FORMAT, SIDECAR, ConvertError,
                                             Summary, check_copy, copy_files, copy_rows, logical_shape, progress_bar,
                                             quantized_pairs, same_bytes, scale_rows, staging, chunk_rows)
from dsv4flash_bridge.safetensors_io import SafetensorsWriter, TensorInfo, TensorSpec, dtype_name, library_order
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader, write_index


def import_release(src, dst, *, dtype: torch.dtype = torch.bfloat16, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   verify: bool = False, progress: bool = True, overwrite: bool = False, resume: bool = False) -> Summary:
    """Release layout (SRC) -> BF16/FP32 checkpoint with release names (DST), plus DST/release/ for export."""
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConvertError(f"import dtype must be bfloat16 or float32, got {dtype}")
    start, summary = time.perf_counter(), Summary()
    with CheckpointReader(src) as ckpt, staging(dst, overwrite, resume) as out:
        pairs = quantized_pairs(ckpt.names(), ckpt.info)
        scales = {s for _, s in pairs.values()}
        shards = ckpt.index.shards
        layout = {"format": LAYOUT_FORMAT, "shards": {s: ckpt.reader(s).header_blob.decode("utf-8") for s in shards},
                  "index": _read_text(src / INDEX_FILE), "config": _read_text(src / "config.json")}
        bar, task = progress_bar(progress, f"import {src.name}", sum(ckpt.info(n).nbytes for n in ckpt.names()))
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
        copy_files(src, out, {INDEX_FILE, "config.json"})
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
        return TensorSpec(info.name, dtype_name(dtype), logical_shape(pairs[info.name][0], info.shape))
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
                read += copy_rows(ckpt, ckpt.info(name), lambda t, n=name: w.write_rows(n, t), chunk_bytes)
                advance(ckpt.info(name).nbytes)
    specs = library_order([_out_spec(ckpt.info(n), pairs, dtype) for n in weights])
    with SafetensorsWriter(target, specs, {"format": "pt"}) as writer:
        for name in weights:
            info = ckpt.info(name)
            if name not in pairs:
                read += copy_rows(ckpt, info, lambda t, n=name: writer.write_rows(n, t), chunk_bytes)
                advance(info.nbytes)
                continue
            role, scale = pairs[name]
            cols = logical_shape(role, info.shape)[1]
            step = chunk_rows(role, cols * dtype.itemsize, chunk_bytes)
            buffer = torch.empty(min(step, info.rows), cols, dtype=dtype)
            for r0 in range(0, info.rows, step):
                r1 = min(info.rows, r0 + step)
                q = ckpt.read_rows(name, r0, r1)
                s = ckpt.read_rows(scale, *scale_rows(role, r0, r1))
                writer.write_rows(name, codecs.decode(role, q, s, dtype=dtype, out=buffer[: r1 - r0], name=name))
                advance(q.numel())
            read += info.nbytes
    return read


def _verify_import(ckpt: CheckpointReader, out: Path, pairs, chunk_bytes: int) -> str:
    """Re-read the import and prove it lossless: re-encoding with the source scales gives the source bytes."""
    with CheckpointReader(out) as result:
        for name in result.names():
            if name not in pairs:
                check_copy(ckpt, result, name, chunk_bytes, out)
                continue
            role, scale = pairs[name]
            step = chunk_rows(role, result.info(name).row_bytes, chunk_bytes)
            for r0 in range(0, result.info(name).rows, step):
                r1 = min(result.info(name).rows, r0 + step)
                s = ckpt.read_rows(scale, *scale_rows(role, r0, r1))
                q2, s2 = codecs.encode(role, result.read_rows(name, r0, r1), like_scale=s, name=name)
                if not (same_bytes(q2, ckpt.read_rows(name, r0, r1)) and same_bytes(s2, s)):
                    raise ConvertError(f"{out}: verify failed, {name} rows [{r0}, {r1}) do not re-encode to the source")
    return f"verified: all {len(pairs)} quantized weights re-encode to their source bytes, the rest is identical"
