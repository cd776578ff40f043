"""`python -m dsv4flash.bench verl_step` at its smallest size: one real veRL GRPO run (2 steps, 2 prompts × 4
samples: veRL splits a batch over its 8 agent-loop workers) and the embedded engine's GRPO on the same work, as a user runs it. Checks the table's structure
(every phase from veRL's own timing metrics, the ratio against the embedded step, no MET/MISS line since no
target exists) and the plot, never the timings themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.upstream]

PHASES = ("rollout", "weight_sync", "replay", "update", "publish", "save_checkpoint", "other")


def test_verl_step_bench_reports_every_phase_next_to_the_embedded_step(tmp_path):
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "dsv4flash.bench", "verl_step", "--steps", "2", "--prompts", "2",
                           "--group-size", "4", "--workdir", str(tmp_path / "work"), "--json", str(out),
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
    # the run published every step through the lifecycle
    from dsv4flash.lifecycle import AdapterStore

    store = AdapterStore.open(tmp_path / "work" / "verl" / "lifecycle")
    assert store.resolve("decoder_lora_verl_cpu:head").step == 2
