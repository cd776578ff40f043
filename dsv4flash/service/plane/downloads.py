"""Signed download URLs of `dsv4flash serve`: checkpoint files fetched without an API key.

A URL carries a grant — the tenant it was signed for, the checkpoint path, the revision behind that path when
it was signed, an expiry — and an HMAC-SHA256 of it under the server's download secret
(`<store>/service/download_secret`, 0600, made once so URLs survive a restart). The secret is not the JWT
secret: a download grant can never pass as an API credential, nor a JWT as a grant. Each download checks the
grant again against the live server (`protocol/download_routes.py`): the tenant still holds a key and may still
read the checkpoint, and the path still names the same revision; so deleting, unpublishing or overwriting a
checkpoint, or removing the tenant's keys, ends its URLs before they expire.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dsv4flash.service.plane.keys import load_secret

# The SDK 0.22 archive (`get_checkpoint_archive_url`) is one tar of the adapter directory; this member goes last,
# after every file, as in Tinker's archives (its CLI checks for it before uploading an adapter).
ARCHIVE_NAME = "checkpoint.tar"
COMPLETE_MARKER = "checkpoint_complete"
_BLOCK = 512


class BadGrant(ValueError):
    """A download token that is malformed or not signed by this server."""


class ExpiredGrant(ValueError):
    """A download token whose expiry has passed."""


@dataclass(frozen=True)
class Grant:
    """What a signed URL allows: `tenant` may fetch the files of `path` while it names `revision`, until
    `expires_at` (unix seconds)."""

    tenant: str
    path: str
    revision: str
    expires_at: float


class DownloadSigner:
    """Signs and checks download grants with the store's download secret."""

    def __init__(self, secret_path: str | os.PathLike, ttl_s: float = 900.0) -> None:
        # an empty or truncated file would make every URL guessable: refused (SecretFileError), not replaced
        self._secret = load_secret(secret_path, "download secret")
        self.ttl_s = float(ttl_s)

    def sign(self, tenant: str, path: str, revision: str, *, not_after: float | None = None,
             now: float | None = None) -> tuple[str, float]:
        """A token for `tenant` to fetch `path` at `revision` -> (token, expiry)."""
        # ttl_s from now, earlier when the checkpoint itself expires first (not_after): a URL never outlives it
        now = time.time() if now is None else now
        expires = now + self.ttl_s if not_after is None else min(now + self.ttl_s, float(not_after))
        body = _b64(json.dumps({"t": tenant, "p": path, "r": revision, "e": expires}, separators=(",", ":")).encode())
        return f"{body}.{self._mac(body)}", expires

    def verify(self, token: str, now: float | None = None) -> Grant:
        """The grant of a token this server signed and that has not expired (BadGrant / ExpiredGrant otherwise)."""
        body, _, mac = token.partition(".")
        if not mac or not hmac.compare_digest(self._mac(body), mac):
            raise BadGrant("download URL: bad signature (ask for a new URL)")
        try:
            claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            grant = Grant(str(claims["t"]), str(claims["p"]), str(claims["r"]), float(claims["e"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise BadGrant(f"download URL: malformed grant ({exc})") from exc
        if grant.expires_at <= (time.time() if now is None else now):
            raise ExpiredGrant("download URL: expired (ask for a new URL)")
        return grant

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._secret, body.encode(), hashlib.sha256).digest())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def archive_files(directory: Path) -> list[str]:
    """The files of an exported adapter directory (what the per-file URLs name), sorted."""
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def _tar_members(directory: Path) -> list[tuple[tarfile.TarInfo, Path | None]]:
    out = []
    for name in [*archive_files(directory), COMPLETE_MARKER]:
        source = directory / name if name != COMPLETE_MARKER else None
        info = tarfile.TarInfo(name)
        info.size = source.stat().st_size if source is not None else 0
        info.mtime = int(source.stat().st_mtime) if source is not None else int(time.time())
        info.mode = 0o644
        out.append((info, source))
    return out


def tar_stream(directory: Path, chunk: int = 1 << 20) -> tuple[int, Iterator[bytes]]:
    """(byte size, chunks) of a tar of the adapter directory plus the completion marker."""
    # Written as it is read: an adapter can be large, so no temporary copy on the server's disk.
    members = _tar_members(directory)
    size = sum(_BLOCK + -(-info.size // _BLOCK) * _BLOCK for info, _ in members) + 2 * _BLOCK

    def chunks() -> Iterator[bytes]:
        for info, source in members:
            yield info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
            if source is not None:
                with open(source, "rb") as fh:
                    sent = 0
                    while sent < info.size:  # the export is immutable (one per revision): its size holds
                        block = fh.read(min(chunk, info.size - sent))
                        if not block:
                            raise OSError(f"{source}: shorter than when the archive started")
                        sent += len(block)
                        yield block
            yield b"\0" * (-info.size % _BLOCK)
        yield b"\0" * (2 * _BLOCK)

    return size, chunks()

