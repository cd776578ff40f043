"""A tiny fake upstream (`fakeup` 1.0) with a patch series and runtime twins, for offline CLI/check tests.

`FakeProject` writes, under one temporary folder: a pinned wheel in `artifacts/` (deterministic bytes, so
base.txt can pin its sha256), `project/patches/fakeup/` with base.txt and format-patches made by real git,
`project/tests/...` files the Tests trailers name, and an importable `fake_integrations` package whose
`fakeup/patches/*.py` modules register runtime twins.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import textwrap
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from dsv4flash.patchseries import gitops

CORE_PY = '''\
"""fakeup core module."""


def answer():
    """The answer."""
    return 41


def greeting(name):
    """Say hello."""
    return "hello " + name
'''
INIT_PY = '"""fakeup: a fake upstream package for dsv4flash tests."""\n'
FILES = {"fakeup/__init__.py": INIT_PY, "fakeup/core.py": CORE_PY}


def build_wheel(dest: Path) -> Path:
    """fakeup-1.0-py3-none-any.whl with fixed timestamps (stable sha256)."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "fakeup-1.0-py3-none-any.whl"
    files = dict(FILES)
    files["fakeup-1.0.dist-info/METADATA"] = "Metadata-Version: 2.1\nName: fakeup\nVersion: 1.0\n"
    files["fakeup-1.0.dist-info/WHEEL"] = "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("fakeup-1.0.dist-info/RECORD,,")
    files["fakeup-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return path


CONFTEST_PY = 'pytest_plugins = ["dsv4flash.patchseries.testing"]\n'
BOTH_FORMS_TEST = '''\
"""Both forms of {patch_id}: the runtime twin on the installed fakeup, and the patched fakeup copy."""

PATCH_ID = "{patch_id}"


def test_answer_is_fixed(patch_form):
    import fakeup.core

    assert fakeup.core.answer() != 41, "the unpatched answer"
    patch_form.record("answer", fakeup.core.answer())
'''


def test_file(patch_id: str) -> str:
    """The default Tests file of a fake patch (written by `FakeProject.add_patch`)."""
    return f"tests/test_{patch_id.lower().replace('-', '_')}.py"


def trailers(patch_id: str, **overrides: str | None) -> dict[str, str]:
    """A complete, valid trailer set for a fakeup patch; None in overrides drops a key."""
    module = f"fake_integrations.fakeup.patches.{patch_id.lower().replace('-', '_')}"
    base = {
        "Patch-Id": patch_id,
        "Target": "example/fakeup",
        "Base": "fakeup 1.0 (wheel)",
        "Touches": "fakeup.core.answer",
        "Upstream-Status": "Pending",
        "Forwarded": "no",
        "Runtime-Equivalent": module,
        "Gate": f"FAKEUP_{patch_id.replace('-', '_')}",
        "Depends-On": "none",
        "Remove-When": "fakeup>=2.0",
        "Tests": test_file(patch_id),
        "Last-Update": "2026-11-29",
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


@dataclass
class FakeProject:
    """Builder for a fake dsv4flash checkout around the fakeup upstream."""

    root: Path
    artifacts: Path = field(init=False)
    project: Path = field(init=False)
    patches_dir: Path = field(init=False)
    twins: Path = field(init=False)
    _repo: Path = field(init=False)
    _count: int = 0

    def __post_init__(self) -> None:
        self.artifacts = self.root / "artifacts"
        wheel = build_wheel(self.artifacts)
        self.project = self.root / "project"
        self.patches_dir = self.project / "patches"
        folder = self.patches_dir / "fakeup"
        folder.mkdir(parents=True)
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        (folder / "base.txt").write_text(textwrap.dedent(f"""\
            target = "example/fakeup"
            distribution = "fakeup"
            version = "1.0"
            artifact = "{wheel.name}"
            sha256 = "{sha}"
            packages = ["fakeup"]
            """))
        (self.project / "tests").mkdir()
        (self.project / "tests" / "conftest.py").write_text(CONFTEST_PY)
        (self.project / "pytest.ini").write_text("[pytest]\n")  # rootdir = the project, as in dsv4flash
        self.twins = self.root / "twins"
        pkg = self.twins / "fake_integrations" / "fakeup" / "patches"
        pkg.mkdir(parents=True)
        for d in (pkg.parent.parent, pkg.parent, pkg):
            (d / "__init__.py").write_text('"""fake twin package."""\n')
        self._repo = self.root / "gitwork"
        sources = {}
        for rel, text in FILES.items():
            (self.root / "src" / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.root / "src" / rel).write_text(text)
            sources[rel] = self.root / "src" / rel
        gitops.init_repo(self._repo, sources, "fakeup 1.0")

    def add_patch(self, subject: str, edit: dict[str, tuple[str, str]], tr: dict[str, str],
                  body: str = "Why: because.\n\nHow: like this.", new_files: dict[str, bytes] | None = None) -> Path:
        """Commit `edit` (path -> (old, new) text) and `new_files` on top of the previous patches; format-patch it.

        `new_files` are force-added, past the scratch repository's bytecode excludes.
        """
        for rel, (old, new) in edit.items():
            path = self._repo / rel
            text = path.read_text()
            assert old in text, f"{old!r} not in {rel}"
            path.write_text(text.replace(old, new, 1))
        for rel, data in (new_files or {}).items():
            (self._repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (self._repo / rel).write_bytes(data)
            gitops.git(self._repo, "add", "-f", rel)
        if tr.get("Tests") == test_file(tr.get("Patch-Id", "")):
            (self.project / tr["Tests"]).write_text(BOTH_FORMS_TEST.format(patch_id=tr["Patch-Id"]))
        message = f"{subject}\n\n{body}\n\n" + "\n".join(f"{k}: {v}" for k, v in tr.items()) + "\n"
        gitops.git(self._repo, "commit", "-q", "-a", "-m", message)
        self._count += 1
        out = gitops.git(self._repo, "format-patch", "-1", "--zero-commit", "--no-signature", "-N",
                         f"--start-number={self._count}", "-o", str(self.patches_dir / "fakeup")).stdout
        return Path(out.strip())

    def add_twin(self, patch_id: str, returns: int = 42, probe: str | None = None, docstring: bool = True,
                 stem: str | None = None, **meta: object) -> str:
        """Write a runtime twin module making fakeup.core.answer return `returns`; returns its module name.

        `probe` is Python source for the `upstream_has_it` callable (e.g. "lambda: True").
        """
        tr = trailers(patch_id)
        fields = dict(
            patch_id=patch_id, target=tr["Target"], distribution="fakeup", versions=">=1.0,<2.0",
            touches=(tr["Touches"],), upstream_status=tr["Upstream-Status"], forwarded=tr["Forwarded"],
            remove_when=tr["Remove-When"], gate=tr["Gate"], tests=(tr["Tests"],),
        )
        fields.update(meta)
        args = ",\n    ".join(f"{k}={v!r}" for k, v in fields.items())
        if probe is not None:
            args += f",\n    upstream_has_it={probe}"
        stem = stem or patch_id.lower().replace("-", "_")
        module = self.twins / "fake_integrations" / "fakeup" / "patches" / f"{stem}.py"
        doc = "Why: the fake upstream answers wrongly.\n\nHow: replace fakeup.core.answer." if docstring else "No headings."
        module.write_text(textwrap.dedent('''\
            """Fake runtime twin.

            {doc}
            """
            from dsv4flash.patching.twins import runtime_patch


            @runtime_patch(
                {args},
            )
            def install(patcher):
                import fakeup.core

                patcher.replace(fakeup.core, "answer", lambda: {returns})
            ''').format(args=args, returns=returns, doc=doc))
        return f"fake_integrations.fakeup.patches.{module.stem}"

    def install_dist(self, version: str = "1.0") -> None:
        """Make `fakeup` importable and "installed" (dist-info with RECORD hashes) from the twins folder."""
        with zipfile.ZipFile(self.artifacts / "fakeup-1.0-py3-none-any.whl") as zf:
            zf.extractall(self.twins)
        if version != "1.0":
            info = self.twins / "fakeup-1.0.dist-info"
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakeup\nVersion: {version}\n")
            info.rename(self.twins / f"fakeup-{version}.dist-info")

    def cli(self, *args: str) -> list[str]:
        """Arguments for `dsv4flash.cli.main` pointed at this project and its twin package."""
        return ["patches", "--patches-dir", str(self.patches_dir), "--twin-package", "fake_integrations", *args]

    def offline(self) -> list[str]:
        """Fetch options that use only the local artifacts folder."""
        return ["--find-links", str(self.artifacts), "--no-index"]


def run_git(cwd: Path, *args: str) -> str:
    """Plain git in a user-facing checkout (used to inspect `apply` results)."""
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout
