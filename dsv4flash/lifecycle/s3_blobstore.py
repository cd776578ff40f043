"""Content-addressed objects in an S3-compatible bucket: `s3://bucket/prefix/blobs/objects/<aa>/<sha256>` (a `BlobBackend`).

S3 has no rename, so the address must be known before an upload starts: a writer spools its bytes to an anonymous
local temp file (unlinked from birth, so a killed writer leaves nothing on disk) while hashing them, then sends
them to their content address in one request (`PutObject` with the sha256 checksum the server verifies) or, past
one part, as a multipart upload whose `CompleteMultipartUpload` makes the whole object appear at once. Until that
completion nothing exists at the address; a writer killed mid-upload leaves only an unfinished upload, which
`ListObjects`/`GetObject` never show. Each multipart writer records who it is (host, boot id, pid and the pid's
start time) in a marker object `uploads/…` beside the objects, so a store opened on the same host aborts a dead
writer's upload at once; an upload whose writer ran elsewhere is aborted by `gc` once older than its grace
period, like a temp file on a filesystem without locks. A repeated put of bytes already stored is a server-side
self-copy that refreshes the object's age.

The client is boto3 with its usual configuration: credentials, region and endpoint (`AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL` for MinIO, Ceph, moto …) from the environment or `~/.aws`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

from dsv4flash.lifecycle.blob_backend import BlobBackend, BlobInfo, HashingWriter, check_key
from dsv4flash.lifecycle.default_store import S3_SCHEME
from dsv4flash.lifecycle.errors import BlobStoreUnreachableError, StoreNotFoundError
from dsv4flash.lifecycle.faults import crashpoint

__all__ = ["S3BlobStore", "S3BlobWriter", "S3Source", "Upload", "parse_s3_url", "s3_client"]

PART_SIZE = 8 << 20  # S3's smallest part is 5 MiB (all but the last); 10,000 parts at most
_MAX_PARTS = 10_000
_READ_CHUNK = 1 << 20
CATALOG_RECORD = "catalog"  # the store's catalog URL, beside blobs/ (what catalog.sqlite is to a directory store)


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of `s3://bucket/prefix`; ValueError if malformed."""
    if not url.startswith(S3_SCHEME):
        raise ValueError(f"{url}: not an s3:// URL")
    bucket, _, prefix = url[len(S3_SCHEME):].partition("/")
    if not bucket:
        raise ValueError(f"{url}: no bucket name (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def s3_client():
    """A boto3 S3 client configured from the environment (endpoint, credentials, region), with retries."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise BlobStoreUnreachableError("an s3:// store needs boto3 (pip install 'dsv4flash[s3]')") from None
    return boto3.session.Session().client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))


def _code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ('' for anything else)."""
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))


