"""The recompute benchmark runs every mode side by side and measures activation memory exactly (no timing
asserts: timings belong to the benchmark's own report)."""

from __future__ import annotations

import argparse

import pytest

pytestmark = pytest.mark.upstream


def test_recompute_bench_reports_every_mode_with_exact_memory(tmp_path):
    from dsv4flash.bench import recompute
    from tests._threads import single_thread

    parser = argparse.ArgumentParser()
    recompute.add_arguments(parser)
    args = parser.parse_args(["--batch", "1", "--seq", "48", "--steps", "1", "--plot", str(tmp_path / "r.png")])
    with single_thread():
        report = recompute.run(args)
    peak = {m: report.value(f"activations_peak_{m}") for m in ("none", *recompute.RECOMPUTED)}
    # Memory is counted exactly: every checkpointing mode saves less than none, full uniform least, and the
    # block mode sized for the target keeps more than the one over all but the last layer.
    assert peak["full"] < peak["block"] < peak["block_target"] < peak["none"]
    assert peak["selective"] < peak["none"]
    assert all(report.value(f"step_{m}") > 0 for m in recompute.RECOMPUTED)
    assert (tmp_path / "r.png").stat().st_size > 0
