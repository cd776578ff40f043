"""`dsv4flash patches list|check|apply|status|index` on a fake upstream (offline) and on the real series."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv4flash.patching import twins
from dsv4flash.cli import main
from dsv4flash.patchseries import index
from dsv4flash.patchseries.series import SeriesError, load_series
from tests.patches.fake_upstream import FakeProject, run_git, trailers

pytestmark = pytest.mark.patches

ANSWER_FIX = {"fakeup/core.py": ("return 41", "return 42")}


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One download cache for the module: the fake wheel is byte-identical in every test."""
    return tmp_path_factory.mktemp("dsv4flash-cache")


@pytest.fixture
def fake(tmp_path, monkeypatch, shared_cache):
    """A fake project with its twin package importable and a private twin registry."""
    proj = FakeProject(tmp_path)
    monkeypatch.syspath_prepend(str(proj.twins))
    monkeypatch.setattr(twins, "REGISTRY", twins.Registry())
    monkeypatch.setenv("DSV4FLASH_CACHE_DIR", str(shared_cache))
    yield proj
    for name in [n for n in sys.modules if n.split(".")[0] in ("fake_integrations", "fakeup")]:
        del sys.modules[name]


def _good_series(fake: FakeProject) -> None:
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    fake.add_twin("FAKE-001")
    assert main(fake.cli("index")) == 0


def test_check_accepts_a_good_series(fake, capsys):
    _good_series(fake)
    report = fake.root / "report.json"
    assert main(fake.cli("check", *fake.offline(), "--json", str(report))) == 0
    out = capsys.readouterr().out
    assert "alone clean" in out and "whole series: 1/1 applied" in out and "OK: 1 patch(es)" in out
    data = json.loads(report.read_text())
    assert data["ok"] and data["patches"] == [
        {"folder": "fakeup", "patch_id": "FAKE-001", "file": "0001-fix-core-answer-42.patch",
         "alone": "clean", "in_series": "clean"}]


def test_check_rejects_a_patch_that_does_not_apply(fake, capsys):
    _good_series(fake)
    patch = fake.patches_dir / "fakeup" / "0001-fix-core-answer-42.patch"
    patch.write_text(patch.read_text().replace("-    return 41", "-    return 40"))  # context no longer matches
    assert main(fake.cli("check", *fake.offline())) == 1
    out = capsys.readouterr().out
    assert "fakeup/0001-fix-core-answer-42.patch: it does not apply alone to fakeup 1.0" in out
    assert "patch failed: fakeup/core.py" in out
    assert "does not apply in the series after 0 patch(es)" in out


def test_check_fails_on_missing_trailer(fake, capsys):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001", **{"Remove-When": None}))
    fake.add_twin("FAKE-001")
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    assert "missing required trailer(s): Remove-When" in capsys.readouterr().out


def test_check_fails_without_runtime_twin_or_tests(fake, capsys):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001", Tests="tests/nope.py"))
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    out = capsys.readouterr().out
    assert "Tests file tests/nope.py does not exist" in out
    assert "Runtime-Equivalent fake_integrations.fakeup.patches.fake_001 cannot be imported" in out


def test_check_fails_when_twin_and_trailers_disagree(fake, capsys):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    fake.add_twin("FAKE-001", remove_when="fakeup>=3.0")
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    assert "Remove-When differs between the patch ('fakeup>=2.0') and the twin" in capsys.readouterr().out


def test_check_fails_on_conflict_markers_and_syntax_errors(fake, capsys):
    fake.add_patch("fix(core): answer 42", {"fakeup/core.py": ("    return 41\n", "<<<<<<< ours\n    return 42\n")},
                   trailers("FAKE-001"))
    fake.add_twin("FAKE-001")
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    out = capsys.readouterr().out
    assert "conflict marker left at fakeup/core.py:6" in out
    assert "does not byte-compile: fakeup/core.py:6" in out


def test_check_applies_each_patch_with_its_dependencies(fake, capsys):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    fake.add_patch("fix(core): answer 43", {"fakeup/core.py": ("return 42", "return 43")},
                   trailers("FAKE-002", **{"Depends-On": "FAKE-001"}))
    fake.add_twin("FAKE-001")
    fake.add_twin("FAKE-002", depends_on=("FAKE-001",))
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 0
    assert "0002-fix-core-answer-43.patch: alone clean" in capsys.readouterr().out


