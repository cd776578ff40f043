"""Shared pieces of the streaming converter: errors, staging directory, progress, chunk arithmetic."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4flash.atomic_io import write_bytes_atomic
from dsv4flash.release.quant_plan import QuantRole, quant_role, scale_name
from dsv4flash_bridge.safetensors_io import TensorInfo
from dsv4flash_bridge.sharded import CheckpointReader

SIDECAR = "release"
LAYOUT_FILE = "layout.json"
LAYOUT_FORMAT = "dsv4flash-release-layout/1"
DEFAULT_CHUNK_BYTES = 256 << 20
IDENTITY_FILE = ".source-identity.json"
IDENTITY_FORMAT = "dsv4flash-convert-source/1"
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
def logical_shape(role: QuantRole, stored: tuple[int, ...]) -> tuple[int, ...]:
    """Float shape of a stored quantized weight."""
    return (stored[0], stored[1] * 2) if role is QuantRole.EXPERT_MXFP4 else stored


def chunk_rows(role: QuantRole, row_bytes: int, chunk_bytes: int) -> int:
    """Rows per chunk: about chunk_bytes of the larger side, whole 32-row block rows for dense FP8."""
    rows = max(1, chunk_bytes // max(row_bytes, 1))
    return max(32, rows // 32 * 32) if role is QuantRole.DENSE_FP8 else rows


def scale_rows(role: QuantRole, r0: int, r1: int) -> tuple[int, int]:
    """Scale rows covering weight rows [r0, r1)."""
    return (r0 // 32, -(-r1 // 32)) if role is QuantRole.DENSE_FP8 else (r0, r1)


def quantized_pairs(names, info) -> dict[str, tuple[QuantRole, str]]:
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


def read_source_file(path: Path, *, required: bool, what: str = "file") -> str | None:
    """A source file's UTF-8 text (None if absent and not required); refuses what a half-download leaves behind.

    A dangling symlink (a hub cache whose blob never arrived), a FIFO or device (opening it would block or
    stream forever), a directory and invalid UTF-8 are errors naming the file.
    """
    if path.is_symlink() and not path.exists():
        raise ConvertError(f"{path}: a symlink to {os.readlink(path)!r}, which does not exist "
                           f"(an incomplete download?)")
    try:
        st = path.stat()
    except FileNotFoundError:
        if required:
            raise ConvertError(f"{path}: missing; expected the checkpoint's {what}") from None
        return None
    if not stat.S_ISREG(st.st_mode):
        raise ConvertError(f"{path}: not a regular file (expected the checkpoint's {what})")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConvertError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_json_text(text: str, path: Path) -> dict:
    """A JSON object from a source file's text; an error names the file, line and column."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


_SAMPLE = 64 << 10


