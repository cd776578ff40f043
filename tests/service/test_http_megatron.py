"""`dsv4flash serve --trainer megatron --trainer-layout ep=2`: the real tinker SDK trains on veRL's Megatron worker
group (2 gloo ranks, EP 2, fp32, a local Ray cluster on 127.0.0.1) and gets what the local trainer gives.

One server for the module (its start — Ray, veRL's Megatron engine on both ranks, the adapter map — is the cost):
the supervised and RL loops against the in-process local trainer (the same computation as `--trainer local`,
tests/service/test_http_loops.py), three tenants of ranks 4, 8 and 16 concurrently vs each alone, memory flat in
the number of policies, admission, and last the two fault tests (a worker SIGKILLed during optim_step; the server
SIGKILLed and restarted on the same store).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time

import numpy as np
import pytest
import torch
from tinker import types

import dsv4flash.service as core
from tests.service.http_server import rl_batch

pytestmark = [pytest.mark.slow, pytest.mark.whole_machine]

KEYS = {"ann": "tml-ann-key-0123456789", "ben": "tml-ben-key-0123456789", "cat": "tml-cat-key-0123456789"}
ARGS = ("--trainer", "megatron", "--trainer-layout", "ep=2", "--sampler", "dsv4flash", "--sampler-max-adapters", "2")
START_S = 900  # Ray + veRL's Megatron engine on two ranks: ~2 min on a quiet 2-core machine
# attention and head LoRA: the placement both trainers hold alike (Megatron fuses gate and up with one shared A)
PLACEMENT = {"rank": 8, "train_mlp": False}
LOSS_RTOL, LOGPROB_ATOL = 1e-4, 1e-5


def _keys(path):
    path.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    return path


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """{"server", "store", "keys", "dir"}: one `--trainer megatron` server for the module (a fault test may
    replace the server; its Ray processes are ended by pid at teardown)."""
    from dsv4flash.service.protocol.launch import ServerProcess

    root = tmp_path_factory.mktemp("megatron")
    state = {"dir": root, "store": root / "store", "keys": _keys(root / "keys")}
    with pytest.MonkeyPatch.context() as env:
        # what megatron-core leaves in a process that built a model with another attention backend (a suite's
        # worker): the server's trainer workers must pick their own, not inherit it
        env.setenv("NVTE_FUSED_ATTN", "1")
        state["server"] = ServerProcess(state["store"], state["keys"], args=ARGS, start_timeout_s=START_S)
    yield state
    _stop(state["server"])


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _stop(server, kill: bool = False) -> None:
    """Stop (or SIGKILL) the server, then end whatever of its Ray processes outlived it, by pid. Its SDK clients
    are closed (an open client's heartbeat thread outlives the test and logs every 10 s): before a stop, or after
    a kill without waiting (nothing answers them)."""
    pids = _descendants(server.proc.pid)
    clients = _CLIENTS.pop(server.url, [])
    for client in clients if not kill else []:
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=30)
    server.kill() if kill else server.stop()
    for client in clients if kill else []:
        client.close("interrupted")
    time.sleep(1.0)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_CLIENTS: dict[str, list] = {}  # server url -> the SDK clients made on it


def _sdk(server, tenant="ann"):
    import tinker

    client = tinker.ServiceClient(base_url=server.url, api_key=KEYS[tenant])
    _CLIENTS.setdefault(server.url, []).append(client)
    return client


def _sl_datum(mod, tokens, prompt_len):
    weights = np.array([0] * prompt_len + [1] * (len(tokens) - prompt_len), dtype=np.float32)[1:]
    return mod.Datum(model_input=mod.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs=dict(weights=weights, target_tokens=np.array(tokens[1:], dtype=np.int64)))


EXAMPLES = [([0, 10, 11, 12, 20, 21, 22, 1], 4), ([0, 13, 14, 15, 23, 24, 25, 1], 4), ([0, 30, 31, 32, 33, 1], 2)]


def _local(tmp_path):
    """The local trainer (the resident base in this process) with the megatron server's placement."""
    return core.ServiceClient(root=tmp_path).create_lora_training_client(base_model="tiny", preset="decoder_half",
                                                                         **PLACEMENT)


def _close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=LOSS_RTOL, atol=0, err_msg=what)