def test_check_catches_an_undeclared_dependency(fake, capsys):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    fake.add_patch("fix(core): answer 43", {"fakeup/core.py": ("return 42", "return 43")}, trailers("FAKE-002"))
    fake.add_twin("FAKE-001")
    fake.add_twin("FAKE-002")
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    out = capsys.readouterr().out
    assert "0002-fix-core-answer-43.patch: it does not apply alone to fakeup 1.0" in out
    assert "whole series: 2/2 applied" in out  # in order it is fine; alone it is not


def test_check_verifies_the_pinned_sha256(fake, capsys):
    _good_series(fake)
    base = fake.patches_dir / "fakeup" / "base.txt"
    text = base.read_text()
    sha = text.split('sha256 = "')[1][:64]
    base.write_text(text.replace(sha, "f" * 64))
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    assert f"differs from {'f' * 64} pinned in" in capsys.readouterr().out


def test_check_flags_a_stale_generated_index(fake, capsys):
    _good_series(fake)
    (fake.patches_dir / "README.md").write_text("hand-edited\n")
    assert main(fake.cli("index", "--check")) == 1
    assert main(fake.cli("check", *fake.offline())) == 1
    assert "generated file is stale; run `dsv4flash patches index`" in capsys.readouterr().out


def test_index_generates_the_tables_of_docs_patches_md(fake, capsys):
    """docs/patches.md's block between the markers is generated; prose around it is kept; stale is an error."""
    page = fake.project / "docs" / "patches.md"
    page.parent.mkdir()
    page.write_text(f"# Series\n\nprose before\n\n{index.DOCS_BEGIN}\nold table\n{index.DOCS_END}\n\nprose after\n")
    _good_series(fake)
    text = page.read_text()
    assert text.startswith("# Series\n\nprose before\n\n") and text.endswith("\n\nprose after\n")
    assert "old table" not in text and "### fakeup (fakeup 1.0)" in text
    assert ("| `FAKE-001` | [0001](../patches/fakeup/0001-fix-core-answer-42.patch) | fix(core): answer 42 "
            "| Pending | none | `tests/test_fake_001.py` |") in text
    assert main(fake.cli("index", "--check")) == 0
    page.write_text(text.replace("fix(core): answer 42 |", "hand-edited |"))
    assert main(fake.cli("index", "--check")) == 1
    assert f"stale: {page}" in capsys.readouterr().out
    assert main(fake.cli("check", *fake.offline())) == 1
    assert main(fake.cli("index")) == 0 and page.read_text() == text
    page.write_text("# Series\n\nno markers\n")
    assert main(fake.cli("index")) == 1
    assert "docs/patches.md: expected one `<!-- BEGIN generated" in capsys.readouterr().err


def _require(fake: FakeProject, *ids: str) -> None:
    """Declare `ids` as the changes the fakeup series must hold ([[required]] in base.txt)."""
    base = fake.patches_dir / "fakeup" / "base.txt"
    base.write_text(base.read_text() + "".join(
        f'\n[[required]]\nid = "{pid}"\nconcern = "concern of {pid}"\n' for pid in ids))


def test_check_fails_while_a_required_change_has_no_patch(fake, capsys):
    _require(fake, "FAKE-001", "FAKE-002")
    _good_series(fake)
    assert main(fake.cli("check", *fake.offline())) == 1
    out = capsys.readouterr().out
    assert "required change FAKE-002 (concern of FAKE-002) has no patch" in out
    assert "FAKE-001 (concern of FAKE-001)" not in out
    readme = (fake.patches_dir / "README.md").read_text()
    assert "| `fakeup/` | `FAKE-002` | concern of FAKE-002 | **missing** |" in readme
    assert 'missing = ["FAKE-002"]' in (fake.patches_dir / "series.toml").read_text()
    fake.add_patch("fix(core): answer 43", {"fakeup/core.py": ("return 42", "return 43")},
                   trailers("FAKE-002", **{"Depends-On": "FAKE-001"}))
    fake.add_twin("FAKE-002", depends_on=("FAKE-001",))
    assert main(fake.cli("index")) == 0
    assert main(fake.cli("check", *fake.offline())) == 0
    assert 'missing = []' in (fake.patches_dir / "series.toml").read_text()


def test_required_entries_are_validated(fake):
    base = fake.patches_dir / "fakeup" / "base.txt"
    base.write_text(base.read_text() + '\n[[required]]\nid = "FAKE-001"\n')
    with pytest.raises(SeriesError, match=r"base.txt: \[\[required\]\] entry 1 needs a non-empty id and concern"):
        load_series(fake.patches_dir)


