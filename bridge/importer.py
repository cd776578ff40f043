"""`convert import`: release layout -> BF16/FP32 in release or Megatron naming, plus what a bit-exact export needs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dsv4flash.release.census import census, diff_census
from dsv4flash.config import DSV41FlashConfig
from dsv4flash.release.quant_plan import QuantRole, StoredTensor
from dsv4flash_bridge import codecs
from dsv4flash_bridge.convert_common import (DEFAULT_CHUNK_BYTES, LAYOUT_FILE, LAYOUT_FORMAT, SIDECAR, ConvertError,
                                             Summary, check_copy, chunk_rows, copy_files, copy_rows, logical_shape,
                                             parse_json_text, progress_bar, quantized_pairs, read_source_file,
                                             same_bytes, scale_rows, source_identity, staging)
from dsv4flash_bridge.renamed import NAMINGS, OutTensor, Piece, ReleaseView, output_tensors, vision_heads
from dsv4flash_bridge.safetensors_io import SafetensorsWriter, TensorSpec, dtype_name, library_order
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader, write_index


def import_release(src, dst, *, dtype: torch.dtype = torch.bfloat16, naming: str = "release",
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = False, progress: bool = True,
                   overwrite: bool = False, resume: bool = False, allow_extra: bool = False) -> Summary:
    """Release layout (SRC) -> BF16/FP32 checkpoint (DST) named `naming` ("release" = the reference model's
    names, "megatron" = the name table's Megatron names), plus DST/release/ for export.

    Before anything is written, SRC's tensors are checked against the census of its config.json: a missing
    tensor or a wrong dtype/shape is an error, and so is an unknown tensor unless `allow_extra` (then it
    passes through unchanged)."""
    src, dst = Path(src), Path(dst)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConvertError(f"import dtype must be bfloat16 or float32, got {dtype}")
    if naming not in NAMINGS:
        raise ConvertError(f"import naming must be one of {NAMINGS}, got {naming!r}")
    start, summary = time.perf_counter(), Summary()
    with CheckpointReader(src) as ckpt:
        pairs = quantized_pairs(ckpt.names(), ckpt.info)
        config_text = read_source_file(src / "config.json", required=True, what="config.json")
        index_text = read_source_file(src / INDEX_FILE, required=False, what="index")
        extras = check_against_census(ckpt, config_text, src / "config.json", allow_extra)
        if extras:
            summary.notes.append(f"passed through {len(extras)} tensor(s) the config does not have, e.g. {extras[0]}")
        identity = source_identity(ckpt, {"config.json": config_text, INDEX_FILE: index_text},
                                   {"dtype": str(dtype).removeprefix("torch."), "naming": naming,
                                    "allow_extra": allow_extra})
        with staging(dst, overwrite, resume, identity) as out:
            _import(ckpt, src, out, config_text, index_text, pairs, dtype, naming, chunk_bytes, verify, progress,
                    summary)
    summary.seconds = time.perf_counter() - start
    return summary


def check_against_census(ckpt: CheckpointReader, config_text: str, config_path: Path, allow_extra: bool) -> list[str]:
    """Every tensor the config's census needs, with its dtype and shape; returns the extra tensors (if allowed)."""
    config = DSV41FlashConfig.from_hf(parse_json_text(config_text, config_path), source=str(config_path))
    expected = census(config)
    actual = [StoredTensor(n, ckpt.info(n).dtype, tuple(ckpt.info(n).shape)) for n in ckpt.names()]
    problems = diff_census(expected, actual)
    extras = [p.split(" ")[1] for p in problems if p.startswith("unexpected: ")]
    wrong = [p for p in problems if not p.startswith("unexpected: ") or not allow_extra]
    if wrong:
        more = (f" (and {len(wrong) - 1} more; `dsv4flash census --config {config_path} --checkpoint "
                f"{ckpt.directory}` lists them)") if len(wrong) > 1 else ""
        hint = "; pass allow_extra (--allow-extra) to pass unknown tensors through" \
            if wrong[0].startswith("unexpected: ") else ""
        raise ConvertError(f"{ckpt.directory}: does not match the census of {config_path}: {wrong[0]}{more}{hint}")
    return extras


def _import(ckpt, src: Path, out: Path, config_text: str, index_text: str | None, pairs, dtype, naming, chunk_bytes,
            verify, progress, summary: Summary) -> None:
    """Write the import into the staging directory `out`."""
    scales = {s for _, s in pairs.values()}
    outs = output_tensors([n for n in ckpt.names() if n not in scales], lambda n: ckpt.info(n).rows, naming,
                          vision_heads(config_text))
    home = {o.name: ckpt.shard_of(o.pieces[0].release) for o in outs}  # an output lives with its first source
    specs = {o.name: _out_spec(ckpt, o, pairs, dtype) for o in outs}
    shards = ckpt.index.shards
    layout = {"format": LAYOUT_FORMAT, "naming": naming,
              "shards": {s: ckpt.reader(s).header_blob.decode("utf-8") for s in shards},
              "index": index_text, "config": config_text}
    bar, task = progress_bar(progress, f"import {src.name}", sum(ckpt.info(n).nbytes for n in ckpt.names()))
    with bar:
        for shard in shards:
            mine = [o for o in outs if home[o.name] == shard]
            shard_scales = [n for n in ckpt.reader(shard).names() if n in scales]
            summary.bytes_read += _import_shard(ckpt, shard, mine, specs, shard_scales, pairs, out, dtype,
                                               chunk_bytes, lambda n: bar.advance(task, n))
            summary.tensors += len(mine)
    side = out / SIDECAR
    side.mkdir(exist_ok=True)
    (side / LAYOUT_FILE).write_text(json.dumps(layout, indent=1) + "\n", encoding="utf-8")
    write_index(side, {s: ckpt.shard_of(s) for s in sorted(scales)}, sum(ckpt.info(s).nbytes for s in scales))
    summary.bytes_written = sum(s.nbytes for s in specs.values())
    write_index(out, home, summary.bytes_written, {"format": "pt"})
    config = json.loads(config_text)
    config.pop("quantization_config", None)  # the imported weights are no longer quantized
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    copy_files(src, out, {INDEX_FILE, "config.json"})
    if verify:
        summary.notes.append(_verify_import(ckpt, out, outs, naming, pairs, chunk_bytes))


def _out_spec(ckpt: CheckpointReader, out: OutTensor, pairs, dtype: torch.dtype) -> TensorSpec:
    """The output tensor's spec: decoded dtype for quantized sources, stored dtype otherwise; rows stacked."""
    kinds = set()
    for name in out.sources:
        info = ckpt.info(name)
        if name in pairs:
            kinds.add((dtype_name(dtype), logical_shape(pairs[name][0], info.shape)[1:]))
        else:
            kinds.add((info.dtype, info.shape[1:]))
    if len(kinds) != 1:
        raise ConvertError(f"{out.name}: its sources {out.sources} differ in dtype or width ({sorted(kinds)})")
    (kind, trailing), = kinds
    if not ckpt.info(out.sources[0]).shape:
        return TensorSpec(out.name, kind, ())
    return TensorSpec(out.name, kind, (sum(p.stop - p.start for p in out.pieces), *trailing))


def _import_shard(ckpt, shard, outs, specs, scales, pairs, out: Path, dtype, chunk_bytes, advance) -> int:
    """Write the outputs homed in one source shard to DST/<shard>, and its scales to DST/release/<shard>."""
    target, side = out / shard, out / SIDECAR / shard
    if (not outs or target.exists()) and (not scales or side.exists()):  # completed before a resume
        done = sum(ckpt.info(n).nbytes for n in scales) + sum(_piece_bytes(ckpt, p) for o in outs for p in o.pieces)
        advance(done)
        return done
    read = 0
    if scales:
        with SafetensorsWriter(side, library_order([TensorSpec(n, "F8_E8M0", ckpt.info(n).shape) for n in scales])) as w:
            for name in scales:
                read += copy_rows(ckpt, ckpt.info(name), lambda t, n=name: w.write_rows(n, t), chunk_bytes)
                advance(ckpt.info(name).nbytes)
    if outs:
        with SafetensorsWriter(target, library_order([specs[o.name] for o in outs]), {"format": "pt"}) as writer:
            for o in outs:
                for piece in o.pieces:
                    read += _emit(ckpt, piece, pairs, dtype, chunk_bytes, lambda t, n=o.name: writer.write_rows(n, t),
                                  advance)
    return read


def _piece_bytes(ckpt: CheckpointReader, piece: Piece) -> int:
    """Stored bytes of a piece's rows."""
    info = ckpt.info(piece.release)
    return info.nbytes if not info.shape else (piece.stop - piece.start) * info.row_bytes


def _emit(ckpt, piece: Piece, pairs, dtype, chunk_bytes, write, advance) -> int:
    """Stream a piece's rows to `write`: decoded chunk by chunk if quantized, copied otherwise."""
    name, info = piece.release, ckpt.info(piece.release)
    if not info.shape:
        write(ckpt.read(name))
        advance(info.nbytes)
        return info.nbytes
    if name not in pairs:
        step = max(1, chunk_bytes // max(info.row_bytes, 1))
        for r0 in range(piece.start, piece.stop, step):
            r1 = min(piece.stop, r0 + step)
            write(ckpt.read_rows(name, r0, r1))
            advance((r1 - r0) * info.row_bytes)
        return _piece_bytes(ckpt, piece)
    role, scale = pairs[name]
    if role is QuantRole.DENSE_FP8 and (piece.start % 32 or (piece.stop % 32 and piece.stop != info.rows)):
        raise ConvertError(f"{name}: rows [{piece.start}, {piece.stop}) cut through its 32-row scale blocks")
    cols = logical_shape(role, info.shape)[1]
    step = chunk_rows(role, cols * dtype.itemsize, chunk_bytes)
    buffer = torch.empty(min(step, piece.stop - piece.start), cols, dtype=dtype)
    for r0 in range(piece.start, piece.stop, step):
        r1 = min(piece.stop, r0 + step)
        q = ckpt.read_rows(name, r0, r1)
        s = ckpt.read_rows(scale, *scale_rows(role, r0, r1))
        write(codecs.decode(role, q, s, dtype=dtype, out=buffer[: r1 - r0], name=name))
        advance((r1 - r0) * info.row_bytes)
    return _piece_bytes(ckpt, piece)


def _verify_import(ckpt: CheckpointReader, out: Path, outs, naming: str, pairs, chunk_bytes: int) -> str:
    """Re-read the import and prove it lossless: re-encoding with the source scales gives the source bytes."""
    with CheckpointReader(out) as written:
        extra = sorted(set(written.names()) - {o.name for o in outs})
        if extra:
            raise ConvertError(f"{out}: verify failed, unexpected tensor {extra[0]}")
        result = written if naming == "release" else ReleaseView(written, outs)
        for name in result.names():
            if name not in pairs:
                check_copy(ckpt, result, name, chunk_bytes, out)
                continue
            role, scale = pairs[name]
            rows = result.info(name).rows
            step = chunk_rows(role, result.info(name).row_bytes, chunk_bytes)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                s = ckpt.read_rows(scale, *scale_rows(role, r0, r1))
                q2, s2 = codecs.encode(role, result.read_rows(name, r0, r1), like_scale=s, name=name)
                if not (same_bytes(q2, ckpt.read_rows(name, r0, r1)) and same_bytes(s2, s)):
                    raise ConvertError(f"{out}: verify failed, {name} rows [{r0}, {r1}) do not re-encode to the source")
    return f"verified: all {len(pairs)} quantized weights re-encode to their source bytes, the rest is identical"
