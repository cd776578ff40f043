"""Pinned-release fetching: sdists from a simple index, verified installed fallback, hash pinning, cache."""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from dsv4flash.patchseries import fetch, series
from tests.patches.fake_upstream import FILES, FakeProject

pytestmark = pytest.mark.patches


def _sdist(dest: Path) -> Path:
    """fakesd-1.0.tar.gz with one top-level folder, like every sdist."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "fakesd-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for rel, text in {**FILES, "setup.py": "raise SystemExit('never built')\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"fakesd-1.0/{rel}")
            info.size, info.mtime = len(data), 0
            tf.addfile(info, io.BytesIO(data))
    return path


def _base(folder: Path, artifact: Path, **extra: str) -> series.Base:
    folder.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256(artifact.read_bytes()).hexdigest()
    (folder / "base.txt").write_text(textwrap.dedent(f"""\
        target = "example/fakesd"
        distribution = "{extra.get('distribution', 'fakesd')}"
        version = "1.0"
        artifact = "{artifact.name}"
        sha256 = "{sha}"
        packages = ["fakeup"]
        """))
    return series.load_base(folder)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4FLASH_CACHE_DIR", str(tmp_path / "cache"))


def test_sdist_comes_from_a_simple_index_without_building(tmp_path):
    artifact = _sdist(tmp_path / "files")
    index = tmp_path / "simple" / "fakesd"
    index.mkdir(parents=True)
    (index / "index.html").write_text(f'<a href="../../files/{artifact.name}#sha256=x">{artifact.name}</a>\n')
    base = _base(tmp_path / "patches" / "fakesd", artifact)
    release = fetch.fetch_release(base, fetch.FetchOptions(index_urls=((tmp_path / "simple").as_uri(),)))
    assert release.files() == sorted(FILES)  # setup.py is outside `packages`
    assert (release.tree / "fakeup/core.py").read_text() == FILES["fakeup/core.py"]
    assert "sha256 verified" in release.origin
    cached = fetch.fetch_release(base, fetch.FetchOptions(no_index=True))  # second time: cache only
    assert cached.tree == release.tree
    bad = replace(base, sha256="0" * 64)
    with pytest.raises(fetch.FetchError, match="differs from 0{64} pinned in"):
        fetch.fetch_release(bad, fetch.FetchOptions(index_urls=((tmp_path / "simple").as_uri(),)))


def test_missing_artifact_is_a_clear_error(tmp_path):
    base = _base(tmp_path / "patches" / "fakesd", _sdist(tmp_path / "files"))
    with pytest.raises(fetch.FetchError, match=r"fakesd-1.0.tar.gz is in none of the find-links folders"):
        fetch.fetch_release(base, fetch.FetchOptions(find_links=(str(tmp_path / "empty"),), no_index=True))


@pytest.fixture
def installed_fake(tmp_path, monkeypatch):
    """fakeup 1.0 "installed" from a temp folder (RECORD hashes from the wheel)."""
    proj = FakeProject(tmp_path / "proj")
    proj.install_dist()
    monkeypatch.syspath_prepend(str(proj.twins))
    yield proj
    for name in [n for n in sys.modules if n.split(".")[0] == "fakeup"]:
        del sys.modules[name]


def test_installed_fallback_is_verified_against_record(installed_fake, tmp_path):
    base = series.load_base(installed_fake.patches_dir / "fakeup")
    release = fetch.fetch_release(base, fetch.FetchOptions(source="auto", no_index=True))
    assert release.origin.startswith("installed fakeup 1.0") and "index fetch failed" in release.notes[0]
    from_index = fetch.fetch_release(base, fetch.FetchOptions(find_links=(str(installed_fake.artifacts),),
                                                              no_index=True))
    for rel in from_index.files():
        assert (release.tree / rel).read_bytes() == (from_index.tree / rel).read_bytes()
    # A locally modified install must be refused, not silently used as "the release".
    (installed_fake.twins / "fakeup" / "core.py").write_text("def answer():\n    return 0\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV4FLASH_CACHE_DIR", str(tmp_path / "other-cache"))
        with pytest.raises(fetch.FetchError, match="file fakeup/core.py differs from its RECORD hash"):
            fetch.fetch_release(base, fetch.FetchOptions(source="installed"))


def test_installed_fallback_refuses_an_sdist_base(tmp_path):
    base = _base(tmp_path / "patches" / "fakesd", _sdist(tmp_path / "files"))
    with pytest.raises(fetch.FetchError, match="is an sdist; an installed wheel is not byte-identical"):
        fetch.fetch_release(base, fetch.FetchOptions(source="installed"))
