"""`python -m dsv4flash.bench verl_step` at its smallest size, as a user runs it: the veRL side read from the
suite's shared real veRL GRPO run (`verl_text_run`: 2 steps, 2 prompts × 8 samples; `--verl-log`, so the suite
pays for one veRL run, not two), the embedded engine's GRPO run by the bench on the same base and work. Checks the table's structure (every phase from veRL's own timing metrics, the ratio against the embedded step, no MET/MISS line since no
target exists) and the plot, never the timings themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.upstream, pytest.mark.whole_machine]

PHASES = ("rollout", "weight_sync", "replay", "update", "publish", "save_checkpoint", "other")


def test_verl_step_bench_reports_every_phase_next_to_the_embedded_step(tmp_path, verl_text_run):
    base, run_dir, _ = verl_text_run
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "dsv4flash.bench", "verl_step", "--steps", "2", "--prompts", "2",
                           "--group-size", "8", "--verl-log", str(run_dir.parent / f"run_{run_dir.name}.log"),
                           "--base", str(base), "--workdir", str(tmp_path / "work"), "--json", str(out),
                           "--plot", str(png)], capture_output=True, text=True, env=env, timeout=1500)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    figures = json.loads(out.read_text())
    assert figures["embedded_step"] > 0 and figures["verl_step"] > 0
    assert figures["verl_step/embedded_step"] == pytest.approx(figures["verl_step"] / figures["embedded_step"])
    for phase in PHASES:
        assert f"verl_{phase}" in figures and f"verl_{phase}/verl_step" in figures, phase
    for phase in ("rollout", "weight_sync", "replay", "update", "publish"):
        assert figures[f"verl_{phase}"] > 0, phase  # each phase really ran in the measured step
    # the phases and the remainder add up to veRL's own step time
    assert sum(figures[f"verl_{p}"] for p in PHASES) == pytest.approx(figures["verl_step"], rel=1e-6)
    table = done.stdout
    assert "verl_weight_sync" in table and "× embedded_step" in table
    assert not any(line.startswith(("MET", "MISS")) for line in table.splitlines())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
