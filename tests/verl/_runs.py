"""The real veRL GRPO runs of the slow tests: `python -m dsv4flash.train +recipe=...` as a user starts it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

def command(recipe: str, base: Path, out: Path, *overrides: str) -> list[str]:
    """The training command of one run; it publishes into `<out>/lifecycle` (a store of its own, not the session's
    default one that every run of the suite would share)."""
    return [sys.executable, "-m", "dsv4flash.train", f"+recipe={recipe}", f"model.hf_path={base}",
            f"output_dir={out}", f"lifecycle.root={out / 'lifecycle'}", *overrides]


def env() -> dict[str, str]:
    """The run's environment (the bench's, `dsv4flash.bench.verl_step.verl_cpu_env`)."""
    from dsv4flash.bench.verl_step import verl_cpu_env

    return verl_cpu_env()


def run(cmd: list[str], out: Path) -> str:
    """Run `cmd` to the end (its own local Ray cluster on 127.0.0.1) -> its log (also kept beside `out`)."""
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"run_{out.name}.log").write_text(log)
    assert proc.returncode == 0, log[-6000:]
    return log
