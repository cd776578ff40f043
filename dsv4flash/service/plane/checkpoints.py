"""Service-side checkpoint metadata the lifecycle catalog does not hold: expiry (Tinker's `ttl_seconds`) and the
`public` flag, one JSON file per store (`<root>/service/checkpoints.json`, rewritten atomically).

The catalog owns the bytes and the names (`<run>:weights.<name>` tags); this registry only says when a name
expires and whether it is published. Expired names stop resolving at once (`ServiceClient` checks on every
read) and are removed from the catalog by `ServiceClient.expire_checkpoints()` (run by the RestClient's
listings and `ServiceClient.gc`), after which `AdapterStore.gc` frees bytes nothing else references.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from dsv4flash.atomic_io import write_bytes_atomic


class CheckpointRegistry:
    """tinker path -> {"expires_at": unix seconds | None, "public": bool}, persisted next to the store."""

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / "service" / "checkpoints.json"
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        if self.path.exists():
            try:
                self._entries = dict(json.loads(self.path.read_text())["checkpoints"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.path}: not a checkpoint registry (expected {{\"checkpoints\": {{…}}}}): "
                                 f"{exc}") from exc

    def get(self, path: str) -> dict:
        """The entry of a checkpoint path (defaults: never expires, private)."""
        with self._lock:
            return dict(self._entries.get(path, {"expires_at": None, "public": False}))

    def set(self, path: str, *, ttl_seconds: float | None = ..., public: bool | None = None,
            now: float | None = None) -> dict:
        """Set a path's expiry (`ttl_seconds` from now; None = never) and/or public flag; returns the entry."""
        with self._lock:
            entry = dict(self._entries.get(path, {"expires_at": None, "public": False}))
            if ttl_seconds is not ...:
                if ttl_seconds is not None and ttl_seconds <= 0:
                    raise ValueError(f"{path}: ttl_seconds must be positive or None, got {ttl_seconds}")
                entry["expires_at"] = None if ttl_seconds is None else (time.time() if now is None else now) + float(ttl_seconds)
            if public is not None:
                entry["public"] = bool(public)
            if path in self._entries or entry != {"expires_at": None, "public": False}:  # defaults stay implicit
                self._entries[path] = entry
                self._save()
            return dict(entry)

    def forget(self, path: str) -> None:
        """Drop a path's entry (its checkpoint was deleted)."""
        with self._lock:
            if self._entries.pop(path, None) is not None:
                self._save()

    def expired(self, now: float | None = None) -> list[str]:
        """Paths whose expiry has passed."""
        now = time.time() if now is None else now
        with self._lock:
            return sorted(p for p, e in self._entries.items() if e.get("expires_at") is not None and e["expires_at"] <= now)

    def is_expired(self, path: str, now: float | None = None) -> bool:
        """Whether a path's expiry has passed."""
        expires = self.get(path)["expires_at"]
        return expires is not None and expires <= (time.time() if now is None else now)

    def _save(self) -> None:
        write_bytes_atomic(self.path, json.dumps({"checkpoints": self._entries}, indent=1, sort_keys=True).encode())
