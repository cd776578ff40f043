"""Where the adapter store lives when nobody says: the one store training publishes into and `dsv4flash serve` reads.

A store location is a directory or an S3 URL (`s3://bucket/prefix`, docs/lifecycle.md "A store on S3").
Pure string/path logic (no torch, no catalog, no S3 client), so command-line front ends can print it in `--help`
at once.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_store", "is_remote_store", "local_dir_for", "no_store_at", "store_location", "S3_SCHEME"]

S3_SCHEME = "s3://"


def is_remote_store(location: str | os.PathLike) -> bool:
    """Whether a store location is an object store URL (`s3://…`) rather than a directory."""
    return isinstance(location, str) and location.startswith(S3_SCHEME)


def store_location(text: str | os.PathLike) -> Path | str:
    """A store location from user text: `s3://bucket/prefix` kept as the URL (no trailing slash), else a Path."""
    if isinstance(text, str) and text.startswith(S3_SCHEME):
        return text.rstrip("/")
    return Path(text).expanduser()


def default_store() -> Path | str:
    """`$DSV4FLASH_STORE` (a directory or `s3://…`), else `$XDG_DATA_HOME/dsv4flash/store`, else
    `~/.local/share/dsv4flash/store`."""
    if os.environ.get("DSV4FLASH_STORE"):
        return store_location(os.environ["DSV4FLASH_STORE"])
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share").expanduser()
    return data / "dsv4flash" / "store"


def local_dir_for(location: Path | str) -> Path:
    """This machine's directory for files kept beside a store (a server's keys and registries, caches): the store
    directory itself, or for `s3://bucket/prefix` `$XDG_STATE_HOME/dsv4flash/s3/bucket/prefix` (else under
    `~/.local/state`)."""
    if not is_remote_store(location):
        return Path(location)
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state").expanduser()
    return state / "dsv4flash" / "s3" / str(location)[len(S3_SCHEME):]


def no_store_at(root: Path | str) -> str | None:
    """The one-line error for a `root` that is not a directory (no store can be there), else None; an S3 location
    is checked when the store opens (it takes a request)."""
    if is_remote_store(root) or Path(root).is_dir():
        return None
    return f"{root}: no adapter store here (create one with `dsv4flash lifecycle --root {root} init`)"
