"""Protocol surface of `dsv4flash serve` as the real tinker SDK 0.38 (and raw HTTP) uses it: health and auth,
capabilities, get_info's offline tokenizer, futures (try_again / 408 / 410 / RequestFailed / cancel), custom
losses, and the REST surface for runs and checkpoints."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.service.http_server import KEYS, rest_client


@pytest.fixture(scope="module")
def trained(sdk):
    """One run with a training and a sampler checkpoint."""
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.forward_backward([_datum([0, 10, 11, 12, 20])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("ckpt").result().path
    sampler = tc.save_weights_for_sampler("samp").result().path
    return tc, state, sampler


def _datum(tokens, weights=True):
    inputs = {"target_tokens": np.array(tokens[1:], dtype=np.int64)}
    if weights:
        inputs["weights"] = np.ones(len(tokens) - 1, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _post(server, path, tenant="alice", **kw):
    headers = {**kw.pop("headers", {}), **({"X-API-Key": KEYS[tenant]} if tenant else {})}
    return httpx.post(f"{server.url}/api/v1/{path}", headers=headers, timeout=30, **kw)


def test_health_is_the_only_unauthenticated_endpoint(server):
    assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/api/v1/get_server_capabilities").status_code == 401
    assert _post(server, "create_session", tenant=None, json={}).status_code == 401
    bad = httpx.get(f"{server.url}/api/v1/training_runs", headers={"X-API-Key": "tml-not-a-key"})
    assert bad.status_code == 401 and "API key" in bad.json()["detail"]


def test_capabilities(server):
    caps = rest_client(server).get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    # the base by name, and by the HF directory served for it (a model name tinker-cookbook can load locally)
    assert names[0] == "tiny" and len(names) == 2 and (Path(names[1]) / "tokenizer.json").is_file()
    assert all(m.trainable and m.sampleable for m in caps.supported_models)


def test_get_info_tokenizer_loads_offline(trained, monkeypatch):
    from dsv4flash.tasks import TaskTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tc, _, _ = trained
    info = tc.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == 4 and info.is_lora
    tok = tc.get_tokenizer()  # the SDK's AutoTokenizer.from_pretrained(tokenizer_id): a local directory
    text = "how many red circles in the <image>? 12"
    assert tok.encode(text, add_special_tokens=False) == TaskTokenizer("tiny").encode(text)
    assert tok.eos_token_id == 1


def test_malformed_requests_name_the_field(server, sdk):
    r = _post(server, "create_session", json={"tags": "nope", "user_metadata": None, "sdk_version": "x"})
    assert r.status_code == 400 and r.json()["field"] == "tags"
    r = _post(server, "optim_step", json={"model_id": "x", "adam_params": {"learning_rate": "fast"}})
    assert r.status_code == 400 and "learning_rate" in r.json()["field"]
    sid = _post(server, "create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"}).json()
    r = _post(server, "create_model", json={"session_id": sid["session_id"], "model_seq_id": 0,
                                            "base_model": "Qwen/Qwen3-8B"})
    assert r.status_code == 400 and r.json()["field"] == "base_model" and "tiny" in r.json()["detail"]
    r = _post(server, "forward_backward", content=b"\x08\xff\xff", headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "forward_backward" in r.json()["detail"]
    r = _post(server, "asample", json={"prompt": {"chunks": []}, "sampling_params": {}, "prompt_alt_tokens_k": 3,
                                       "sampling_session_id": "sampler-x"})
    assert r.status_code == 400 and r.json()["field"] == "prompt_alt_tokens_k"


def test_request_size_limit(server):
    r = _post(server, "forward_backward", content=b"\0" * (65 << 20),
              headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def _raw_forward_backward(server, model_id, n_datums=16, length=64):
    data = [_datum([(3 + i + j) % 60 for j in range(length)]) for i in range(n_datums)]
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn="cross_entropy"), model_id=model_id, seq_id=1)
    body = forward_backward_request_to_proto(req).SerializeToString()
    r = _post(server, "forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def test_retrieve_future_try_again_408_410_and_cancel(server, sdk):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    ids = [_raw_forward_backward(server, tc.model_id) for _ in range(8)]
    last = _post(server, "retrieve_future", json={"request_id": ids[-1]})
    # still behind seven others after the 1 s long poll: HTTP 408 with the queue state (the SDK polls again)
    assert last.status_code == 408, last.text
    assert last.json()["type"] == "try_again" and last.json()["queue_state"] == "active"
    assert _post(server, "cancel_future", json={"request_id": ids[-1]}).status_code == 200
    polls = []
    while True:
        r = _post(server, "retrieve_future", json={"request_id": ids[0]},
                  headers={"Accept": "application/x-protobuf"})
        polls.append(r.status_code)
        if r.headers["content-type"].startswith("application/x-protobuf"):
            break
        assert r.status_code in (200, 408) and r.json()["type"] == "try_again"
    from tinker.proto.response_conv import deserialize_forward_backward_output

    out = deserialize_forward_backward_output(r.content)
    assert len(out.loss_fn_outputs) == 16 and np.isfinite(out.metrics["loss:sum"])
    cancelled = _post(server, "retrieve_future", json={"request_id": ids[-1]})
    assert "cancelled" in cancelled.json()["error"]
    gone = _post(server, "retrieve_future", json={"request_id": "forward_backward-0000-1"})
    assert gone.status_code == 410
    for rid in ids[1:-1]:  # drain
        while _post(server, "retrieve_future", json={"request_id": rid}).json().get("type") == "try_again":
            time.sleep(0.1)


def test_request_failed_reaches_the_sdk(sdk):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="weights") as info:
        tc.forward_backward([_datum([0, 10, 11], weights=False)], "cross_entropy").result()
    assert info.value.category == types.RequestErrorCategory.User


def test_custom_loss_matches_cross_entropy(sdk):
    import torch

    data = [_datum([0, 10, 11, 12, 20, 21])]
    a = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    b = sdk.create_lora_training_client(base_model="tiny", rank=4).result()

    def nll(batch, logprobs):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum() for d, lp in zip(batch, logprobs))
        return loss, {"custom": float(loss.detach())}

    out = a.forward_backward_custom(data, nll).result()
    assert "custom" in out.metrics
    b.forward_backward(data, "cross_entropy").result()
    for tc in (a, b):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    la = a.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    lb = b.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6)


def test_sampling_sessions_and_prompt_logprobs(sdk, trained, server):
    _, _, sampler_path = trained
    sc = sdk.create_sampling_client(model_path=sampler_path).result()
    prompt = types.ModelInput.from_ints([0, 10, 11, 12])
    resp = sc.sample(prompt, 3, types.SamplingParams(max_tokens=2, seed=1), include_prompt_logprobs=True).result()
    assert len(resp.sequences) == 3 and resp.prompt_logprobs[0] is None and len(resp.prompt_logprobs) == 4
    assert all(isinstance(s.sequence_id, str) for s in resp.sequences)
    info = rest_client(server).get_sampler(sc._sampling_session_id).result()
    assert info.model_path == sampler_path and info.base_model == "tiny"
    base = sdk.create_sampling_client(base_model="tiny").result()
    assert len(base.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=1)).result().sequences[0].tokens) <= 2


def test_rest_runs_and_checkpoints(server, trained):
    tc, state, sampler = trained
    rest = rest_client(server)
    run_id = tinker.ParsedCheckpointTinkerPath.from_tinker_path(state).training_run_id
    runs = rest.list_training_runs().result().training_runs
    assert run_id in [r.training_run_id for r in runs]
    run = rest.get_training_run(run_id).result()
    assert run.lora_rank == 4 and run.model_owner == "alice" and run.last_checkpoint.tinker_path == state
    ckpts = rest.list_checkpoints(run_id).result().checkpoints
    assert {c.tinker_path for c in ckpts} == {state, sampler}
    assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} >= {state, sampler}
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    rest.publish_checkpoint_from_tinker_path(sampler).result()
    assert next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == sampler).public
    rest.unpublish_checkpoint_from_tinker_path(sampler).result()
    assert not next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == sampler).public
    rest.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    assert next(c for c in rest.list_checkpoints(run_id).result().checkpoints if c.tinker_path == state).expires_at
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    # SDK 0.38 asks this only of external_weights paths; the server answers it for any checkpoint with a
    # file:// URL of the checkpoint exported as a PEFT directory (the core RestClient's archive).
    r = httpx.get(f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/weights/ckpt/external_weights_urls",
                  headers={"X-API-Key": KEYS["alice"]})
    urls = types.ExternalWeightsUrlsResponse.model_validate(r.json()).urls
    from pathlib import Path
    from urllib.parse import urlparse

    assert (Path(urlparse(urls["peft"]).path) / "adapter_config.json").exists()
    extra = tc.save_weights_for_sampler("to-delete").result().path
    rest.delete_checkpoint_from_tinker_path(extra).result()
    assert extra not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("nope-train-0").result()
