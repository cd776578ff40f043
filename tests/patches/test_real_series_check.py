"""CI gate: the megatron-lm series applies alone and as a whole to the pinned megatron-core release.

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


def test_megatron_lm_series_on_the_pinned_release(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    main(["patches", "check", "--upstream", "megatron-lm", "--source", "auto", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    out = capsys.readouterr().out
    assert "megatron-core 0.19.2 from" in out
    ours = [p for p in report["patches"] if p["folder"] == "megatron-lm"]
    assert ours and {p["patch_id"] for p in ours} >= {"DSV41-MCORE-001"}
    assert all(p["alone"] == "clean" and p["in_series"] == "clean" for p in ours), ours
    errors = [p for p in report["problems"] if p["severity"] == "error" and p["where"].startswith("megatron-lm")]
    assert errors == []
