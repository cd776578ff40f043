"""API keys of `dsv4flash serve`: a keys file maps tenants to keys; the server keeps only SHA-256 hashes.

File format, one entry a line (`#` comments and blank lines ignored):
    <tenant> <api-key>          # a plain key (the SDK's `tml-…` or MinT's `sk-…`); hashed on load
    <tenant> sha256:<64 hex>    # a stored hash (what `dsv4flash serve keys add` writes)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from dsv4flash.atomic_io import write_bytes_atomic

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HASH = re.compile(r"sha256:([0-9a-f]{64})")
KEY_PREFIXES = ("tml-", "sk-")


class KeyFileError(ValueError):
    """A keys file line that is not `<tenant> <key>` or `<tenant> sha256:<hex>`."""


def key_hash(api_key: str) -> str:
    """The hex SHA-256 of an API key (what the server stores and compares)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key(prefix: str = "tml-") -> str:
    """A fresh random API key (`tml-` passes the Tinker SDK's own key check)."""
    if prefix not in KEY_PREFIXES:
        raise ValueError(f"key prefix must be one of {KEY_PREFIXES}, got {prefix!r}")
    return prefix + secrets.token_urlsafe(32)


class KeyRing:
    """key hash -> tenant, loaded from a keys file (plain keys are hashed at once and never kept)."""

    def __init__(self, entries: dict[str, str] | None = None, source: str = "<memory>") -> None:
        self._tenant_of = dict(entries or {})
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KeyRing":
        """Parse a keys file; a malformed line raises naming the file and line number."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise KeyFileError(f"{path}: cannot read the keys file ({exc.strerror})") from exc
        entries: dict[str, str] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not _TENANT.fullmatch(parts[0]):
                raise KeyFileError(f"{path}:{lineno}: expected '<tenant> <api-key>' or '<tenant> sha256:<hex>' "
                                   f"(tenant: letters, digits, '_', '.', '-')")
            tenant, secret = parts
            m = _HASH.fullmatch(secret)
            if m is None and secret.startswith("sha256:"):
                raise KeyFileError(f"{path}:{lineno}: sha256: must be followed by 64 lowercase hex digits")
            if m is None and not secret.startswith(KEY_PREFIXES):
                raise KeyFileError(f"{path}:{lineno}: api key must start with {' or '.join(KEY_PREFIXES)}")
            digest = m.group(1) if m else key_hash(secret)
            if entries.get(digest, tenant) != tenant:
                raise KeyFileError(f"{path}:{lineno}: this key is already given to tenant {entries[digest]!r}")
            entries[digest] = tenant
        return cls(entries, str(path))

    def tenant(self, api_key: str | None) -> str | None:
        """The tenant of a key, or None (constant-time per stored hash)."""
        if not api_key:
            return None
        digest = key_hash(api_key)
        found = None
        for stored, tenant in self._tenant_of.items():
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def tenants(self) -> set[str]:
        """Every tenant with at least one key."""
        return set(self._tenant_of.values())

    def __len__(self) -> int:
        return len(self._tenant_of)


def add_key(path: str | os.PathLike, tenant: str, prefix: str = "tml-") -> str:
    """Append `<tenant> sha256:<hash>` of a fresh key to the keys file (atomically) -> the key, shown once."""
    if not _TENANT.fullmatch(tenant):
        raise KeyFileError(f"tenant {tenant!r}: use letters, digits, '_', '.', '-' (at most 64)")
    path = Path(path)
    if path.exists():
        KeyRing.load(path)  # refuse to append to a file the server could not read
        old = path.read_text()
    else:
        old = ""
    key = new_api_key(prefix)
    sep = "" if not old or old.endswith("\n") else "\n"
    write_bytes_atomic(path, f"{old}{sep}{tenant} sha256:{key_hash(key)}\n".encode())
    os.chmod(path, 0o600)
    return key


MIN_SECRET_BYTES = 32  # HMAC-SHA256 wants a key at least as long as its 32-byte output (RFC 7518 §3.2)


class SecretFileError(ValueError):
    """A signing secret file (JWT or download) that is unreadable, empty or too short to sign with."""


def load_secret(path: str | os.PathLike, what: str) -> bytes:
    """The signing secret in `path` (`what` names it in errors), made once with random bytes when missing."""
    # A file that exists but holds fewer than MIN_SECRET_BYTES is refused rather than replaced: an empty key would
    # let anyone sign for any tenant, and silently minting a new one would hide that the file was damaged.
    path = Path(path)
    try:
        if not path.exists():
            write_bytes_atomic(path, secrets.token_bytes(MIN_SECRET_BYTES))
            os.chmod(path, 0o600)
        secret = path.read_bytes()
    except OSError as exc:
        raise SecretFileError(f"{path}: cannot read the {what} ({exc.strerror})") from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretFileError(f"{path}: the {what} is {len(secret)} bytes, expected at least {MIN_SECRET_BYTES} "
                              f"(remove the file and restart to have a fresh one made)")
    return secret


class TokenSigner:
    """Short-lived HS256 JWTs for the SDK's key -> JWT exchange (`/api/v1/auth/token`): `sub` is the tenant.

    The signing secret lives in `<store>/service/jwt_secret` (0600, made once: `load_secret`), so tokens stay
    valid across a restart; a removed key stops minting new tokens at once, its tokens expire within `ttl_s`.
    """

    def __init__(self, secret_path: str | os.PathLike, ttl_s: float = 3600.0) -> None:
        self._secret = load_secret(secret_path, "JWT signing secret")
        self.ttl_s = float(ttl_s)

    def issue(self, tenant: str, now: float | None = None) -> str:
        """A signed token for `tenant`."""
        import time

        now = time.time() if now is None else now
        head = _b64({"alg": "HS256", "typ": "JWT"})
        body = _b64({"sub": tenant, "iat": int(now), "exp": int(now + self.ttl_s), "iss": "dsv4flash-serve"})
        return f"{head}.{body}.{self._sign(f'{head}.{body}')}"

    def tenant(self, token: str, now: float | None = None) -> str | None:
        """The tenant of a valid, unexpired token; None otherwise."""
        import base64
        import json
        import time

        parts = token.split(".")
        if len(parts) != 3 or not hmac.compare_digest(self._sign(f"{parts[0]}.{parts[1]}"), parts[2]):
            return None
        try:
            claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        except ValueError:
            return None
        if float(claims.get("exp", 0)) <= (time.time() if now is None else now):
            return None
        return claims.get("sub")

    def _sign(self, data: str) -> str:
        import base64

        mac = hmac.new(self._secret, data.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _b64(obj: dict) -> str:
    import base64
    import json

    return base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()
