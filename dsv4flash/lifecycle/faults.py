"""Injected crash points for testing atomic publish and resume: `DSV4FLASH_CRASH_AT=<point>[:<n>]`.

When the environment variable names a point, the process SIGKILLs itself the n-th time (default 1st) it
reaches that point, exactly like an operator's `kill -9`: no atexit, no finally blocks, no flushing of
Python buffers. Production code pays one dict lookup per point.
"""

from __future__ import annotations

import os
import signal

__all__ = ["crashpoint", "CRASH_ENV", "POINTS"]

CRASH_ENV = "DSV4FLASH_CRASH_AT"

# Every point the lifecycle passes, in publish order. Tests iterate over this list.
POINTS: tuple[str, ...] = (
    "blob.open",  # temp file created, nothing written
    "blob.mid_write",  # about half the payload written to the temp file
    "blob.before_fsync",  # payload written, not yet fsynced
    "blob.before_rename",  # temp file durable, not yet renamed to its content address
    "blob.after_rename",  # blob visible in the object store, catalog not yet touched
    "catalog.before_commit",  # revision/state/head rows written inside the open transaction
    "catalog.after_commit",  # transaction committed, publish call not yet returned
    "export.mid_write",  # an export directory is half written
    "export.before_rename",  # an export directory is complete under its temp name
)

_hits: dict[str, int] = {}


def crashpoint(name: str) -> None:
    """SIGKILL this process if `DSV4FLASH_CRASH_AT` names this point (and this is the n-th hit)."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