@pytest.mark.parametrize("line", [
    "from dsv4flash.model import sparse_attention",
    "import dsv4flash",
    "    import dsv4flash.integrations.mcore as mc",
    "mod = importlib.import_module('dsv4flash.model')",
])
def test_check_fails_on_a_patch_importing_dsv4flash(fake, capsys, line):
    fake.add_patch("fix(core): answer 42", {"fakeup/core.py": ("    return 41\n", f"    {line.strip()}\n    return 42\n")},
                   trailers("FAKE-001"))
    fake.add_twin("FAKE-001")
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    assert "adds an import of dsv4flash at fakeup/core.py:6; an upstream patch must not depend on dsv4flash" in (
        capsys.readouterr().out)


@pytest.mark.parametrize("path, data, kind", [
    ("fakeup/__pycache__/core.cpython-311.pyc", b"\xa7\r\r\n\x00\x00\x00\x00", "compiled Python file"),
    ("fakeup/core.pyc", b"\xa7\r\r\n\x00\x00\x00\x00", "compiled Python file"),
    ("fakeup/__pycache__/notes.txt", b"text, but under __pycache__\n", "compiled Python file"),
    ("fakeup/table.bin", bytes(range(256)), "binary file"),
], ids=["pycache", "pyc", "pycache-text", "binary"])
def test_check_rejects_compiled_and_binary_files(fake, capsys, path, data, kind):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"), new_files={path: data})
    fake.add_twin("FAKE-001")
    main(fake.cli("index"))
    assert main(fake.cli("check", *fake.offline())) == 1
    out = capsys.readouterr().out
    assert f"fakeup/0001-fix-core-answer-42.patch: adds or modifies {kind} {path}; an upstream patch " \
           "carries source only" in out, out


def test_base_checkout_keeps_bytecode_out_of_commits(fake, tmp_path):
    """Running a `patches base` tree writes __pycache__/; `git add -A` there must not stage it."""
    _good_series(fake)
    checkout = tmp_path / "checkout"
    assert main(fake.cli("base", "fakeup", str(checkout), *fake.offline())) == 0
    assert main(fake.cli("apply", str(checkout), "--target", "fakeup")) == 0
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", "import fakeup.core; assert fakeup.core.answer() == 42"],
                   env=env, check=True, cwd=tmp_path)
    assert list((checkout / "fakeup" / "__pycache__").glob("core.*.pyc"))
    (checkout / "fakeup" / "core.py").write_text((checkout / "fakeup" / "core.py").read_text() + "\n# edit\n")
    run_git(checkout, "add", "-A")
    assert run_git(checkout, "diff", "--cached", "--name-only").split() == ["fakeup/core.py"]


def test_check_fails_when_no_test_covers_both_forms(fake, capsys):
    _good_series(fake)
    (fake.project / "tests" / "test_fake_001.py").write_text("def test_plain():\n    assert True\n")
    assert main(fake.cli("check", *fake.offline())) == 1
    assert 'no Tests file declares PATCH_ID = "FAKE-001" with patch_form tests' in capsys.readouterr().out


@pytest.fixture
def runnable(fake, monkeypatch):
    """The fake project with fakeup "installed" and the twins importable by the pytest that --run-tests starts."""
    fake.install_dist()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake.twins), os.environ.get("PYTHONPATH")])))
    return fake


def test_run_tests_passes_when_both_forms_agree(runnable, capsys):
    _good_series(runnable)
    assert main(runnable.cli("check", *runnable.offline(), "--run-tests")) == 0
    assert "OK: 1 patch(es)" in capsys.readouterr().out


@pytest.mark.parametrize("twin_answer, message", [
    (43, "test tests/test_fake_001.py::test_answer_is_fixed[series] failed: runtime twin and patched upstream "
         "disagree"),
    (41, "test tests/test_fake_001.py::test_answer_is_fixed[runtime] failed: AssertionError: the unpatched answer"),
])
def test_run_tests_fails_when_a_form_fails(runnable, capsys, twin_answer, message):
    runnable.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    runnable.add_twin("FAKE-001", returns=twin_answer)
    main(runnable.cli("index"))
    assert main(runnable.cli("check", *runnable.offline(), "--run-tests")) == 1
    out = capsys.readouterr().out
    assert f"fakeup/0001-fix-core-answer-42.patch: {message}" in out, out