def test_supervised_loop_equals_the_local_trainer(megatron, tmp_path):
    sdk = _sdk(megatron["server"])
    tc = sdk.create_lora_training_client(base_model="tiny", **PLACEMENT).result()
    local = _local(tmp_path)
    http_data = [_sl_datum(types, t, p) for t, p in EXAMPLES]
    local_data = [_sl_datum(core.types, t, p) for t, p in EXAMPLES]
    losses = []
    for step in range(4):
        fwdbwd = tc.forward_backward(http_data, "cross_entropy")  # pipelined, as the cookbook does
        optim = tc.optim_step(types.AdamParams(learning_rate=5e-3, grad_clip_norm=1.0))
        out, opt = fwdbwd.result(), optim.result()
        ref = local.forward_backward(local_data, "cross_entropy").result()
        ref_opt = local.optim_step(core.types.AdamParams(learning_rate=5e-3, grad_clip_norm=1.0)).result()
        _close(out.metrics["loss:sum"], ref.metrics["loss:sum"], f"step {step} loss")
        _close(opt.metrics["grad_norm"], ref_opt.metrics["grad_norm"], f"step {step} grad norm")
        for got, want in zip(out.loss_fn_outputs, ref.loss_fn_outputs):
            np.testing.assert_allclose(got["logprobs"].to_numpy(), want["logprobs"].to_numpy(), rtol=0,
                                       atol=LOGPROB_ATOL)
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 0.1, losses
    fwd = tc.forward(http_data, "cross_entropy").result()
    ref = local.forward(local_data, "cross_entropy").result()
    _close(fwd.metrics["loss:sum"], ref.metrics["loss:sum"], "forward loss")
    # the checkpoint is the local trainer's format: canonical tensors equal to the local run's, to fp32 rounding
    path = tc.save_state("sl-final").result().path
    tensors, state, _ = core.ServiceClient(root=megatron["store"])._read_checkpoint(path, True)
    for key, want in local.adapter.items():
        torch.testing.assert_close(tensors[key], want.detach(), rtol=0, atol=1e-5)
    assert state["step"] == 4 and len(state["optimizer"]["state"]) == len(local.adapter)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_loop_equals_the_local_trainer(megatron, tmp_path, loss_fn):
    sdk = _sdk(megatron["server"])
    tc = sdk.create_lora_training_client(base_model="tiny", **PLACEMENT).result()
    local = _local(tmp_path)
    prompt = [0, 10, 11, 12]
    for step in range(3):
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                                 types.SamplingParams(max_tokens=5, seed=11 + step, temperature=1.0)).result().sequences
        ref = local.save_weights_and_get_sampling_client().sample(
            core.types.ModelInput.from_ints(prompt), 4,
            core.types.SamplingParams(max_tokens=5, seed=11 + step)).result().sequences
        assert [list(s.tokens) for s in sampled] == [list(s.tokens) for s in ref], f"step {step}: other tokens"
        np.testing.assert_allclose(np.concatenate([s.logprobs for s in sampled]),
                                   np.concatenate([s.logprobs for s in ref]), rtol=0, atol=LOGPROB_ATOL)
        data, _ = rl_batch(types, sampled, prompt)
        out = tc.forward_backward(data, loss_fn).result()
        want = local.forward_backward(rl_batch(core.types, ref, prompt)[0], loss_fn).result()
        # A = r − mean(r) sums to 0, so on-policy the loss is a sum that cancels to ~0: relative to its terms' size
        for i, (d, got, exp) in enumerate(zip(data, out.loss_fn_outputs, want.loss_fn_outputs)):
            scale = max(abs(float(exp["loss"].to_numpy()[0])),
                        float(np.abs(d.loss_fn_inputs["advantages"].to_numpy()).sum()))
            np.testing.assert_allclose(got["loss"].to_numpy(), exp["loss"].to_numpy(), rtol=0,
                                       atol=LOSS_RTOL * scale, err_msg=f"step {step} datum {i} {loss_fn} loss")
            np.testing.assert_allclose(got["logprobs"].to_numpy(), exp["logprobs"].to_numpy(), rtol=0,
                                       atol=LOGPROB_ATOL)
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        local.optim_step(core.types.AdamParams(learning_rate=2e-2)).result()


TENANT_RANKS = {"ann": 4, "ben": 8, "cat": 16}


def _tenant_run(server, tenant: str, name: str) -> str:
    """One tenant's supervised run (its rank, its own data, 3 steps) -> the path of its final checkpoint."""
    sdk = _sdk(server, tenant)
    tc = sdk.create_lora_training_client(base_model="tiny", rank=TENANT_RANKS[tenant], seed=len(tenant)).result()
    offset = 40 * list(TENANT_RANKS).index(tenant)
    data = [_sl_datum(types, [0] + [t + offset for t in toks[1:-1]] + [1], p) for toks, p in EXAMPLES]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc.save_state(name).result().path


