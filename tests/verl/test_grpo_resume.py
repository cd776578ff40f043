"""Killing the real veRL GRPO run and restarting it (`python -m dsv4flash.train +recipe=decoder_lora_verl_cpu`).

Three runs on the pretrained tiny base (`pretrain_tiny`, built once into pytest's cache) with the recipe's graded
arithmetic reward (`partial_credit`: exact answers 1, near ones partial credit). A random-init base scores 0 on every
response, and the pretrained one rarely answers exactly, so with exact-match rewards GRPO's advantages and
update would be 0 and "bit-identical" would say nothing. Sampling is the recipe's own: every rollout request
seeded by its trajectory (no `full_determinism`):
  A  uninterrupted, 2 GRPO steps (the run the end-to-end checks read: `verl_text_run`, tests/verl/conftest.py);
     both steps have nonzero advantages and change the adapter; after every sync the fixed-prompt check
     (`weight_sync/fixed_prompt_logprob_diff_max`) is within 1e-5;
  B1 once step 1 is published, a Megatron worker (a `ray::WorkerDict` of this run) is SIGKILLed during step
     2's actor update and then the driver with its whole process tree (Ray included): the catalog's head is
     still step 1, its blobs verify, nothing of step 2 is registered or left in the store (no temp file, no
     unreferenced blob);
  B2 the same command again: it resumes from the step-1 revision and its step 2 equals A's bit for bit
     (adapter tensors, the published revision's content address, every logged metric but timings).
Only processes this test started are killed (by pid, from the driver's process tree). The runs are
`whole_machine` tests: under pytest-xdist never beside another Ray run.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time

import psutil
import pytest

from dsv4flash.bench.verl_step import step_metrics
from tests.verl import _runs

pytestmark = [pytest.mark.slow, pytest.mark.upstream, pytest.mark.whole_machine]

POLICY = "decoder_lora_verl_cpu"
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/")  # and any "<role>/perf/" figure (memory, throughput)
SYNC_METRIC = "weight_sync/fixed_prompt_logprob_diff_max"
SYNC_LINE = "dsv4flash sync check: weight_sync/fixed_prompt_logprob_diff_max:"


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
def runs(verl_text_run, tmp_path_factory):
    """A: the shared uninterrupted run (tests/verl/conftest.py); B1 killed in step 2; B2 the same command again
    -> (A's run dir, A's log, B1's log, what B1 left, B2's log, B's run dir)."""
    from dsv4flash.lifecycle import AdapterStore

    base, run_a, log_a = verl_text_run
    root = tmp_path_factory.mktemp("verl_resume")
    out = root / "b"
    cmd = _runs.command(POLICY, base, out)
    proc = subprocess.Popen(cmd, env=_runs.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, published, deadline = [], False, time.monotonic() + 1500
    try:
        for line in proc.stdout:
            seen.append(line)
            published = published or "dsv4flash lifecycle: published step 1 " in line
            if published and "dsv4flash lifecycle: updating the actor at step 2" in line:
                break  # step 1 is published; step 2's rollout is done and its actor update has begun
            assert time.monotonic() < deadline, "run B never reached step 2's update"
        else:
            pytest.fail("run B ended before step 2's update:\n" + "".join(seen)[-6000:])
        time.sleep(0.5)  # inside step 2's update, well before its checkpoint and publish
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "WorkerDict" in " ".join(p.cmdline() or [p.name()])]
        assert workers, "no ray::WorkerDict process under the driver"
        _kill_tree(proc, first=workers[0])
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
    store_root = out / "lifecycle"
    left = sorted(p.name for p in (store_root / "blobs" / "tmp").iterdir())  # before opening (which sweeps)
    with AdapterStore.open(store_root) as store:
        head = store.resolve(f"{POLICY}:head")
        killed = {"head": head, "revisions": store.catalog.revisions(POLICY), "temp_files": left,
                  "blobs": sorted(b.key for b in store.blobs.iter_blobs()),
                  "live": sorted(store.catalog.live_blob_keys()),
                  "load": store.load(head.id),  # hash-verified read of the revision blob
                  "state": store.trainer_state(POLICY, head.id)}
        for key in killed["blobs"]:
            store.blobs.verify(key)
    (root / "run_b1.log").write_text("".join(seen))  # kept for a failure's post-mortem
    log_b = _runs.run(cmd, out)
    return run_a, log_a, "".join(seen), killed, log_b, out


def test_both_steps_learn_and_the_fixed_prompt_check_holds_in_the_run(runs):
    from dsv4flash.lifecycle import AdapterStore

    run_a, log_a, _, _, log_b, _ = runs
    a, b = step_metrics(log_a), step_metrics(log_b)
    for step in (1, 2):
        m = a[step]
        assert max(abs(m["critic/advantages/max"]), abs(m["critic/advantages/min"])) > 0, (step, m)
        assert m["critic/score/max"] > m["critic/score/min"], (step, m)  # rewards with spread
        assert m[SYNC_METRIC] <= 1e-5, (step, m[SYNC_METRIC])  # measured inside the run after the step's sync
    assert b[2][SYNC_METRIC] <= 1e-5
    assert log_a.count(SYNC_LINE) >= 3  # the initial sync and the two after the updates
    with AdapterStore.open(run_a / "lifecycle") as store:
        one = store.load_adapter(f"{POLICY}:step-1").to_packed_tensors()
        two = store.load_adapter(f"{POLICY}:step-2").to_packed_tensors()
    assert one.keys() == two.keys() and any(not _equal(one[k], two[k]) for k in one)  # step 2 moved the adapter
    assert any(float(t.abs().max()) > 0 for k, t in one.items() if "lora_b" in k.lower())  # and step 1 did


def test_a_worker_killed_mid_step_leaves_the_last_revision_intact(runs):
    _, _, log_b1, killed, _, _ = runs
    head = killed["head"]
    assert head.step == 1 and f"published step 1 as revision {head.id[:12]}" in log_b1
    assert "published step 2" not in log_b1
    assert [r.step for r in killed["revisions"]] == [1]  # nothing of step 2 registered
    assert killed["load"].manifest.step == 1
    state, blob = killed["state"]
    assert state.step == 1 and blob  # the trainer state blob is there and hash-verified
    assert killed["temp_files"] == []  # no partial write visible
    assert killed["blobs"] == killed["live"]  # every blob on disk belongs to the registered revision


def test_the_restarted_run_resumes_from_the_revision_and_repeats_step_2_bit_for_bit(runs):
    from dsv4flash.lifecycle import AdapterStore

    run_a, log_a, _, killed, log_b, run_b = runs
    assert f"resuming from revision {killed['head'].id[:12]} (step 1)" in log_b
    a, b = step_metrics(log_a), step_metrics(log_b)
    assert 1 not in b or "training/global_step" not in b[1]  # step 1 was not trained again
    keys = {k for k in a[2] if not k.startswith(TIMING) and "/perf/" not in k and k != "publish_s"}
    assert keys and keys <= b[2].keys(), sorted(keys - b[2].keys())
    differ = {k: (a[2][k], b[2][k]) for k in keys
              if a[2][k] != b[2][k] and not (math.isnan(a[2][k]) and math.isnan(b[2][k]))}
    assert not differ, differ
    with AdapterStore.open(run_a / "lifecycle") as sa, AdapterStore.open(run_b / "lifecycle") as sb:
        ha, hb = sa.resolve(f"{POLICY}:head"), sb.resolve(f"{POLICY}:head")
        assert ha.step == hb.step == 2 and hb.parent == killed["head"].id
        ta, tb = sa.load_adapter(ha.id).to_packed_tensors(), sb.load_adapter(hb.id).to_packed_tensors()
        assert ta.keys() == tb.keys()
        assert all(_equal(ta[k], tb[k]) for k in ta), [k for k in ta if not _equal(ta[k], tb[k])][:5]
        # same content address: the same revision (adapter bytes and manifest) in both runs, steps 1 and 2
        assert ha.id == hb.id and sa.resolve(f"{POLICY}:step-1").id == killed["head"].id


def _equal(x, y) -> bool:
    import torch

    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
