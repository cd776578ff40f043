"""Service-side checkpoint metadata the lifecycle catalog does not hold: expiry (Tinker's `ttl_seconds`) and the
`public` flag, one JSON file per store (`<root>/service/checkpoints.json`, rewritten atomically).

The catalog owns the bytes and the names (`<run>:weights.<name>` tags); this registry only says when a name
expires and whether it is published. Expired names stop resolving at once (`ServiceClient` checks on every
read) and are removed from the catalog by `ServiceClient.expire_checkpoints()` (run by the RestClient's
listings and `ServiceClient.gc`), after which `AdapterStore.gc` frees bytes nothing else references.

Entries are keyed by a path's canonical spelling (`ParsedCheckpointTinkerPath.canonical`), so `mint://` and
`tinker://` name the same entry. A row of the file that cannot be used (an unparsable path, an expiry no
clock can reach) is logged and ignored rather than failing every read of the store.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from dsv4flash.atomic_io import write_bytes_atomic
from dsv4flash.lifecycle.errors import IntegrityError
from dsv4flash.lifecycle.refs import ParsedCheckpointTinkerPath

log = logging.getLogger("dsv4flash.service")

MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # ten years: anything longer is a mistake, and far enough overflows datetime


def check_ttl(ttl_seconds, *, integer: bool = False, field: str = "ttl_seconds"):
    """`ttl_seconds` if None or in [1, MAX_TTL_SECONDS] (an int when `integer`); ValueError naming `field`."""
    # bool is an int to Python, but `true` meaning one second is never what a client meant
    if ttl_seconds is None:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if (isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, kind) or not math.isfinite(ttl_seconds)
            or not 0 < ttl_seconds <= MAX_TTL_SECONDS):
        raise ValueError(f"{field}: expected {'an integer' if integer else 'a number'} of seconds in "
                         f"[1, {MAX_TTL_SECONDS}] (10 years) or null, got {ttl_seconds!r}")
    return ttl_seconds


class CheckpointIntegrityError(IntegrityError):
    """A checkpoint whose stored bytes are damaged or gone: every reader of it raises this, naming the path."""

    def __init__(self, path: str, cause: BaseException) -> None:
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"checkpoint {path}: its stored bytes are damaged and cannot be read ({reason}); delete "
                         f"it and save again, or restore the store from a backup")
        self.path = path


def canonical_path(path: str) -> str:
    """The one spelling of a checkpoint path that per-path state is keyed by (ValueError if it is no path)."""
    return ParsedCheckpointTinkerPath.from_tinker_path(path).canonical


def _usable_entry(path: str, entry) -> tuple[str, dict] | None:
    """(canonical path, entry) of one stored row, bad fields dropped with a warning; None for an unusable row."""
    try:
        key = canonical_path(path)
    except (TypeError, ValueError) as exc:
        log.warning("checkpoint registry: row %r ignored (%s)", path, exc)
        return None
    entry = entry if isinstance(entry, dict) else {}
    expires, public = entry.get("expires_at"), entry.get("public", False)
    if expires is not None:
        try:  # a time a datetime can hold; 1e30 (once accepted as ttl_seconds=10**30) cannot
            if isinstance(expires, bool) or not isinstance(expires, numbers.Real):
                raise TypeError(f"not a number: {expires!r}")
            datetime.fromtimestamp(float(expires), tz=timezone.utc)
        except (TypeError, ValueError, OverflowError, OSError) as exc:
            log.warning("checkpoint registry: %s expires_at %r ignored (%s); the checkpoint does not expire",
                        key, expires, exc)
            expires = None
    if not isinstance(public, bool):
        log.warning("checkpoint registry: %s public %r ignored (not true/false); the checkpoint is private",
                    key, public)
        public = False
    return key, {"expires_at": expires, "public": public}


class CheckpointRegistry:
    """tinker path -> {"expires_at": unix seconds | None, "public": bool}, persisted next to the store."""

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / "service" / "checkpoints.json"
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        if self.path.exists():
            try:
                rows = dict(json.loads(self.path.read_text())["checkpoints"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.path}: not a checkpoint registry (expected {{\"checkpoints\": {{…}}}}): "
                                 f"{exc}") from exc
            for path, entry in rows.items():
                usable = _usable_entry(path, entry)
                if usable is not None:
                    key, entry = usable
                    if key in self._entries:  # two spellings of one path, from before keys were canonical
                        entry = _merged(self._entries[key], entry)
                    self._entries[key] = entry

    def get(self, path: str) -> dict:
        """The entry of a checkpoint path, in any spelling (defaults: never expires, private)."""
        key = canonical_path(path)
        with self._lock:
            return dict(self._entries.get(key, {"expires_at": None, "public": False}))

    def set(self, path: str, *, ttl_seconds: float | None = ..., public: bool | None = None,
            now: float | None = None) -> dict:
        """Set a path's expiry (`ttl_seconds` from now; None = never) and/or public flag; returns the entry."""
        key = canonical_path(path)
        if ttl_seconds is not ...:
            check_ttl(ttl_seconds)
        with self._lock:
            entry = dict(self._entries.get(key, {"expires_at": None, "public": False}))
            if ttl_seconds is not ...:
                entry["expires_at"] = None if ttl_seconds is None else (time.time() if now is None else now) + float(ttl_seconds)
            if public is not None:
                entry["public"] = bool(public)
            if key in self._entries or entry != {"expires_at": None, "public": False}:  # defaults stay implicit
                self._entries[key] = entry
                self._save()
            return dict(entry)

    def forget(self, path: str) -> None:
        """Drop a path's entry (its checkpoint was deleted)."""
        key = canonical_path(path)
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._save()

    def expired(self, now: float | None = None) -> list[str]:
        """Paths (canonical) whose expiry has passed."""
        now = time.time() if now is None else now
        with self._lock:
            return sorted(p for p, e in self._entries.items() if e.get("expires_at") is not None and e["expires_at"] <= now)

    def published(self) -> list[str]:
        """Paths (canonical) whose owner published them."""
        with self._lock:
            return sorted(p for p, e in self._entries.items() if e.get("public"))

    def is_expired(self, path: str, now: float | None = None) -> bool:
        """Whether a path's expiry has passed, in any spelling."""
        expires = self.get(path)["expires_at"]
        return expires is not None and expires <= (time.time() if now is None else now)

    def _save(self) -> None:
        write_bytes_atomic(self.path, json.dumps({"checkpoints": self._entries}, indent=1, sort_keys=True).encode())


def _merged(a: dict, b: dict) -> dict:
    """One entry for two rows of the same checkpoint: the earlier expiry, public only if both say so."""
    times = [t for t in (a["expires_at"], b["expires_at"]) if t is not None]
    return {"expires_at": min(times) if times else None, "public": a["public"] and b["public"]}