def _checkpoint(store, path):
    tensors, state, placement = core.ServiceClient(root=store)._read_checkpoint(path, True)
    return tensors, state, placement


def test_three_tenants_of_ranks_4_8_16_concurrently_equal_each_alone(megatron):
    server = megatron["server"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = dict(zip(TENANT_RANKS, pool.map(lambda t: _tenant_run(server, t, "together"), TENANT_RANKS)))
    alone = {t: _tenant_run(server, t, "alone") for t in TENANT_RANKS}  # one after another: nothing interleaved
    for tenant, rank in TENANT_RANKS.items():
        a, sa, pa = _checkpoint(megatron["store"], together[tenant])
        b, sb, pb = _checkpoint(megatron["store"], alone[tenant])
        assert pa.rank == pb.rank == rank and a.keys() == b.keys()
        assert any(k.startswith("layers.") and ".ffn." in k for k in a)  # the MLP experts are trained too
        for key in a:
            assert torch.equal(a[key], b[key]), f"{tenant}: {key} differs between concurrent and alone"
        for index, moments in sa["optimizer"]["state"].items():
            for part in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(moments[part], sb["optimizer"]["state"][index][part])
    # isolation as everywhere: another tenant's checkpoint is not there for ben
    import tinker

    with pytest.raises(tinker.NotFoundError):
        _sdk(server, "ben").create_training_client_from_state(together["ann"]).result()


def _metrics(server, labelled: bool = False) -> dict[str, float]:
    """The server's /metrics: `dsv4flash_trainer_*` gauges and counters by short name (all lines by full name,
    labels included, with `labelled`)."""
    import httpx

    text = httpx.get(f"{server.url}/metrics", headers={"X-API-Key": KEYS["ann"]}, timeout=60).text
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        if labelled:
            out[name] = float(value)
        elif name.startswith("dsv4flash_trainer_") and "{" not in name:
            out[name.removeprefix("dsv4flash_trainer_")] = float(value)
    return out


def test_live_memory_is_one_policys_however_many_have_slots(megatron):
    server = megatron["server"]
    sdk = _sdk(server, "ann")
    data = [_sl_datum(types, t, p) for t, p in EXAMPLES]

    def one_policy(seed):
        tc = sdk.create_lora_training_client(base_model="tiny", rank=16, seed=seed).result()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    one_policy(100)
    first = _metrics(server)
    for seed in (101, 102, 103):
        one_policy(seed)
    four = _metrics(server)
    assert four["policies"] == first["policies"] + 3
    assert four["live_bytes"] == first["live_bytes"] > 0  # the live tensors are one policy's
    assert four["device_peak_bytes"] <= first["device_peak_bytes"] * 1.001  # 0 = 0 on the CPU
    per_policy = (four["slot_bytes"] - first["slot_bytes"]) / 3
    assert per_policy >= 0.9 * first["live_bytes"]  # each slot holds values and both moments, in host memory
    assert four["swaps_total"] > first["swaps_total"] and four["swap_bytes_total"] > first["swap_bytes_total"]


def test_a_policy_outside_the_shell_is_refused_naming_it(megatron):
    import tinker

    sdk = _sdk(megatron["server"], "ben")
    with pytest.raises(tinker.BadRequestError, match="rank: 32 is above the trainer group's maximum rank 16"):
        sdk.create_lora_training_client(base_model="tiny", rank=32).result()
    with pytest.raises(tinker.BadRequestError, match="outside the trainer group's placement shell 'decoder_half'"):
        sdk.create_lora_training_client(base_model="tiny", rank=8,
                                        user_metadata={"dsv4flash_preset": "full_linear"}).result()


def test_samplers_load_revisions_by_version_qualified_name_and_reload_evicted_ones(megatron):
    server, store = megatron["server"], megatron["store"]
    sdk = _sdk(server, "ann")
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    data = [_sl_datum(types, t, p) for t, p in EXAMPLES]
    paths = []
    for version in ("v1", "v2", "v3"):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        paths.append(tc.save_weights_for_sampler(version).result().path)
    prompt, params = types.ModelInput.from_ints([0, 10, 11, 12]), types.SamplingParams(max_tokens=4, seed=3)
    samplers = [sdk.create_sampling_client(model_path=p).result() for p in paths]
    first = [s.sample(prompt, 2, params).result() for s in samplers]  # v3 evicts v1 (2 adapters per replica)
    again = samplers[0].sample(prompt, 2, params).result()  # v1 named again: reloaded from the store, not a 404
    assert [q.tokens for q in again.sequences] == [q.tokens for q in first[0].sequences]
    # the replica samples what the server's own base samples for the same revision (the same sampling code)
    local = core.ServiceClient(root=store)
    for path, got in zip(paths, first):
        want = local.create_sampling_client(model_path=path).sample(core.types.ModelInput.from_ints([0, 10, 11, 12]), 2,
                                                                    core.types.SamplingParams(max_tokens=4, seed=3)
                                                                    ).result()
        assert [list(q.tokens) for q in got.sequences] == [list(q.tokens) for q in want.sequences]
        np.testing.assert_array_equal(np.concatenate([q.logprobs for q in got.sequences]),
                                      np.concatenate([q.logprobs for q in want.sequences]))
    loads = {k: v for k, v in _metrics(server, labelled=True).items()
             if k.startswith("dsv4flash_sampler_adapter_loads_total")}
    revisions = [local.require_checkpoint(p).id for p in paths]
    run = paths[0].split("/")[2]  # tinker://<run>/sampler_weights/v1
    named = {rev: sum(v for k, v in loads.items() if f'adapter="{run}@{rev}"' in k) for rev in revisions}
    assert named[revisions[0]] == 2 and named[revisions[1]] == 1 and named[revisions[2]] == 1, loads


def clipped_pg(logprobs, weights, advantages):
    """A server-side custom loss (traced by the SDK, rebuilt on the server): clamp, exp and a .shape."""
    ratio = torch.exp(logprobs - logprobs.detach())
    loss = -(torch.clamp(ratio, 0.8, 1.2) * advantages * weights).sum() / logprobs.shape[0]
    return loss, {"custom/pg:sum": loss.detach()}


def test_a_server_side_custom_loss_trains_like_the_local_trainer(megatron, tmp_path):
    sdk = _sdk(megatron["server"], "ben")
    handle = sdk.create_custom_loss(clipped_pg, input_ranks={"logprobs": 1, "weights": 1, "advantages": 1}).result()
    tc = sdk.create_lora_training_client(base_model="tiny", **PLACEMENT).result()
    local = _local(tmp_path)

    def data(mod):
        out = []
        for t, _ in EXAMPLES:
            n = len(t) - 1
            out.append(mod.Datum(model_input=mod.ModelInput.from_ints(t[:-1]), loss_fn_inputs={
                "target_tokens": np.array(t[1:], dtype=np.int64),
                "weights": np.linspace(0.5, 1.0, n).astype(np.float32),
                "advantages": np.linspace(-1.0, 1.0, n).astype(np.float32)}))
        return out

    def local_loss(batch, logprobs):  # the per-datum losses summed, as the server runs the uploaded graph
        total = None
        for d, lp in zip(batch, logprobs):
            loss, _ = clipped_pg(lp, d.loss_fn_inputs["weights"].to_torch(), d.loss_fn_inputs["advantages"].to_torch())
            total = loss if total is None else total + loss
        return total, {}

    for step in range(3):  # the Megatron trainer: a forward, then the loss's gradient as a linear surrogate
        out = tc.forward_backward_custom(data(types), handle).result()
        ref = local.forward_backward_custom(data(core.types), local_loss).result()
        scale = sum(float(np.abs(d.loss_fn_inputs["advantages"].to_numpy()).sum()) for d in data(types))
        np.testing.assert_allclose(out.metrics["loss:sum"], ref.metrics["loss:sum"], rtol=0, atol=LOSS_RTOL * scale)
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        local.optim_step(core.types.AdamParams(learning_rate=2e-2)).result()
    got = tc.forward(data(types), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    want = local.forward(data(core.types), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "stable_reinforce"])
def test_cookbook_rl_train_main_runs_unmodified_on_the_megatron_plane(megatron, tmp_path, monkeypatch, loss_fn):
    # tinker-cookbook's rl.train: rollouts on the sampler replica, updates on the trainer group; the cookbook's own
    # check compares the replica's log-probs of the sampled tokens with the trainer's forward of them
    import asyncio

    from tinker_cookbook.rl import train
    from tinker_cookbook.utils import cost_estimation

    from dsv4flash.integrations.cookbook import TaskRLDatasetBuilder

    server = megatron["server"]
    monkeypatch.setenv("TINKER_API_KEY", KEYS["ben"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(cost_estimation, "_pricing_fetched", True)
    from pathlib import Path

    import tinker

    rest = tinker.RestClient(base_url=server.url, api_key=KEYS["ben"])
    base = next(m.model_name for m in rest.get_server_capabilities().result().supported_models
                if Path(m.model_name).is_dir())  # the served Hugging Face directory: the cookbook's tokenizer
    log_path = tmp_path / loss_fn
    config = train.Config(
        log_path=str(log_path), model_name=base, recipe_name=f"dsv4flash_megatron_{loss_fn}", base_url=server.url,
        dataset_builder=TaskRLDatasetBuilder(model_name_for_tokenizer=base, task="arithmetic", groups_per_batch=2,
                                             group_size=4, n_batches=2),
        learning_rate=1e-2, max_tokens=3, lora_rank=4, eval_every=0, save_every=0, loss_fn=loss_fn)
    asyncio.run(train.main(config))
    import json

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if any(k.startswith("env/all/") for k in r)]
    assert len(rows) == 2, rows
    assert all(r["tokens/trained"] > r["tokens/sampled"] > 0 for r in rows)
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-4 for r in rows), [r["optim/kl_sample_train_v1"] for r in rows]


def _worker_pids(server) -> list[int]:
    import psutil

    out = []
    for pid in _descendants(server.proc.pid):
        try:
            if any("TinkerPolicyWorker" in part for part in psutil.Process(pid).cmdline()[:1]):
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_worker_killed_during_optim_step_fails_the_call_retryably_and_the_retry_succeeds(megatron, tmp_path):
    import tinker
    from tinker.types import RequestErrorCategory

    server = megatron["server"]
    sdk = _sdk(server, "cat")
    tc = sdk.create_lora_training_client(base_model="tiny", **PLACEMENT).result()
    other = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    local = _local(tmp_path)
    data = [_sl_datum(types, t, p) for t, p in EXAMPLES]
    local_data = [_sl_datum(core.types, t, p) for t, p in EXAMPLES]
    hp, local_hp = types.AdamParams(learning_rate=5e-3), core.types.AdamParams(learning_rate=5e-3)
    for client in (tc, other):
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(hp).result()
    local.forward_backward(local_data, "cross_entropy").result()
    local.optim_step(local_hp).result()
    other_before = other.forward(data, "cross_entropy").result().metrics["loss:sum"]
    tc.forward_backward(data, "cross_entropy").result()  # acknowledged: its gradients must survive the crash
    local.forward_backward(local_data, "cross_entropy").result()
    restarts = _metrics(server)["restarts_total"]

    victim = _worker_pids(server)[-1]
    os.kill(victim, signal.SIGSTOP)  # the call cannot finish on this rank: it is in flight when the rank dies
    in_flight = tc.optim_step(hp)
    time.sleep(3.0)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as failed:
        in_flight.result()
    assert failed.value.category == RequestErrorCategory.Server and "restarting" in str(failed.value)

    retried = tc.optim_step(hp).result()  # waits for the rebuilt group, then steps the acknowledged gradients
    assert retried.metrics["step"] == 2.0
    local.optim_step(local_hp).result()
    got = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    want = local.forward_backward(local_data, "cross_entropy").result().metrics["loss:sum"]
    _close(got, want, "the step after the crash")
    assert other.forward(data, "cross_entropy").result().metrics["loss:sum"] == other_before  # restored exactly
    assert _metrics(server)["restarts_total"] == restarts + 1
    assert victim not in _worker_pids(server)


def test_a_killed_server_restarted_on_the_same_store_resumes_runs_bit_identically(megatron):
    from dsv4flash.service.protocol.launch import ServerProcess

    sdk = _sdk(megatron["server"], "ann")
    tc = sdk.create_lora_training_client(base_model="tiny", rank=8, seed=21).result()
    data = [_sl_datum(types, t, p) for t, p in EXAMPLES]
    hp = types.AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(hp).result()
    resume_from = tc.save_state("s2").result().path
    uninterrupted = []
    for _ in range(2):
        uninterrupted.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(hp).result()
    final = tc.save_state("s4").result().path

    _stop(megatron["server"], kill=True)  # SIGKILL: no shutdown code runs
    megatron["server"] = ServerProcess(megatron["store"], megatron["keys"], args=ARGS, start_timeout_s=START_S)
    sdk = _sdk(megatron["server"], "ann")
    resumed = sdk.create_training_client_from_state_with_optimizer(resume_from).result()
    again = []
    for _ in range(2):
        again.append(resumed.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        resumed.optim_step(hp).result()
    assert again == uninterrupted
    path = resumed.save_state("resumed-s4").result().path
    a, sa, _ = _checkpoint(megatron["store"], final)
    b, sb, _ = _checkpoint(megatron["store"], path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for index, moments in sa["optimizer"]["state"].items():
        assert all(torch.equal(moments[part], sb["optimizer"]["state"][index][part])
                   for part in ("exp_avg", "exp_avg_sq", "step"))
