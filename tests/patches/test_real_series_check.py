"""CI gate: every upstream series applies alone and as a whole to its pinned release.

Runs `dsv4flash patches check --upstream megatron-lm` for real: the pinned wheel is fetched with pip from the
package index into ~/.cache/dsv4flash (one 2.4 MB download, then cached); without network it falls back
to the installed megatron-core 0.19.2 after checking every file against its RECORD hashes (byte-identical
to the wheel). `ci/check_patches.sh` runs the strict form (index only, every upstream folder).
"""

from __future__ import annotations

import json

import pytest

from dsv4flash.cli import main

pytestmark = [pytest.mark.patches, pytest.mark.upstream]


@pytest.mark.parametrize(
    "folder, release, first_patch",
    [
        ("megatron-lm", "megatron-core 0.19.2", "DSV41-MCORE-001"),
        ("vllm", "vllm 0.33.0", "DSV41-VLLM-001"),
        ("verl", "verl 0.9.1", "DSV41-VERL-001"),
    ],
)
def test_series_applies_to_the_pinned_release(folder, release, first_patch, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    main(["patches", "check", "--upstream", folder, "--source", "auto", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    out = capsys.readouterr().out
    assert f"{release} from" in out
    ours = [p for p in report["patches"] if p["folder"] == folder]
    assert ours and first_patch in {p["patch_id"] for p in ours}
    assert all(p["alone"] == "clean" and p["in_series"] == "clean" for p in ours), ours
    errors = [p for p in report["problems"] if p["severity"] == "error" and p["where"].startswith(folder)
              and not p["where"].startswith("patches/")]
    assert errors == []


def test_check_names_every_required_change_without_a_patch(tmp_path, capsys):
    """The series knows what it must hold: each [[required]] change of base.txt without a patch fails `check`."""
    from dsv4flash.patchseries.series import load_series
    from tests.patches.test_series_format import ROOT

    series = load_series(ROOT / "patches")
    missing = {r.patch_id for s in series.values() for r in s.base.required if r.patch_id not in s.by_id()}
    report_path = tmp_path / "report.json"
    code = main(["patches", "check", "--upstream", "megatron-lm", "--source", "auto", "--json", str(report_path)])
    required = [p["message"] for p in json.loads(report_path.read_text())["problems"]
                if p["message"].startswith("required change")]
    ours = {m.split()[2] for m in required}
    assert ours == {pid for pid in missing if pid in {r.patch_id for r in series["megatron-lm"].base.required}}
    assert code == (1 if ours else 0)