def source_identity(ckpt: CheckpointReader, texts: dict[str, str | None], options: dict | None = None) -> dict:
    """What a resumed conversion must find unchanged in its source (and its output options, e.g. dtype).

    Per shard: the header's sha256, the file size and mtime, and the sha256 of three 64 KiB windows of
    its data (start, middle, end), so a different source of the same structure (identical headers) is
    told apart without reading it all; plus the sha256 of each named text (config, index, layout).
    """
    shards = {}
    for shard in ckpt.index.shards:
        path = ckpt.directory / shard
        st = path.stat()
        sample = hashlib.sha256()
        with open(path, "rb") as fh:
            for offset in sorted({0, max(0, st.st_size // 2 - _SAMPLE // 2), max(0, st.st_size - _SAMPLE)}):
                fh.seek(offset)
                sample.update(fh.read(_SAMPLE))
        shards[shard] = {"header_sha256": hashlib.sha256(ckpt.reader(shard).header_blob).hexdigest(),
                         "size": st.st_size, "mtime_ns": st.st_mtime_ns, "data_sample_sha256": sample.hexdigest()}
    files = {name: None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()
             for name, text in texts.items()}
    return {"format": IDENTITY_FORMAT, "source": str(ckpt.directory.resolve()), "options": dict(options or {}),
            "shards": shards, "files": files}


def _identity_difference(recorded: dict, current: dict) -> str | None:
    """The first difference between two source identities, in words (None when they match)."""
    if recorded.get("format") != current["format"]:
        return f"unknown identity format {recorded.get('format')!r}"
    if recorded.get("source") != current["source"]:
        return f"it was started from {recorded.get('source')}"
    if recorded.get("options") != current["options"]:
        was = ", ".join(f"{k}={v}" for k, v in sorted((recorded.get("options") or {}).items()))
        return f"it was started with {was or 'other options'}"
    for name, digest in current["files"].items():
        if recorded.get("files", {}).get(name, digest) != digest:
            return f"{name} differs"
    old = recorded.get("shards", {})
    if set(old) != set(current["shards"]):
        return f"the shard list differs ({sorted(set(old) ^ set(current['shards']))[0]})"
    for shard, now in current["shards"].items():
        for key in ("header_sha256", "size", "mtime_ns", "data_sample_sha256"):
            if old[shard].get(key) != now[key]:
                return f"shard {shard} differs ({key.replace('_', ' ')})"
    return None


def replaced_path(dst: Path) -> Path:
    """Where `staging` moves the previous DST while swapping in the new one (a name no user picks by chance)."""
    return dst.with_name(f".{dst.name}.replaced-by-convert")


def recover_swap(dst: Path) -> None:
    """Finish or undo a replacement of DST that was killed between its renames (the previous DST left aside)."""
    old = replaced_path(dst)
    if not old.exists():
        return
    if dst.exists():
        shutil.rmtree(old)  # the new DST was in place; only removing the previous one was cut short
    else:
        old.rename(dst)  # killed between the renames: put the previous output back


@contextmanager
def staging(dst: Path, overwrite: bool, resume: bool, identity: dict | None = None):
    """Yield DST.partial; rename it to DST on success, remove it on failure unless resuming.

    `identity` (see `source_identity`) is recorded in DST.partial; a resume refuses a DST.partial whose
    record differs, so shards converted from another source are never reused.
    """
    recover_swap(dst)
    partial = dst.with_name(dst.name + ".partial")
    record = partial / IDENTITY_FILE
    if dst.exists() and not overwrite:
        raise ConvertError(f"{dst}: already exists (pass overwrite to replace it)")
    if partial.exists() and resume and identity is not None and any(partial.iterdir()):
        if not record.is_file():
            raise ConvertError(f"{partial}: has no source record ({IDENTITY_FILE}), so its shards cannot be trusted; "
                               f"remove it or run without resume")
        try:
            recorded = json.loads(record.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            recorded = {}
        why = _identity_difference(recorded, identity)
        if why is not None:
            raise ConvertError(f"{partial}: not resumable from {identity['source']}: {why}; remove it or run "
                               f"without resume")
    if partial.exists() and not resume:
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    for stale in partial.rglob(".*.partial"):  # temp files of a crashed writer
        stale.unlink()
    try:
        if identity is not None:
            write_bytes_atomic(record, (json.dumps(identity, indent=1) + "\n").encode())
        yield partial
    except BaseException:
        if not resume:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    record.unlink(missing_ok=True)
    if dst.exists():
        old = replaced_path(dst)
        dst.rename(old)
        partial.rename(dst)
        shutil.rmtree(old)
    else:
        partial.rename(dst)


def progress_bar(enabled: bool, description: str, total: int):
    """A rich progress bar with bytes and bytes/s (a no-op display when disabled)."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), disable=not enabled)
    return progress, progress.add_task(description, total=total)


def copy_rows(ckpt: CheckpointReader, info: TensorInfo, write, chunk_bytes: int, cast=None) -> int:
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


def copy_files(src: Path, dst: Path, skip: set[str]) -> None:
    """Copy the other top-level files (tokenizer, generation config, ...)."""
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in skip and not path.name.endswith(".safetensors"):
            shutil.copy2(path, dst / path.name)


def check_copy(src: CheckpointReader, dst: CheckpointReader, name: str, chunk_bytes: int, where: Path) -> None:
    """An unquantized tensor must be identical (after casting the source to the stored dtype)."""
    a, b = src.info(name), dst.info(name)
    if not a.shape or not b.shape:
        same = same_bytes(src.read(name).to(b.torch_dtype), dst.read(name))
    else:
        step = max(1, chunk_bytes // max(a.row_bytes, 1))
        same = a.shape == b.shape and all(
            same_bytes(src.read_rows(name, r0, min(a.rows, r0 + step)).to(b.torch_dtype),
                        dst.read_rows(name, r0, min(a.rows, r0 + step))) for r0 in range(0, a.rows, step))
    if not same:
        raise ConvertError(f"{where}: verify failed, {name} differs from the source")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical tensors."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))
