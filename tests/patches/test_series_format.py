"""Patch files, trailers, base.txt and Remove-When: parsing and the metadata rules `check` enforces."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dsv4flash.patching import predicate
from dsv4flash.patchseries import series
from tests.patches.fake_upstream import FakeProject, trailers

pytestmark = pytest.mark.patches

ROOT = Path(__file__).resolve().parents[2]
MCORE_PATCH = next((ROOT / "patches" / "megatron-lm").glob("0001-*.patch"))
ANSWER_FIX = {"fakeup/core.py": ("return 41", "return 42")}


def test_remove_when_predicates():
    pred = predicate.parse("megatron-core>=0.20.0 or vllm>=0.34,<0.40 and verl>=1.0")
    assert pred.distributions == ("megatron-core", "vllm", "verl")
    assert pred.evaluate({"megatron-core": "0.20.0rc1", "vllm": "0.1", "verl": "0.1"}) is False
    assert pred.evaluate({"megatron-core": "0.20.0", "vllm": None, "verl": None}) is True
    assert pred.evaluate({"megatron-core": "0.19.2", "vllm": "0.35", "verl": "1.2"}) is True
    assert pred.evaluate({"megatron-core": "0.19.2", "vllm": "0.35", "verl": None}) is None  # undecidable
    assert predicate.parse("megatron-core>=0.20.0rc0").evaluate({"megatron-core": "0.20.0rc1"}) is True
    for bad in ("", "when upstream merges it", "megatron-core", "megatron-core[x]>=1", "vllm>=1; python_version>'3'"):
        with pytest.raises(predicate.PredicateError):
            predicate.parse(bad)


def test_real_patch_parses_like_git_does(tmp_path):
    patch = series.parse_patch(MCORE_PATCH)
    assert patch.parse_problems == []
    assert patch.subject == "fix(moe): drop padded token rows from expert-bias token counts"  # folded header
    assert patch.files == ("megatron/core/transformer/moe/router.py",)
    info = subprocess.run(["git", "mailinfo", str(tmp_path / "msg"), str(tmp_path / "diff")],
                          input=MCORE_PATCH.read_text(), capture_output=True, text=True, check=True).stdout
    assert "Subject: fix(moe): drop padded token rows from expert-bias token counts" in info
    parsed = subprocess.run(["git", "interpret-trailers", "--parse", str(tmp_path / "msg")],
                            capture_output=True, text=True, check=True).stdout
    git_trailers = [tuple(line.split(": ", 1)) for line in parsed.splitlines()]
    assert [(k, v) for k, values in patch.trailers.items() for v in values] == git_trailers
    assert set(series.REQUIRED_TRAILERS) <= set(patch.trailers)


def test_base_txt_errors_name_the_file_and_key(tmp_path):
    folder = tmp_path / "x"
    folder.mkdir()
    with pytest.raises(series.SeriesError, match=r"x/base.txt: missing"):
        series.load_base(folder)
    (folder / "base.txt").write_text('target = "a"\ndistribution = "b"\nversion = "1"\n')
    with pytest.raises(series.SeriesError, match="missing key.*artifact, sha256, packages"):
        series.load_base(folder)
    (folder / "base.txt").write_text('target = "a"\ndistribution = "b"\nversion = "1"\nartifact = "b.whl"\n'
                                     'sha256 = "abc"\npackages = ["b"]\n')
    with pytest.raises(series.SeriesError, match="sha256 must be 64 lowercase hex digits"):
        series.load_base(folder)


@pytest.fixture
def fake(tmp_path):
    return FakeProject(tmp_path)


def _problems(fake: FakeProject) -> list[str]:
    found = series.validate(series.load_series(fake.patches_dir), fake.project, required_folders=())
    return [p.message for p in found]


@pytest.mark.parametrize("override, message", [
    ({"Upstream-Status": "Maybe later"}, "Upstream-Status 'Maybe later' is not one of"),
    ({"Upstream-Status": "Submitted"}, "Upstream-Status Submitted needs a [where/why] note"),
    ({"Forwarded": "yes"}, "Forwarded 'yes' must be no, not-needed or a URL"),
    ({"Last-Update": "29/11/2026"}, "Last-Update '29/11/2026' must be YYYY-MM-DD"),
    ({"Patch-Id": "fake one"}, "Patch-Id 'fake one' must look like DSV41-MCORE-001"),
    ({"Target": "someone/else"}, "Target 'someone/else' differs from base.txt target 'example/fakeup'"),
    ({"Base": "fakeup 0.9"}, "Base 'fakeup 0.9' must start with 'fakeup 1.0'"),
    ({"Remove-When": "once merged"}, "is not a version condition"),
    ({"Depends-On": "FAKE-777"}, "Depends-On FAKE-777 is not an earlier patch of fakeup"),
    ({"Touches": "fakeup.other.thing"}, "Touches fakeup.other.thing is not in any file the diff changes"),
    ({"Tests": "none"}, "Tests names no test file"),
    ({"Gate": None, "Tests": None}, "missing required trailer(s): Gate, Tests"),
])
def test_metadata_rules(fake, override, message):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001", **override))
    assert any(message in p for p in _problems(fake)), _problems(fake)


def test_clean_metadata_and_duplicate_ids(fake):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    assert _problems(fake) == []
    fake.add_patch("fix(core): answer 43", {"fakeup/core.py": ("return 42", "return 43")}, trailers("FAKE-001"))
    assert any("Patch-Id FAKE-001 also used by fakeup/0001" in p for p in _problems(fake))


def test_message_without_trailer_block(fake):
    path = fake.add_patch("fix(core): answer 42", ANSWER_FIX, {"Patch-Id": "FAKE-001"})
    path.write_text(path.read_text().replace("\nPatch-Id: FAKE-001\n", "\nThis line is prose, not a trailer.\n"))
    problems = _problems(fake)
    assert any("last paragraph of the message is not a trailer block" in p for p in problems)
    assert any("missing required trailer(s): Patch-Id" in p for p in problems)


def _second_upstream(fake: FakeProject) -> None:
    """patches/otherup: a copy of the fakeup folder whose one patch is OTHER-001 (another upstream's series)."""
    src, dst = fake.patches_dir / "fakeup", fake.patches_dir / "otherup"
    dst.mkdir()
    (dst / "base.txt").write_text((src / "base.txt").read_text())
    patch = next(src.glob("0001-*.patch"))
    (dst / patch.name).write_text(patch.read_text().replace("Patch-Id: FAKE-001", "Patch-Id: OTHER-001"))


@pytest.mark.parametrize("dependency, message", [
    ("otherup/OTHER-001", None),
    ("fakeup/FAKE-001", None),  # this folder, spelled with its name
    ("otherup/OTHER-999", "Depends-On otherup/OTHER-999: patches/otherup has no patch OTHER-999"),
    ("nowhere/OTHER-001", "Depends-On nowhere/OTHER-001: no upstream folder patches/nowhere (expected "
                          "<folder>/<Patch-Id> with folder one of: otherup)"),
    ("OTHER-001", "Depends-On OTHER-001 is not an earlier patch of fakeup"),  # another folder needs its name
])
def test_depends_on_another_upstreams_patch(fake, dependency, message):
    fake.add_patch("fix(core): answer 42", ANSWER_FIX, trailers("FAKE-001"))
    _second_upstream(fake)
    fake.add_patch("fix(core): answer 43", {"fakeup/core.py": ("return 42", "return 43")},
                   trailers("FAKE-002", **{"Depends-On": dependency}))
    # (otherup's copied patch names no Tests file of its own Patch-Id: that finding is not about Depends-On)
    assert [p for p in _problems(fake) if "Depends-On" in p] == ([message] if message else [])
    loaded = series.load_series(fake.patches_dir)
    patch = loaded["fakeup"].by_id()["FAKE-002"]
    local = dependency.rpartition("/")[0] in ("", "fakeup")
    assert patch.upstream_depends_on == (() if local else (tuple(dependency.split("/")),))
    # Only this folder's dependencies are applied before it; another upstream's tree is put next to it instead.
    expected = ["FAKE-001", "FAKE-002"] if local and dependency.endswith("FAKE-001") else ["FAKE-002"]
    assert [p.patch_id for p in loaded["fakeup"].closure(patch)] == expected
