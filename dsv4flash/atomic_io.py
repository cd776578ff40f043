"""Durable, all-or-nothing publication of files and directories (write a temp, fsync, rename)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync_path", "publish_directory", "write_bytes_atomic"]


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory (which makes a rename/create/unlink inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to a sibling temp file, fsync it, rename it onto `path`, fsync the directory."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(target.parent)
    return target


def publish_directory(directory: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool,
                      before_rename: Callable[[], None] | None = None, what: str = "publish") -> Path:
    """Fill a sibling temp dir with `write(tmp)`, fsync it, then rename it onto `directory`.

    Readers see the old directory or the complete new one, never a mix: an existing target is first moved
    aside, then replaced, then removed. On any error the temp dir is deleted and the target is untouched.
    """
    target = Path(directory)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{what}: {target} exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.iterdir():
            if path.is_file():
                fsync_path(path)
        fsync_path(tmp)
        if before_rename is not None:
            before_rename()
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
        fsync_path(target.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
