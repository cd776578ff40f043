"""Fetch the pinned upstream release the way users get it, verify it, and cache its package tree.

Wheels come through `pip download --no-deps` (pip's own index configuration, certificates and proxies),
pinned to the exact file in base.txt by its wheel tags. Sdists are taken straight from the simple index
(PEP 691 JSON or PEP 503 HTML) because `pip download` would build their metadata, which fails for CUDA
projects such as vLLM. Either way the sha256 must equal base.txt's. As a fallback for machines without
network, a wheel base can be rebuilt from the installed distribution after every file is checked against
the hashes in its RECORD (byte-identical to the wheel). Cache: `$DSV4FLASH_CACHE_DIR`, else
`$XDG_CACHE_HOME/dsv4flash`, else `~/.cache/dsv4flash`; releases under `upstream/<dist>-<version>/`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from dsv4flash.patchseries.series import Base

SOURCES = ("index", "installed", "auto")
DEFAULT_INDEX = "https://pypi.org/simple"


class FetchError(RuntimeError):
    """The pinned release could not be obtained or did not verify."""


@dataclass(frozen=True)
class FetchOptions:
    """Where to look: `source` is index | installed | auto (index, then a verified installed copy)."""

    source: str = "index"
    index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    no_index: bool = False


@dataclass
class Release:
    """A pinned release on disk: `tree` holds the package files at artifact-relative paths."""

    base: Base
    tree: Path
    origin: str
    notes: list[str] = field(default_factory=list)

    def files(self) -> list[str]:
        """Artifact-relative paths of every file in the tree, sorted."""
        return sorted(p.relative_to(self.tree).as_posix() for p in self.tree.rglob("*") if p.is_file())


def cache_root() -> Path:
    """Root of dsv4flash's download cache."""
    if os.environ.get("DSV4FLASH_CACHE_DIR"):
        return Path(os.environ["DSV4FLASH_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dsv4flash"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _wanted(rel: str, packages: tuple[str, ...]) -> bool:
    """Whether an artifact-relative path belongs to the base's package paths (no bytecode)."""
    if "__pycache__/" in rel or rel.endswith(".pyc"):
        return False
    return any(rel == p or rel.startswith(p + "/") for p in packages)


def _pip_download(base: Base, dest: Path, opts: FetchOptions) -> Path:
    """`pip download --no-deps` the pinned wheel into `dest`, pinned to its tags; returns the file."""
    _, _, _, tags = parse_wheel_filename(base.artifact)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--ignore-requires-python",
           "--progress-bar", "off", "--disable-pip-version-check", "-d", str(dest)]
    if any(t.platform != "any" for t in tags):
        interpreter = sorted({t.interpreter for t in tags})[0]  # e.g. cp311: pip takes one version
        cmd += ["--python-version", interpreter[2:], "--implementation", interpreter[:2]]
        for flag, values in (("--abi", {t.abi for t in tags}), ("--platform", {t.platform for t in tags})):
            for value in sorted(values):
                cmd += [flag, value]
    for url in opts.index_urls[:1]:
        cmd += ["--index-url", url]
    for url in opts.index_urls[1:]:
        cmd += ["--extra-index-url", url]
    for link in opts.find_links:
        cmd += ["--find-links", link]
    if opts.no_index:
        cmd.append("--no-index")
    cmd.append(f"{base.distribution}=={base.version}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    got = dest / base.artifact
    if proc.returncode != 0 or not got.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        others = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise FetchError(f"pip download of {base.artifact} failed (got {others}):\n{tail}")
    return got


def _pip_index_urls() -> list[str]:
    """Index URLs pip is configured with (index-url first, then extra-index-url), or PyPI."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    primary, extras = None, []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        value = value.strip().strip("'\"")
        if key.endswith(".index-url"):
            primary = value
        elif key.endswith(".extra-index-url"):
            extras += value.split()
    return [primary or DEFAULT_INDEX, *extras]


def _index_file_url(index: str, base: Base) -> str | None:
    """The download URL of base.artifact on one simple index, or None if that index lacks it."""
    page = f"{index.rstrip('/')}/{canonicalize_name(base.distribution)}/"
    request = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read().decode("utf-8", "replace")
            page = response.geturl()
    except (OSError, ValueError):
        if page.startswith("file:"):  # local mirrors keep the listing in index.html
            try:
                with urllib.request.urlopen(page + "index.html", timeout=60) as response:
                    body = response.read().decode("utf-8", "replace")
            except OSError:
                return None
        else:
            return None
    if body.lstrip().startswith("{"):
        for entry in json.loads(body).get("files", []):
            if entry.get("filename") == base.artifact:
                return urllib.parse.urljoin(page, entry["url"])
        return None
    for href in re.findall(r'href="([^"]+)"', body):
        if urllib.parse.unquote(href.split("#")[0].rsplit("/", 1)[-1]) == base.artifact:
            return urllib.parse.urljoin(page, href)
    return None


def _download(url: str, target: Path) -> None:
    """Stream `url` to `target` with a progress bar on stderr (sdists can be tens of MB)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with urllib.request.urlopen(url, timeout=600) as response, open(target, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task(f"fetching {target.name}", total=total)
            for chunk in iter(lambda: response.read(1 << 20), b""):
                out.write(chunk)
                progress.advance(task, len(chunk))


def _index_download(base: Base, dest: Path, opts: FetchOptions) -> Path:
    """Download an sdist from a find-links folder or the simple index, without building anything."""
    for link in opts.find_links:
        candidate = Path(link) / base.artifact
        if candidate.is_file():
            shutil.copyfile(candidate, dest / base.artifact)
            return dest / base.artifact
    if opts.no_index:
        raise FetchError(f"{base.artifact} is in none of the find-links folders {list(opts.find_links)}")
    indexes = list(opts.index_urls) or _pip_index_urls()
    for index in indexes:
        url = _index_file_url(index, base)
        if url is None:
            continue
        target = dest / base.artifact
        try:
            _download(url, target)
        except OSError as exc:
            raise FetchError(f"downloading {url} failed: {exc}") from exc
        return target
    raise FetchError(f"{base.artifact} not found on any index ({', '.join(indexes)})")


def _extract(base: Base, artifact: Path, out: Path) -> None:
    """Unpack the base's package paths from a wheel or sdist into `out` (artifact-relative paths)."""
    if base.is_wheel or artifact.suffix == ".zip":
        with zipfile.ZipFile(artifact) as zf:
            for info in zf.infolist():
                rel = info.filename if base.is_wheel else info.filename.split("/", 1)[-1]
                if not info.is_dir() and _wanted(rel, base.packages):
                    (out / rel).parent.mkdir(parents=True, exist_ok=True)
                    (out / rel).write_bytes(zf.read(info))
        return
    with tarfile.open(artifact) as tf:
        for member in tf.getmembers():
            rel = member.name.split("/", 1)[-1] if "/" in member.name else ""
            if member.isfile() and _wanted(rel, base.packages):
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                with tf.extractfile(member) as src:
                    (out / rel).write_bytes(src.read())


def _tree_from_installed(base: Base, out: Path) -> None:
    """Copy the installed distribution's package files into `out`, each verified against RECORD."""
    if not base.is_wheel:
        raise FetchError(f"{base.artifact} is an sdist; an installed wheel is not byte-identical to it")
    try:
        dist = metadata.distribution(base.distribution)
    except metadata.PackageNotFoundError as exc:
        raise FetchError(f"{base.distribution} is not installed") from exc
    if dist.version != base.version:
        raise FetchError(f"installed {base.distribution} is {dist.version}, base.txt pins {base.version}")
    count = 0
    for entry in dist.files or []:
        rel = entry.as_posix()
        if not _wanted(rel, base.packages):
            continue
        if entry.hash is None:
            raise FetchError(f"installed {base.distribution}: RECORD has no hash for {rel}")
        data = entry.locate().read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.new(entry.hash.mode, data).digest()).rstrip(b"=").decode()
        if digest != entry.hash.value:
            raise FetchError(f"installed {base.distribution} file {rel} differs from its RECORD hash (modified?)")
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
        count += 1
    if not count:
        raise FetchError(f"installed {base.distribution} has no files under {', '.join(base.packages)}")


def materialise(final: Path, build) -> Path:
    """Build a directory in a sibling temp dir and rename it into place (atomic; first writer wins)."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _artifact(base: Base, opts: FetchOptions) -> Path:
    """The verified pinned artifact in the cache, downloading it if needed."""
    cache = cache_root() / "upstream" / f"{canonicalize_name(base.distribution)}-{base.version}"
    cached = cache / base.artifact
    if cached.is_file() and sha256_file(cached) == base.sha256:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        download = _pip_download if base.is_wheel else _index_download
        got = download(base, Path(tmp), opts)
        digest = sha256_file(got)
        if digest != base.sha256:
            raise FetchError(f"{base.artifact}: sha256 {digest} differs from {base.sha256} pinned in {base.path}")
        os.replace(got, cached)
    return cached


def fetch_release(base: Base, opts: FetchOptions = FetchOptions()) -> Release:
    """The pinned release of `base` as an extracted, verified package tree (cached)."""
    if opts.source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {opts.source!r}")
    cache = cache_root() / "upstream" / f"{canonicalize_name(base.distribution)}-{base.version}"
    notes: list[str] = []
    if opts.source in ("index", "auto"):
        try:
            artifact = _artifact(base, opts)
            tree = materialise(cache / f"tree-{base.sha256[:16]}", lambda out: _extract(base, artifact, out))
            return Release(base, tree, f"index ({artifact.name}, sha256 verified)", notes)
        except FetchError as exc:
            if opts.source == "index":
                raise
            notes.append(f"index fetch failed, using the verified installed copy: {exc}")
    tree = materialise(cache / "tree-installed", lambda out: _tree_from_installed(base, out))
    return Release(base, tree, f"installed {base.distribution} {base.version} (RECORD hashes verified)", notes)
