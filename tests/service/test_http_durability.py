"""Durability of `dsv4flash serve` through the real SDK: checkpoint paths survive a restart and
`create_training_client_from_state_with_optimizer` resumes bit-identically; a SIGKILL during optim_step or
during save_state leaves the store at the old or the new revision, never a mix, and the client's retry succeeds
with exactly the weights an uninterrupted run has."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from tinker import types

import dsv4flash.service as core
from tests.service.http_server import Server, rest_client, running_server, service_client, write_keys

pytestmark = pytest.mark.slow

TOKENS = [0, 10, 11, 12, 20, 21, 22, 1]
ADAM = dict(learning_rate=1e-2)


def _data(mod):
    w = np.ones(len(TOKENS) - 1, dtype=np.float32)
    return [mod.Datum(model_input=mod.ModelInput.from_ints(TOKENS[:-1]),
                      loss_fn_inputs=dict(target_tokens=np.array(TOKENS[1:], dtype=np.int64), weights=w))]


def _step(tc, mod):
    fb = tc.forward_backward(_data(mod), "cross_entropy")
    opt = tc.optim_step(mod.AdamParams(**ADAM))
    return fb, opt


def _logprobs(tc, mod) -> np.ndarray:
    return tc.forward(_data(mod), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _reference(resident, root, steps_before_save: int, steps_after: int) -> np.ndarray:
    """Log-probs after the same calls on the in-process core, uninterrupted."""
    tc = core.ServiceClient(root=root, resident=resident).create_lora_training_client(base_model="tiny", rank=4)
    for _ in range(steps_before_save + steps_after):
        [f.result() for f in _step(tc, core.types)]
    return _logprobs(tc, core.types)


def test_restart_keeps_paths_and_resumes_bit_identically(tmp_path, resident):
    keys = write_keys(tmp_path / "keys")
    with running_server(tmp_path / "store", keys) as a, service_client(a) as sdk:
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
        for _ in range(2):
            [f.result() for f in _step(tc, types)]
        path = tc.save_state("mid").result().path
        [f.result() for f in _step(tc, types)]
        continued = _logprobs(tc, types)
    with running_server(tmp_path / "store", keys) as b, service_client(b) as sdk:
        run = path.split("/")[2]
        assert path in {c.tinker_path for c in rest_client(b).list_checkpoints(run).result().checkpoints}
        resumed = sdk.create_training_client_from_state_with_optimizer(path).result()
        [f.result() for f in _step(resumed, types)]
        np.testing.assert_array_equal(_logprobs(resumed, types), continued)
        weights_only = sdk.create_training_client_from_state(path).result()  # fresh Adam moments: differs
        [f.result() for f in _step(weights_only, types)]
        assert not np.array_equal(_logprobs(weights_only, types), continued)
    np.testing.assert_array_equal(continued, _reference(resident, tmp_path / "ref", 2, 1))


@pytest.mark.parametrize("crash_at,dies_in", [("serve.optim_step.done:2", "optim_step"),
                                              ("catalog.before_commit:2", "save_state")])
def test_sigkill_leaves_old_or_new_revision_and_retry_succeeds(tmp_path, resident, crash_at, dies_in):
    keys = write_keys(tmp_path / "keys")
    a = Server(tmp_path / "store", keys, env={"DSV4FLASH_CRASH_AT": crash_at})
    try:
        sdk = service_client(a)
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
        [f.result() for f in _step(tc, types)]
        saved = tc.save_state("s1").result().path
        fb, opt = _step(tc, types)
        fb.result(30)
        dying = tc.save_state("s2") if dies_in == "save_state" else opt
        with pytest.raises((concurrent.futures.TimeoutError, TimeoutError)):
            dying.result(timeout=20)  # never acknowledged: the server died under it
        assert a.proc.wait(30) == -9, a.log()
        dying.future().cancel()  # stop the abandoned SDK poller
    finally:
        a.stop()
    run = saved.split("/")[2]
    with running_server(tmp_path / "store", keys) as b, service_client(b) as sdk2:
        listed = {c.checkpoint_id for c in rest_client(b).list_checkpoints(run).result().checkpoints}
        assert listed == {"weights/s1"}, listed  # the old revision only: nothing half-written was published
        from dsv4flash.lifecycle import AdapterStore

        store = AdapterStore(tmp_path / "store")
        assert store.policy(run).head == store.resolve(f"{run}:weights.s1").id
        store.load(f"{run}:weights.s1")  # hash-verified read of every byte
        # the client's retry: resume from the last acknowledged checkpoint and redo the lost step
        retry = sdk2.create_training_client_from_state_with_optimizer(saved).result()
        [f.result() for f in _step(retry, types)]
        new = retry.save_state("s2").result().path
        got = _logprobs(sdk2.create_training_client_from_state(new).result(), types)
    np.testing.assert_array_equal(got, _reference(resident, tmp_path / "ref", 1, 1))
