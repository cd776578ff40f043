"""The recompute benchmark runs every mode side by side and measures activation memory exactly (no timing
asserts: timings belong to the benchmark's own report). It runs as its own process, as a user runs it:
on a CPU machine the benchmark installs the CUDA redirect and a process group of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.upstream


def test_recompute_bench_reports_every_mode_with_exact_memory(tmp_path):
    from dsv4flash.bench import recompute

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "dsv4flash.bench", "recompute", "--batch", "1", "--seq", "48",
                           "--steps", "1", "--json", str(out), "--plot", str(png)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    peak = {m: figures[f"activations_peak_{m}"] for m in ("none", *recompute.RECOMPUTED)}
    # Memory is counted exactly: every checkpointing mode saves less than none, full uniform least, and the
    # block mode sized for the target keeps more than the one over all but the last layer.
    assert peak["full"] < peak["block"] < peak["block_target"] < peak["none"]
    assert peak["selective"] < peak["none"]
    assert all(figures[f"step_{m}"] > 0 for m in recompute.RECOMPUTED)
    assert sum(line.startswith(("MET", "MISS")) for line in done.stdout.splitlines()) == len(recompute.RECOMPUTED)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