def test_run_tests_fails_when_the_patched_copy_breaks_the_test(runnable, capsys):
    runnable.add_patch("fix(core): answer 42", {"fakeup/core.py": ("return 41", "return 41 + 0")},
                       trailers("FAKE-001"))  # the format-patch does not fix anything; the twin does
    runnable.add_twin("FAKE-001")
    main(runnable.cli("index"))
    assert main(runnable.cli("check", *runnable.offline(), "--run-tests")) == 1
    out = capsys.readouterr().out
    assert "test_answer_is_fixed[series] failed: series form (patched upstream copy) failed" in out
    assert "no test passed in the series form (all failed or skipped)" in out


def test_list_covers_both_forms(fake, capsys):
    _good_series(fake)
    fake.add_twin("FAKE-009")  # a twin whose format-patch is missing
    capsys.readouterr()
    assert main(fake.cli("list", "--json")) == 0
    rows = {r["patch_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["FAKE-001"]["forms"] == "both"
    assert rows["FAKE-001"]["runtime_twin"] == "fake_integrations.fakeup.patches.fake_001"
    assert rows["FAKE-001"]["subject"] == "fix(core): answer 42"
    assert rows["FAKE-009"]["forms"] == "runtime twin only"
    assert main(fake.cli("list")) == 0
    table = capsys.readouterr().out
    for text in ("FAKE-001", "fix(core): answer 42", "Pending", "fakeup>=2.0", "tests/test_fake_001.py", "both"):
        assert text in table


def test_status_flags_obsolete_patches(fake, capsys):
    _good_series(fake)
    capsys.readouterr()
    assert main(fake.cli("status", "--json")) == 0  # fakeup not installed: undecidable, not obsolete
    assert json.loads(capsys.readouterr().out)[0]["obsolete"] is None
    assert main(fake.cli("status", "--installed", "fakeup=1.5", "--json")) == 0
    assert json.loads(capsys.readouterr().out)[0]["obsolete"] is False
    assert main(fake.cli("status", "--installed", "fakeup=2.0")) == 1
    assert "OBSOLETE: remove both forms" in capsys.readouterr().out


def test_apply_to_plain_directory_and_to_checkout(fake, tmp_path, capsys):
    _good_series(fake)
    plain = tmp_path / "site"
    (plain / "fakeup").mkdir(parents=True)
    from tests.patches.fake_upstream import FILES

    for rel, text in FILES.items():
        (plain / rel).write_text(text)
    assert main(fake.cli("apply", str(plain), "--target", "fakeup")) == 0
    assert "return 42" in (plain / "fakeup/core.py").read_text()
    checkout = tmp_path / "checkout"
    assert main(fake.cli("base", "fakeup", str(checkout), *fake.offline())) == 0
    assert main(fake.cli("apply", str(checkout), "--target", "fakeup")) == 0
    assert run_git(checkout, "log", "-1", "--format=%(trailers:key=Patch-Id,valueonly)").strip() == "FAKE-001"
    assert "return 42" in (checkout / "fakeup/core.py").read_text()
    capsys.readouterr()
    assert main(fake.cli("apply", str(checkout), "--target", "fakeup")) == 0  # idempotent
    assert main(fake.cli("apply", str(plain), "--target", "fakeup")) == 0
    assert capsys.readouterr().out.count("0001-fix-core-answer-42.patch: already applied, skipped") == 2
    assert run_git(checkout, "rev-list", "--count", "HEAD").strip() == "2"  # base + one patch, no duplicate
    (plain / "fakeup/core.py").write_text("def answer():\n    return 0\n")
    assert main(fake.cli("apply", str(plain), "--target", "fakeup")) == 1
    assert "0001-fix-core-answer-42.patch does not apply to" in capsys.readouterr().err


def test_real_series_index_is_fresh():
    assert main(["patches", "index", "--check"]) == 0, "run `dsv4flash patches index` and commit the result"


def test_real_status_flags_mcore_patch_obsolete_on_a_fixed_release(capsys):
    assert main(["patches", "status", "--installed", "megatron-core=0.20.0", "--json"]) == 1
    rows = {r["patch_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["DSV41-MCORE-001"]["obsolete"] is True
    assert main(["patches", "status", "--json"]) == 0
    assert {r["patch_id"]: r for r in json.loads(capsys.readouterr().out)}["DSV41-MCORE-001"]["obsolete"] is False
