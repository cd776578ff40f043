"""CPU tier: decoded adapters in host memory under a byte budget, LRU with pinning and size admission.

`max_entries` (optional) also bounds how many adapters are held (`dsv4flash serve --max-cpu-loras`).

Admission: an adapter larger than the whole budget is never admitted (it would flush everything for
one use); pinned entries (e.g. the `prod` revision) are never evicted. Otherwise least-recently-used
entries are evicted until the newcomer fits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from dsv4flash.lifecycle.loader import LoadedRevision

__all__ = ["CpuCache", "CpuCacheStats"]


@dataclass
class CpuCacheStats:
    """Counters since creation."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    rejected: int = 0
    evicted_bytes: int = 0
    evicted: list[str] = field(default_factory=list)


class CpuCache:
    """Thread-safe LRU of `LoadedRevision`s bounded by total bytes."""

    def __init__(self, budget_bytes: int, max_entries: int | None = None):
        if budget_bytes < 0:
            raise ValueError(f"CPU cache budget must be >= 0 bytes, got {budget_bytes}")
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"CPU cache max_entries must be >= 0, got {max_entries}")
        self.budget = int(budget_bytes)
        self.max_entries = max_entries
        self._entries: OrderedDict[str, LoadedRevision] = OrderedDict()
        self._pinned: set[str] = set()
        self._used = 0
        self._lock = threading.Lock()
        self.stats = CpuCacheStats()

    @property
    def used_bytes(self) -> int:
        """Bytes currently held."""
        return self._used

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Cached revision ids, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: str) -> LoadedRevision | None:
        """The cached adapter (marking it most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry

    def put(self, entry: LoadedRevision) -> bool:
        """Admit an adapter, evicting LRU unpinned entries; False if it cannot fit."""
        with self._lock:
            if entry.id in self._entries:
                self._entries.move_to_end(entry.id)
                return True
            if entry.nbytes > self.budget:
                self.stats.rejected += 1
                return False
            if self.max_entries is not None and self.max_entries < 1:
                self.stats.rejected += 1
                return False
            victims, free, count = [], self.budget - self._used, len(self._entries)
            for key, old in self._entries.items():
                if free >= entry.nbytes and (self.max_entries is None or count < self.max_entries):
                    break
                if key not in self._pinned:
                    victims.append(key)
                    free += old.nbytes
                    count -= 1
            if free < entry.nbytes or (self.max_entries is not None and count >= self.max_entries):
                self.stats.rejected += 1
                return False
            for key in victims:
                old = self._entries.pop(key)
                self._used -= old.nbytes
                self.stats.evictions += 1
                self.stats.evicted_bytes += old.nbytes
                self.stats.evicted.append(key)
            self._entries[entry.id] = entry
            self._used += entry.nbytes
            return True

    def pin(self, key: str) -> None:
        """Never evict `key` (it may be admitted later)."""
        with self._lock:
            self._pinned.add(key)

    def unpin(self, key: str) -> None:
        """Make `key` evictable again."""
        with self._lock:
            self._pinned.discard(key)

    def evict(self, key: str) -> bool:
        """Drop one entry (pinned or not); True if it was cached."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.nbytes
            return True
