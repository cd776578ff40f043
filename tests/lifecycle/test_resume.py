"""Resume after kill -9: a run killed mid-training or mid-checkpoint, restarted from its policy record,
reproduces the uninterrupted run's per-step losses and final weights bit for bit (CPU).

One chain of restarts covers the kill modes: an operator's SIGKILL between checkpoints, then a crash
half-way through writing the next checkpoint's bytes, then one inside its catalog transaction, then a
clean finish. Every step any attempt logged must equal the reference run's step exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("train_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _cmd(tmp: Path, name: str, model: str, steps: int, every: int) -> list[str]:
    return [sys.executable, str(WORKER), "--root", str(tmp / f"{name}-store"), "--catalog", str(tmp / f"{name}.sqlite"),
            "--model", model, "--steps", str(steps), "--ckpt-every", str(every),
            "--log", str(tmp / f"{name}.log"), "--final", str(tmp / f"{name}.pt")]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("DSV4FLASH_CRASH_AT", None)
    env.pop("DSV4FLASH_HOLD_AFTER_STEP", None)
    env.update(extra or {})
    return env


def _run(cmd, extra_env=None, kill_at_step: int | None = None) -> tuple[int, list[dict]]:
    """Run the worker; optionally SIGKILL it as soon as it reports `kill_at_step`."""
    hold = {"DSV4FLASH_HOLD_AFTER_STEP": str(kill_at_step)} if kill_at_step is not None else {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env({**(extra_env or {}), **hold}))
    events = []
    for line in proc.stdout:
        events.append(json.loads(line))
        if kill_at_step is not None and events[-1].get("step") == kill_at_step:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=300)
    err = proc.stderr.read()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker failed ({proc.returncode}):\n{err}")
    return proc.returncode, events


def _losses(log: Path) -> dict[int, set[str]]:
    seen: dict[int, set[str]] = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        seen.setdefault(rec["step"], set()).add(rec["loss"])
    return seen


def _assert_same_run(tmp: Path, ref: str, run: str, steps: int) -> None:
    ref_losses, run_losses = _losses(tmp / f"{ref}.log"), _losses(tmp / f"{run}.log")
    assert sorted(ref_losses) == list(range(1, steps + 1)) == sorted(run_losses)
    for step, values in run_losses.items():
        assert values == ref_losses[step], f"step {step}: resumed losses {values} != reference {ref_losses[step]}"
    a, b = torch.load(tmp / f"{ref}.pt"), torch.load(tmp / f"{run}.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"final weight {k} differs after resume"


def test_mlp_resume_after_repeated_kills(tmp_path):
    steps, every = 10, 3
    assert _run(_cmd(tmp_path, "ref", "mlp", steps, every))[0] == 0
    cmd = _cmd(tmp_path, "run", "mlp", steps, every)
    # 1. operator kill -9 between checkpoints (after step 5; the last checkpoint is step 3)
    rc, events = _run(cmd, kill_at_step=5)
    assert rc == -signal.SIGKILL and events[0] == {"start": 0}
    # 2. killed half-way through writing the step-6 revision bytes (resumes from step 3)
    rc, events = _run(cmd, {"DSV4FLASH_CRASH_AT": "blob.mid_write"})
    assert rc == -signal.SIGKILL and events[0] == {"start": 3} and events[-1] == {"step": 6}
    # 3. killed inside the catalog transaction of the step-6 checkpoint (still resumes from 3)
    rc, events = _run(cmd, {"DSV4FLASH_CRASH_AT": "catalog.before_commit"})
    assert rc == -signal.SIGKILL and events[0] == {"start": 3}
    # 4. killed right after the step-6 checkpoint committed: the next start must be 6
    rc, events = _run(cmd, {"DSV4FLASH_CRASH_AT": "catalog.after_commit"})
    assert rc == -signal.SIGKILL and events[0] == {"start": 3} and events[-1] == {"step": 6}
    rc, events = _run(cmd)
    assert rc == 0 and events[0] == {"start": 6}
    _assert_same_run(tmp_path, "ref", "run", steps)


@pytest.mark.slow
def test_tiny_transformer_lora_resume_after_kill(tmp_path):
    """The same on the reference tiny Transformer with LoRA (dropout on) from `dsv4flash.lora`."""
    steps, every = 5, 2
    assert _run(_cmd(tmp_path, "ref", "tiny", steps, every))[0] == 0
    cmd = _cmd(tmp_path, "run", "tiny", steps, every)
    rc, _ = _run(cmd, kill_at_step=3)
    assert rc == -signal.SIGKILL
    rc, events = _run(cmd)
    assert rc == 0 and events[0] == {"start": 2}
    _assert_same_run(tmp_path, "ref", "run", steps)
