"""`convert export`: an import (possibly trained) -> the release layout, byte-identical where unchanged."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dsv4flash_bridge import codecs
from dsv4flash_bridge.convert_common import (DEFAULT_CHUNK_BYTES, LAYOUT_FILE, LAYOUT_FORMAT, SIDECAR, ConvertError,
                                             Summary, check_copy, copy_files, copy_rows, logical_shape, parse_json_text,
                                             progress_bar, quantized_pairs, read_source_file, scale_rows,
                                             source_identity, staging, chunk_rows)
from dsv4flash_bridge.renamed import ReleaseView, output_tensors, vision_heads
from dsv4flash_bridge.safetensors_io import SafetensorsWriter, all_or_nothing, parse_header
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader


def export_release(src, dst, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, verify: bool = False, progress: bool = True,
                   overwrite: bool = False, resume: bool = False) -> Summary:
    """BF16/FP32 checkpoint made by import (SRC, with SRC/release/) -> release layout (DST)."""
    src, dst = Path(src), Path(dst)
    side = src / SIDECAR
    if not (side / LAYOUT_FILE).exists() and not (side / LAYOUT_FILE).is_symlink():
        raise ConvertError(f"{src}: no {SIDECAR}/{LAYOUT_FILE}; export needs a checkpoint made by `convert import`")
    layout_text = read_source_file(side / LAYOUT_FILE, required=True, what="release layout record")
    layout = parse_json_text(layout_text, side / LAYOUT_FILE)
    if layout.get("format") != LAYOUT_FORMAT:
        raise ConvertError(f"{side / LAYOUT_FILE}: unknown layout format {layout.get('format')!r}")
    for key, kind in (("shards", dict), ("index", (str, type(None))), ("config", (str, type(None)))):
        if not isinstance(layout.get(key), kind):
            raise ConvertError(f"{side / LAYOUT_FILE}: field {key!r} is missing or malformed")
    start, summary = time.perf_counter(), Summary()
    headers = {shard: parse_header(blob.encode("utf-8"), side / LAYOUT_FILE / shard)[0]
               for shard, blob in layout["shards"].items()}
    where = {i.name: (shard, i) for shard, infos in headers.items() for i in infos}
    pairs = quantized_pairs(where, lambda n: where[n][1])
    scales = {s for _, s in pairs.values()}
    with CheckpointReader(src) as raw, CheckpointReader(side) as stored_scales, \
            staging(dst, overwrite, resume, source_identity(raw, {LAYOUT_FILE: layout_text})) as out:
        ckpt = _release_view(raw, layout, where, scales, src)
        extra = sorted(set(ckpt.names()) - set(where))
        if extra:
            raise ConvertError(f"{src}: {len(extra)} tensors are not part of the release layout, e.g. {extra[0]}")
        writers = {shard: SafetensorsWriter.from_header(out / shard, blob.encode("utf-8"))
                   for shard, blob in layout["shards"].items() if not (out / shard).exists()}

        def write(name: str, rows: torch.Tensor) -> None:  # shards completed before a resume are skipped
            if where[name][0] in writers:
                writers[where[name][0]].write_rows(name, rows)

        bar, task = progress_bar(progress, f"export {src.name}", sum(ckpt.info(n).nbytes for n in ckpt.names()))
        with all_or_nothing(writers), bar:
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
                    summary.bytes_read += copy_rows(ckpt, got, lambda t, n=name: write(n, t), chunk_bytes,
                                                     cast=info.torch_dtype if got.dtype != info.dtype else None)
                    bar.advance(task, got.nbytes)
                summary.tensors += 1
        summary.bytes_written = sum(i.nbytes for infos in headers.values() for i in infos)
        for name, text in ((INDEX_FILE, layout["index"]), ("config.json", layout["config"])):
            if text is not None:
                (out / name).write_text(text, encoding="utf-8")
        copy_files(src, out, {INDEX_FILE, "config.json"})
        if verify:
            summary.notes.append(_verify_export(ckpt, out, pairs, chunk_bytes))
    summary.seconds = time.perf_counter() - start
    return summary


def _release_view(raw: CheckpointReader, layout: dict, where, scales, src: Path):
    """SRC under release names: itself if imported with release naming, else a view through the name table."""
    naming = layout.get("naming", "release")
    if naming == "release":
        return raw
    if naming != "megatron":
        raise ConvertError(f"{src / SIDECAR / LAYOUT_FILE}: unknown naming {naming!r}")
    outs = output_tensors([n for n in where if n not in scales], lambda n: where[n][1].rows, naming,
                          vision_heads(layout["config"]))
    names = set(raw.names())
    missing = [o.name for o in outs if o.name not in names]
    if missing:
        raise ConvertError(f"{src}: Megatron tensor {missing[0]} is missing")
    extra = sorted(names - {o.name for o in outs})
    if extra:
        raise ConvertError(f"{src}: {len(extra)} tensors are not part of the release layout, e.g. {extra[0]}")
    return ReleaseView(raw, outs)


def _export_quantized(ckpt, stored_scales, name, pair, info, where, write, chunk_bytes, advance) -> int:
    """Encode one weight chunk by chunk with the recorded scales as like_scale; returns bytes read."""
    role, scale = pair
    got = ckpt.info(name)
    logical = logical_shape(role, info.shape)
    if got.shape != logical:
        raise ConvertError(f"{name}: shape {list(got.shape)} but the release weight is {list(logical)}")
    if stored_scales.info(scale).shape != where[scale][1].shape:
        raise ConvertError(f"{scale}: recorded scale shape differs from the release header")
    step = chunk_rows(role, got.row_bytes, chunk_bytes)
    for r0 in range(0, got.rows, step):
        r1 = min(got.rows, r0 + step)
        like = stored_scales.read_rows(scale, *scale_rows(role, r0, r1))
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
                check_copy(ckpt, result, name, chunk_bytes, out)
                continue
            role, scale = pairs[name]
            info = ckpt.info(name)
            step = chunk_rows(role, info.row_bytes, chunk_bytes)
            for r0 in range(0, info.rows, step):
                r1 = min(info.rows, r0 + step)
                decoded = codecs.decode(role, result.read_rows(name, r0, r1),
                                        result.read_rows(scale, *scale_rows(role, r0, r1)), name=name)
                lossy += int((decoded != ckpt.read_rows(name, r0, r1).float()).sum())
    return f"verified: the export re-reads and decodes; {lossy} weight values differ from the source (0 = lossless)"
