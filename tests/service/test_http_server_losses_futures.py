"""Server-side custom losses (`ServiceClient.create_custom_loss` + `forward_backward_custom(handle)`) and the
sampling-session poller (`/api/v1/retrieve_futures`), driven by the real tinker SDK 0.38 against `dsv4flash serve`."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from tinker import types

import dsv4flash.service as core
from tests.service.http_server import KEYS

TOKENS = [[0, 10, 11, 12, 20, 21], [0, 13, 14, 15, 23, 24, 25]]


def _data(mod, advantages=False):
    out = []
    for t in TOKENS:
        inputs = {"target_tokens": np.array(t[1:], dtype=np.int64),
                  "weights": np.linspace(0.5, 1.0, len(t) - 1).astype(np.float32)}
        if advantages:
            inputs["advantages"] = np.linspace(-1.0, 1.0, len(t) - 1).astype(np.float32)
        out.append(mod.Datum(model_input=mod.ModelInput.from_ints(t[:-1]), loss_fn_inputs=inputs))
    return out


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss.detach(), "custom/tokens:mean": (weights > 0).float().sum()}


def clipped_pg(logprobs, weights, advantages):
    # a policy-gradient surrogate with a clamp, exp and a getattr of .shape (all rebuilt server-side)
    ratio = torch.exp(logprobs - logprobs.detach())
    n = logprobs.shape[0]
    loss = -(torch.clamp(ratio, 0.8, 1.2) * advantages * weights).sum() / n
    return loss, {"custom/pg:sum": loss.detach()}


@pytest.fixture(scope="module")
def nll_handle(sdk):
    """`weighted_nll` uploaded once (a session creates each traced loss once)."""
    return sdk.create_custom_loss(weighted_nll, input_ranks={"logprobs": 1, "weights": 1}).result()


def _post(server, path, tenant="alice", **kw):
    return httpx.post(f"{server.url}/api/v1/{path}", headers={"X-API-Key": KEYS[tenant]}, timeout=30, **kw)


def test_server_side_custom_loss_trains_like_the_same_loss_in_process(sdk, nll_handle, resident, tmp_path):
    handle = nll_handle
    assert handle.loss_id, "custom_loss_server_side is on: the SDK uploads the traced loss"
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    local = core.ServiceClient(root=tmp_path, resident=resident).create_lora_training_client(
        base_model="tiny", rank=4, seed=3)

    def local_loss(data, logprobs):  # the same per-datum loss summed, as the server runs it
        total = None
        for d, lp in zip(data, logprobs):
            loss, _ = weighted_nll(lp, d.loss_fn_inputs["weights"].to_torch())
            total = loss if total is None else total + loss
        return total, {}

    for _ in range(2):
        out = tc.forward_backward_custom(_data(types), handle).result()
        ref = local.forward_backward_custom(_data(core.types), local_loss).result()
        assert out.metrics["loss:sum"] == ref.metrics["loss:sum"]
        assert out.metrics["custom/nll:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-6)
        assert out.metrics["custom/tokens:mean"] == pytest.approx(5.5)  # (5 + 6) / 2 datums
        for got, want in zip(out.loss_fn_outputs, ref.loss_fn_outputs):
            np.testing.assert_array_equal(got["logprobs"].to_numpy(), want["logprobs"].to_numpy())
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        local.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward(_data(types), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    want = local.forward(_data(core.types), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(after, want)


def test_server_side_custom_loss_with_several_inputs_changes_the_policy(sdk):
    handle = sdk.create_custom_loss(clipped_pg, input_ranks={"logprobs": 1, "weights": 1, "advantages": 1}).result()
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    before = tc.forward(_data(types), "cross_entropy").result().loss_fn_outputs[1]["logprobs"].to_numpy()
    out = tc.forward_backward_custom(_data(types, advantages=True), handle).result()
    assert np.isfinite(out.metrics["custom/pg:sum"])
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after = tc.forward(_data(types), "cross_entropy").result().loss_fn_outputs[1]["logprobs"].to_numpy()
    assert not np.array_equal(before, after)
    with pytest.raises(ValueError, match="advantages"):  # the SDK checks inputs first; the server does too
        tc.forward_backward_custom(_data(types), handle).result()


def _graph_request(session_id, nodes, seq=7):
    return types.CreateCustomLossRequest(
        session_id=session_id, custom_loss_seq_id=seq, name="evil",
        inputs=[types.CustomLossInput(name="logprobs", rank=1)],
        graph=types.CustomLossGraph(nodes=[types.CustomLossNode(**n) for n in nodes])).model_dump(mode="json")


@pytest.mark.parametrize("node, says", [
    ({"op": "call_function", "name": "x", "target": "os.system", "args": ["true"]}, "os.system"),
    ({"op": "call_function", "name": "x", "target": "builtins.eval", "args": ["1"]}, "builtins.eval"),
    ({"op": "call_function", "name": "x", "target": "torch.load", "args": ["/etc/passwd"]}, "torch.load"),
    ({"op": "call_function", "name": "x", "target": "operator.methodcaller", "args": ["__reduce__"]},
     "operator.methodcaller"),
    ({"op": "call_function", "name": "x", "target": "getattr", "args": [{"ref": "logprobs"}, "__class__"]},
     "__class__"),
    ({"op": "call_method", "name": "x", "target": "numpy", "args": [{"ref": "logprobs"}]}, "numpy"),
    ({"op": "get_attr", "name": "x", "target": "weight"}, "get_attr"),
])
def test_hostile_custom_loss_graphs_are_refused_naming_the_node(server, sdk, node, says):
    sid = _post(server, "create_session", json={"sdk_version": "0.38.0", "tags": [], "user_metadata": {}}).json()[
        "session_id"]
    nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}, node,
             {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": "x"}, {"dict": {}}]}]}]
    r = _post(server, "create_custom_loss", json=_graph_request(sid, nodes))
    assert r.status_code == 400 and says in r.json()["detail"], r.text


def test_a_loss_id_is_usable_only_by_its_own_session(server, nll_handle):
    import tinker

    handle = nll_handle
    with tinker.ServiceClient(base_url=server.url, api_key=KEYS["bob"]) as other:
        tc = other.create_lora_training_client(base_model="tiny", rank=4).result()
        with pytest.raises(Exception, match="loss_id"):
            tc.forward_backward(_data(types), "custom", {"loss_id": handle.loss_id}).result()


def test_sampling_goes_through_the_session_poller(sdk, server):
    sc = sdk.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([0, 10, 11, 12])
    futures = [sc.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=s)) for s in range(4)]
    results = [f.result() for f in futures]
    assert sc._futures_poller is not None  # sample_use_retrieve_futures: one poller, no per-request polling
    assert all(len(r.sequences) == 2 for r in results)
    again = sc.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=2)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in results[2].sequences]  # same seed, same tokens


def test_retrieve_futures_cursor_acks_and_tenants(server, sdk):
    sc = sdk.create_sampling_client(base_model="tiny").result()
    sid = sc._sampling_session_id
    body = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [0, 10, 11]}]},
            "sampling_params": {"max_tokens": 2, "seed": 1}, "sampling_session_id": sid, "seq_id": 3_000_000_005}
    rid = _post(server, "asample", json=body).json()["request_id"]
    poll = {"target": {"type": "sampling_session", "sampling_session_id": sid, "cloned_sampler_id": 3},
            "prev_cursor": 0}
    first = _post(server, "retrieve_futures", json=poll).json()  # long-polls until the sample finishes
    assert [c["request_id"] for c in first["completions"]] == [rid] and first["completions"][0]["state"] == "finished"
    assert _post(server, "retrieve_futures", json={**poll, "prev_cursor": 0, "timeout": 0}).json()[
        "completions"], "not acknowledged yet: still reported"
    other_clone = _post(server, "retrieve_futures", json={**poll, "timeout": 0,
                                                          "target": {**poll["target"], "cloned_sampler_id": 0}})
    assert rid not in [c["request_id"] for c in other_clone.json()["completions"]]
    assert _post(server, "retrieve_future", json={"request_id": rid}).status_code == 200  # payload fetch
    acked = _post(server, "retrieve_futures", json={**poll, "prev_cursor": first["cursor"], "timeout": 0,
                                                    "retrieved_request_ids": [rid]}).json()
    assert acked["completions"] == [] and acked["cursor"] == first["cursor"]
    assert _post(server, "retrieve_future", json={"request_id": rid}).status_code == 410  # payload freed
    assert _post(server, "retrieve_futures", tenant="bob", json=poll).status_code == 404  # not bob's session
