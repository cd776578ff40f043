"""Killing the real veRL GRPO run and restarting it (`python -m dsv4flash.train +recipe=decoder_lora_verl_cpu`).

Three runs on one tiny base, all with `rollout.full_determinism=true` (every request sampled with the replica's
seed, as vLLM's server does; the default per-request seed stream of the rollout server is not part of a
checkpoint, so without it a restarted run samples other responses):
  A  uninterrupted, 2 GRPO steps;
  B1 once step 1 is published, a Megatron worker (a `ray::WorkerDict` of this run) is SIGKILLed mid-step and the
     driver with its whole process tree (Ray included) is SIGKILLed: the catalog's head is still step 1 and its
     blobs verify, nothing of step 2 is registered;
  B2 the same command again: it resumes from the step-1 revision and its step 2 equals A's bit for bit
     (adapter tensors of the step-2 revision and every logged metric but timings).
Only processes this test started are killed (by pid, from the driver's process tree).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dsv4flash.bench.verl_step import step_metrics

pytestmark = [pytest.mark.slow, pytest.mark.upstream]

POLICY = "decoder_lora_verl_cpu"
OVERRIDES = ('engine.overrides=["trainer.use_v1=false", "+ray_kwargs.ray_init._node_ip_address=127.0.0.1", '
             '"actor_rollout_ref.rollout.full_determinism=true"]')
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/")


def _command(base, out):
    return [sys.executable, "-m", "dsv4flash.train", "+recipe=decoder_lora_verl_cpu", f"model.hf_path={base}",
            f"output_dir={out}", OVERRIDES]


def _env():
    return {**os.environ, "VERL_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo", "RAY_USAGE_STATS_ENABLED": "0"}


def _run(base, out) -> str:
    proc = subprocess.run(_command(base, out), env=_env(), capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log


def _kill_tree(proc: subprocess.Popen, first: psutil.Process | None = None) -> None:
    """SIGKILL `first` (a worker), then the driver and every process it started, by pid."""
    tree = [psutil.Process(proc.pid)]
    try:
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    if first is not None:
        first.send_signal(signal.SIGKILL)
        time.sleep(1.0)
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer

    root = tmp_path_factory.mktemp("verl_resume")
    cfg = load_config("tiny")
    base = save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), root / "base", {"kind": "test"})
    log_a = _run(base, root / "a")

    out = root / "b"
    proc = subprocess.Popen(_command(base, out), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen, deadline = [], time.monotonic() + 1500
    try:
        for line in proc.stdout:
            seen.append(line)
            if "dsv4flash lifecycle: published step 1 " in line:
                break
            assert time.monotonic() < deadline, "run B never published step 1"
        else:
            pytest.fail("run B ended before publishing step 1:\n" + "".join(seen)[-6000:])
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "WorkerDict" in " ".join(p.cmdline() or [p.name()])]
        assert workers, "no ray::WorkerDict process under the driver"
        _kill_tree(proc, first=workers[0])
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    from dsv4flash.lifecycle import AdapterStore

    with AdapterStore.open(out / "lifecycle") as store:
        killed = {"head": store.resolve(f"{POLICY}:head"), "revisions": store.catalog.revisions(POLICY)}
        killed["load"] = store.load(killed["head"].id)  # hash-verified read of the blob
        killed["state"] = store.trainer_state(POLICY, killed["head"].id)
    log_b = _run(base, out)
    return root, log_a, "".join(seen), killed, log_b


def test_a_worker_killed_mid_step_leaves_the_last_revision_intact(runs):
    root, _, log_b1, killed, _ = runs
    head = killed["head"]
    assert head.step == 1 and f"published step 1 as revision {head.id[:12]}" in log_b1
    assert [r.step for r in killed["revisions"]] == [1]  # nothing of step 2 registered
    assert killed["load"].manifest.step == 1
    state, blob = killed["state"]
    assert state.step == 1 and blob  # the trainer state blob is there and readable


def test_the_restarted_run_resumes_from_the_revision_and_repeats_step_2_bit_for_bit(runs):
    from dsv4flash.lifecycle import AdapterStore

    root, log_a, _, killed, log_b = runs
    assert f"resuming from revision {killed['head'].id[:12]} (step 1)" in log_b
    a, b = step_metrics(log_a), step_metrics(log_b)
    assert 1 not in b or "training/global_step" not in b[1]  # step 1 was not trained again
    keys = {k for k in a[2] if not k.startswith(TIMING) and k != "publish_s"}
    assert keys and keys <= b[2].keys(), sorted(keys - b[2].keys())
    differ = {k: (a[2][k], b[2][k]) for k in keys
              if a[2][k] != b[2][k] and not (math.isnan(a[2][k]) and math.isnan(b[2][k]))}
    assert not differ, differ
    with AdapterStore.open(root / "a" / "lifecycle") as sa, AdapterStore.open(root / "b" / "lifecycle") as sb:
        ha, hb = sa.resolve(f"{POLICY}:head"), sb.resolve(f"{POLICY}:head")
        assert ha.step == hb.step == 2 and hb.parent == killed["head"].id
        ta, tb = sa.load_adapter(ha.id).to_packed_tensors(), sb.load_adapter(hb.id).to_packed_tensors()
        assert ta.keys() == tb.keys()
        import torch

        assert all(torch.equal(ta[k], tb[k]) for k in ta), [k for k in ta if not torch.equal(ta[k], tb[k])][:5]
        # the step-1 revisions of both runs are the same adapter too (same content address)
        assert sa.resolve(f"{POLICY}:step-1").id == killed["head"].id
