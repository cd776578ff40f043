"""Cold loads from the blob store with accounting: bytes, tensor count, read/verify and unpack time.

`read_revision_blob` streams one revision blob (a file, or an object of an S3 store) into a single (optionally pinned) buffer while hashing
it against its content address, parses the embedded manifest, checks the base fingerprint and returns
zero-copy tensor views. Several loads run concurrently in a thread pool (`AdapterCache`): `preadv`
and `sha256.update` both release the GIL, so one adapter's read overlaps another's hash and unpack.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass

import torch

from dsv4flash.lifecycle.blob_backend import BlobBackend
from dsv4flash.lifecycle.errors import IntegrityError
from dsv4flash.lifecycle.fingerprint import BaseFingerprint, check_compatible
from dsv4flash.lifecycle.revision import LayoutManifest, manifest_from_header
from dsv4flash.lifecycle.safetensors_io import read_safetensors

__all__ = ["LoadAccount", "LoadedRevision", "read_revision_blob", "thread_core_wait_ms"]


@dataclass
class LoadAccount:
    """Cost of bringing one revision up a tier (all times in milliseconds)."""

    revision: str
    source: str  # "disk" (cold), "cpu" (CPU-cache hit) or "resident" (already in a device slot)
    nbytes: int = 0
    n_tensors: int = 0
    queued_ms: float = 0.0  # waiting for a free device slot (backpressure)
    read_ms: float = 0.0  # disk -> host buffer, hash included when verifying
    unpack_ms: float = 0.0  # header/manifest parse, base check, tensor views
    device_ms: float = 0.0  # host -> device slot copy
    total_ms: float = 0.0
    cpu_ms: float = 0.0  # of total_ms (queue wait excluded), the loading thread's time on a core: a host-bound load
    # has cpu_ms close to its wall time less core_wait_ms, so overlapping loads gains at most the cores they run on
    core_wait_ms: float = 0.0  # of total_ms, runnable but waiting for a core (other work on the machine; Linux only)

    def as_dict(self) -> dict:
        """Plain dict (JSON logs, benchmark reports)."""
        return asdict(self)


@dataclass
class LoadedRevision:
    """A revision in host memory: tensor views over one buffer plus its manifest."""

    id: str
    tensors: dict[str, torch.Tensor]
    manifest: LayoutManifest
    nbytes: int
    account: LoadAccount


def thread_core_wait_ms() -> float:
    """Milliseconds the calling thread has spent runnable but waiting for a core (Linux schedstat; 0.0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return 0.0


def read_revision_blob(
    blobs: BlobBackend,
    key: str,
    *,
    verify: bool = True,
    pin_memory: bool = False,
    resident_base: BaseFingerprint | None = None,
) -> LoadedRevision:
    """Read revision `key` from its blob store into host memory, verifying its hash and base."""
    t0 = time.perf_counter()
    src = blobs.source(key)
    path = src.name
    hasher = hashlib.sha256() if verify else None
    try:
        tensors, header = read_safetensors(src, pin_memory=pin_memory, on_chunk=hasher.update if hasher else None)
    finally:
        src.close()
    if hasher is not None and hasher.hexdigest() != key:
        raise IntegrityError(f"revision blob {path} hashes to {hasher.hexdigest()}, not its address {key} (corrupted on disk?)")
    t1 = time.perf_counter()
    manifest = manifest_from_header(header, source=path)
    if resident_base is not None:
        check_compatible(manifest.base, resident_base, what=f"adapter revision {key[:12]} (policy {manifest.policy!r})")
    t2 = time.perf_counter()
    nbytes = header.data_offset + header.data_size
    account = LoadAccount(key, "disk", nbytes, len(tensors), read_ms=(t1 - t0) * 1e3, unpack_ms=(t2 - t1) * 1e3, total_ms=(t2 - t0) * 1e3)
    return LoadedRevision(key, tensors, manifest, nbytes, account)