def _missing(exc: BaseException) -> bool:
    return _code(exc) in {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (None if no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class Upload:
    """A temp item of the S3 backend: an unfinished multipart upload, or an orphaned writer marker (upload_id None)."""

    object_key: str
    upload_id: str | None
    started: float
    marker: str


class S3Source:
    """A `ByteSource` over one object: ranged GETs."""

    def __init__(self, s3, bucket: str, key: str, name: str):
        self._s3, self._bucket, self._key, self.name = s3, bucket, key, name
        try:
            self.size = int(s3.head_object(Bucket=bucket, Key=key)["ContentLength"])
        except Exception as exc:
            if _missing(exc):
                raise FileNotFoundError(f"{name}: no such object") from None
            raise BlobStoreUnreachableError(f"{name}: {exc}") from None

    def _get(self, n: int, offset: int):
        return self._s3.get_object(Bucket=self._bucket, Key=self._key, Range=f"bytes={offset}-{offset + n - 1}")["Body"]

    def pread(self, n: int, offset: int) -> bytes:
        """Up to `n` bytes at `offset`."""
        n = min(n, self.size - offset)
        return self._get(n, offset).read() if n > 0 else b""

    def readinto_at(self, view: memoryview, offset: int) -> None:
        """Stream the range into `view`; a short body (the object changed underneath) is an error naming the byte."""
        from dsv4flash.lifecycle.errors import AdapterFormatError

        if not len(view):
            return
        body, done = self._get(len(view), offset), 0
        while done < len(view) and (block := body.read(min(_READ_CHUNK, len(view) - done))):
            view[done:done + len(block)] = block
            done += len(block)
        if done < len(view):
            raise AdapterFormatError(f"{self.name}: short read at byte {offset + done} (object changed while reading?)")

    def close(self) -> None:
        """Nothing held between requests."""


class S3BlobWriter(HashingWriter):
    """Spools and hashes a blob locally, then sends it to its content address in one atomic step."""

    def __init__(self, store: "S3BlobStore", expected_size: int | None = None):
        self._store = store
        # unlinked already: the spool dies with the process
        super().__init__(tempfile.TemporaryFile(prefix="dsv4flash-blob-"), expected_size)

    def commit(self) -> str:
        """Upload to `objects/<aa>/<sha256>` (a self-copy if those bytes are stored already) and return the hex key."""
        crashpoint("blob.before_fsync")
        self._file.flush()
        key = self._hash.hexdigest()
        store = self._store
        if store.size_of(key) == self._written and store.touch(key):
            crashpoint("blob.before_rename")  # identical content already published: its age is refreshed
        elif self._written <= store.part_size:
            crashpoint("blob.before_rename")
            self._file.seek(0)
            store.put_whole(key, self._file.read(), digest=self._hash.digest())
        else:
            store.put_multipart(key, self._file, self._written)
        self._file.close()
        crashpoint("blob.after_rename")
        self.key = key
        return key

    def abort(self) -> None:
        """Drop the spool (nothing was sent, or a failed multipart upload was already aborted)."""
        self._file.close()


class S3BlobStore(BlobBackend):
    """Immutable blobs addressed by sha256 under `s3://bucket/prefix` (objects/, and uploads/ for writer markers)."""

    def __init__(self, url: str, *, client: Any = None, part_size: int = PART_SIZE):
        self.root = url.rstrip("/")
        self.bucket, prefix = parse_s3_url(self.root)
        self._base = f"{prefix}/" if prefix else ""
        self.objects = f"{self._base}objects/"
        self.uploads = f"{self._base}uploads/"
        self.part_size = part_size
        self.s3 = client or s3_client()
        try:
            self.s3.head_bucket(Bucket=self.bucket)
        except Exception as exc:
            if _missing(exc) or _code(exc) == "NoSuchBucket":
                raise StoreNotFoundError(f"{S3_SCHEME}{self.bucket}: no such bucket (create it first; the store "
                                         "lives under a prefix of an existing bucket)") from None
            raise BlobStoreUnreachableError(f"{self.root}: cannot reach the bucket ({_first_line(exc)})") from None
        self.swept_on_open = self.sweep_dead_temp_files()

    def object_key(self, key: str) -> str:
        """The S3 key of blob `key`."""
        return f"{self.objects}{check_key(key)[:2]}/{key}"

    def describe(self, key: str) -> str:
        """The blob's s3:// URL, for messages."""
        return f"{S3_SCHEME}{self.bucket}/{self.object_key(key)}"

    # ---- the store's catalog record: `<store prefix>/catalog`, beside blobs/ ----
    def default_catalog(self) -> str | None:
        """The catalog URL recorded when the store was created (None: not an initialised store)."""
        raw = self._get_or_none(self._store_key(CATALOG_RECORD))
        return raw.decode().strip() if raw is not None else None

    def remember_catalog(self, catalog: str) -> None:
        """Record the store's catalog (one PUT: whole or absent); a URL with a password in it is refused."""
        if _has_password(catalog):
            raise ValueError(f"{catalog.split('@')[-1]}: the catalog URL holds a password; give it through PGPASSWORD "
                             "or ~/.pgpass, so the bucket never stores it")
        self.s3.put_object(Bucket=self.bucket, Key=self._store_key(CATALOG_RECORD), Body=catalog.encode())

    def _store_key(self, relative: str) -> str:
        parent = self._base.rstrip("/").rpartition("/")[0]  # the store root is the parent of .../blobs
        return f"{parent}/{relative}" if parent else relative

    # ---- BlobBackend ----
    def exists(self, key: str) -> bool:
        """Whether the blob is stored."""
        return self.size_of(key) is not None

    def size_of(self, key: str) -> int | None:
        """The stored blob's size, None if absent."""
        try:
            return int(self.s3.head_object(Bucket=self.bucket, Key=self.object_key(key))["ContentLength"])
        except Exception as exc:
            if _missing(exc):
                return None
            raise BlobStoreUnreachableError(f"{self.describe(key)}: {_first_line(exc)}") from None

    def touch(self, key: str) -> bool:
        """Refresh a stored blob's age (a self-copy with new metadata); False if it vanished meanwhile (gc)."""
        okey = self.object_key(key)
        try:
            self.s3.copy_object(Bucket=self.bucket, Key=okey, CopySource={"Bucket": self.bucket, "Key": okey},
                                MetadataDirective="REPLACE", Metadata={"dsv4flash-touched": f"{time.time():.3f}"})
        except Exception as exc:
            if _missing(exc):
                return False
            raise
        return True

    def put_whole(self, key: str, data: bytes, *, digest: bytes) -> None:
        """One PUT of the whole blob; the server checks it against its sha256 before it becomes visible."""
        self.s3.put_object(Bucket=self.bucket, Key=self.object_key(key), Body=data,
                           ChecksumSHA256=base64.b64encode(digest).decode())

    def put_multipart(self, key: str, spool, size: int) -> None:
        """A multipart upload of `spool` to blob `key`, visible only when its completion succeeds."""
        okey = self.object_key(key)
        part = max(self.part_size, -(-size // _MAX_PARTS))
        upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=okey)["UploadId"]
        marker = self._marker_key(okey, upload_id)
        try:
            owner = {"host": socket.gethostname(), "boot": _boot_id(), "pid": os.getpid(),
                     "start": _start_ticks(os.getpid()), "upload_id": upload_id, "key": okey}
            self.s3.put_object(Bucket=self.bucket, Key=marker, Body=json.dumps(owner).encode())
            parts = []
            for number, offset in enumerate(range(0, size, part), start=1):
                spool.seek(offset)
                etag = self.s3.upload_part(Bucket=self.bucket, Key=okey, UploadId=upload_id, PartNumber=number,
                                           Body=spool.read(part))["ETag"]
                parts.append({"PartNumber": number, "ETag": etag})
            crashpoint("blob.before_rename")  # every part sent, the upload still unfinished: nothing visible
            self.s3.complete_multipart_upload(Bucket=self.bucket, Key=okey, UploadId=upload_id,
                                              MultipartUpload={"Parts": parts})
        except BaseException:
            self._abort(okey, upload_id)
            raise
        finally:
            self._delete_quietly(marker)

    def writer(self, expected_size: int | None = None) -> S3BlobWriter:
        """A new spooling writer; call `commit()` to publish it."""
        return S3BlobWriter(self, expected_size)

    def source(self, key: str) -> S3Source:
        """Ranged reads of the blob's object."""
        return S3Source(self.s3, self.bucket, self.object_key(key), self.describe(key))

    def delete(self, key: str) -> int:
        """Remove a blob; returns the bytes freed (0 if it was absent)."""
        size = self.size_of(key)
        if size is None:
            return 0
        self.s3.delete_object(Bucket=self.bucket, Key=self.object_key(key))
        return size

    def iter_blobs(self) -> Iterator[BlobInfo]:
        """Every stored blob."""
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.objects):
            for obj in page.get("Contents", ()):
                name = obj["Key"].rpartition("/")[2]
                if len(name) == 64:
                    yield BlobInfo(name, int(obj["Size"]), obj["LastModified"].timestamp())

    def temp_states(self) -> list[tuple[Upload, str]]:
        """Unfinished uploads with their writer's state, plus markers whose upload is gone ("dead": debris).

        Markers are listed before uploads: a writer creates its upload before its marker, so a marker seen first
        whose upload is missing from the later listing belongs to an upload that already finished."""
        markers = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.uploads):
            for obj in page.get("Contents", ()):
                markers[obj["Key"]] = obj["LastModified"].timestamp()
        states, seen = [], set()
        for page in self.s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.objects):
            for up in page.get("Uploads", ()):
                marker = self._marker_key(up["Key"], up["UploadId"])
                seen.add(marker)
                item = Upload(up["Key"], up["UploadId"], up["Initiated"].timestamp(), marker)
                states.append((item, self._writer_state(marker) if marker in markers else "unknown"))
        states += [(Upload("", None, t, m), "dead") for m, t in sorted(markers.items()) if m not in seen]
        return states

    def temp_age(self, item: Upload) -> float:
        """Seconds since the upload was initiated (or the orphaned marker written)."""
        return time.time() - item.started

    def remove_temp(self, item: Upload) -> None:
        """Abort an unfinished upload (its parts are freed) and drop its marker."""
        if item.upload_id is not None:
            self._abort(item.object_key, item.upload_id)
        self._delete_quietly(item.marker)

    # ---- helpers ----
    def _marker_key(self, object_key: str, upload_id: str) -> str:
        # upload ids may hold any URL-safe character, '/' included: name the marker by a hash of (key, id)
        return f"{self.uploads}{hashlib.sha256(f'{object_key} {upload_id}'.encode()).hexdigest()[:32]}"

    def _writer_state(self, marker: str) -> str:
        """ "live"/"dead" for a writer on this host (its pid, checked against its start time), else "unknown"."""
        try:
            raw = self._get_or_none(marker)
        except Exception:  # noqa: BLE001 - unreadable: only the age can tell
            return "unknown"
        if raw is None:  # the writer finished (its marker is deleted last)
            return "dead"
        try:
            owner = json.loads(raw)
        except ValueError:
            return "unknown"
        if owner.get("host") != socket.gethostname() or not owner.get("boot") or owner.get("boot") != _boot_id():
            return "unknown"
        alive = owner.get("start") is not None and _start_ticks(int(owner.get("pid", -1))) == owner["start"]
        return "live" if alive else "dead"

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:
            if _missing(exc):
                return None
            raise BlobStoreUnreachableError(f"{S3_SCHEME}{self.bucket}/{key}: {_first_line(exc)}") from None

    def _abort(self, object_key: str, upload_id: str) -> None:
        try:
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=object_key, UploadId=upload_id)
        except Exception as exc:
            if not _missing(exc):
                raise

    def _delete_quietly(self, key: str) -> None:
        try:
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        except Exception:  # noqa: BLE001 - a marker left behind is swept as debris later
            pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _has_password(catalog: str) -> bool:
    """Whether a PostgreSQL URL / keyword string carries a password."""
    from urllib.parse import urlsplit

    if catalog.startswith(("postgresql://", "postgres://")):
        return urlsplit(catalog).password is not None or "password=" in catalog
    return "password=" in catalog
