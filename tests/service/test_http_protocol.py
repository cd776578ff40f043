"""Protocol surface of `dsv4flash serve` as the real tinker SDK 0.38 (and raw HTTP) uses it: health and auth,
capabilities, get_info's offline tokenizer, futures (try_again / 408 / 410 / RequestFailed / cancel), custom
losses, the REST surface for runs and checkpoints, and what retrying, careless or hostile clients send (a
create_model sent again, a name deleted and saved again, expired paths in another spelling, bad TTLs, damaged
checkpoint bytes)."""

from __future__ import annotations

import json
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


@pytest.fixture
def offline(monkeypatch):
    """No Hugging Face hub: a tokenizer must come from disk (huggingface_hub reads HF_HUB_OFFLINE once, at import,
    so its constant is set too)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_capabilities(server):
    caps = rest_client(server).get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    # one name: the HF directory served for the base (a name the SDK and tinker-cookbook load locally)
    assert len(names) == 1 and (Path(names[0]) / "tokenizer.json").is_file()
    assert all(m.trainable and m.sampleable for m in caps.supported_models)


def test_every_served_name_gives_an_offline_tokenizer(server, sdk, trained, offline):
    """Every listed name, and runs created as `tiny` (still accepted), give SamplingClients whose
    `get_tokenizer()` (the SDK's AutoTokenizer.from_pretrained(<base name>)) loads without the hub."""
    from dsv4flash.tasks.text_tokenizer import encode_task_text
    from dsv4flash.tasks import TaskTokenizer

    names = [m.model_name for m in rest_client(server).get_server_capabilities().result().supported_models]
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    samplers = {**{f"listed {n}": sdk.create_sampling_client(base_model=n).result() for n in names},
                "snapshot of a run created as tiny": tc.save_weights_and_get_sampling_client().result(),
                "checkpoint path": sdk.create_sampling_client(model_path=trained[2]).result()}
    text = "q : numbers 2, 8, 8 target 2 a :"
    for what, sampler in samplers.items():
        assert sampler.get_base_model() in names, what
        assert encode_task_text(sampler.get_tokenizer(), text) == TaskTokenizer("tiny").encode(text), what
    assert tc.get_info().model_data.model_name in names


def test_get_info_tokenizer_loads_offline(trained, monkeypatch):
    from dsv4flash.tasks.text_tokenizer import encode_task_text
    from dsv4flash.tasks import TaskTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tc, _, _ = trained
    info = tc.get_info()
    assert info.model_data.model_name == info.model_data.tokenizer_id and info.lora_rank == 4 and info.is_lora
    tok = tc.get_tokenizer()  # the SDK's AutoTokenizer.from_pretrained(tokenizer_id): a local directory
    text = "how many red circles in the <image>? 12"
    assert encode_task_text(tok, text) == TaskTokenizer("tiny").encode(text)
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
    assert info.model_path == sampler_path and Path(info.base_model, "tokenizer.json").is_file()  # the served name
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
    # SDK 0.38 asks this only of external_weights paths; the server answers it for any readable checkpoint with a
    # signed HTTP URL per file of the checkpoint exported as a PEFT directory
    r = httpx.get(f"{server.url}/api/v1/training_runs/{run_id}/checkpoints/weights/ckpt/external_weights_urls",
                  headers={"X-API-Key": KEYS["alice"]})
    urls = types.ExternalWeightsUrlsResponse.model_validate(r.json()).urls
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls)
    assert all(u.startswith(f"{server.url}/api/v1/downloads/") for u in urls.values())
    extra = tc.save_weights_for_sampler("to-delete").result().path
    rest.delete_checkpoint_from_tinker_path(extra).result()
    assert extra not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("nope-train-0").result()


# ---- retrying, careless and hostile clients ----
def _finish(server, answer, tenant="alice"):
    """The final retrieve_future answer of a queued request."""
    assert answer.status_code == 200, answer.text
    while True:
        r = _post(server, "retrieve_future", tenant, json={"request_id": answer.json()["request_id"]})
        if r.status_code != 408 and r.json().get("type") != "try_again":
            return r


def _asample_body(model_path, tokens, **extra):
    return {"model_path": model_path, "num_samples": 1, "prompt": {"chunks": [
        {"type": "encoded_text", "tokens": list(tokens)}]}, "sampling_params": {"max_tokens": 1, "seed": 0}, **extra}


def test_an_expired_checkpoint_is_gone_in_every_spelling_of_its_path(server, sdk):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    path = tc.save_weights_for_sampler("brief", ttl_seconds=1).result().path
    time.sleep(1.2)  # past the TTL; no listing meanwhile (a listing deletes the name: this tests the expiry itself)
    session = tc.model_id.split(":", 1)[0]
    for spelling in (path, path.replace("tinker://", "mint://", 1)):
        answers = {"weights_info": _post(server, "weights_info", json={"tinker_path": spelling}),
                   "asample": _post(server, "asample", json=_asample_body(spelling, [0, 10])),
                   "sampling session": _post(server, "create_sampling_session", json={
                       "session_id": session, "sampling_session_seq_id": 90, "model_path": spelling}),
                   "load_weights": _post(server, "load_weights", json={
                       "model_id": tc.model_id, "path": spelling, "optimizer": False})}
        for what, r in answers.items():
            assert r.status_code == 404 and "expired" in r.json()["detail"], (spelling, what, r.status_code, r.text)


def test_bad_ttl_values_are_refused_naming_the_field_and_listings_stay_whole(server, trained):
    tc, state, _ = trained
    run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(state).training_run_id
    ttl_url = f"{server.url}/api/v1/training_runs/{run}/checkpoints/weights/ckpt/ttl"
    for bad in (10**30, True, "60", 0, -1, 1.5, 10 * 365 * 24 * 3600 + 1):
        r = httpx.put(ttl_url, json={"ttl_seconds": bad}, headers={"X-API-Key": KEYS["alice"]})
        assert r.status_code == 400 and r.json()["field"] == "ttl_seconds", (bad, r.text)
        for route in ("save_weights", "save_weights_for_sampler", "save_weights_external"):
            r = _post(server, route, json={"model_id": tc.model_id, "path": "never", "ttl_seconds": bad})
            assert r.status_code == 400 and r.json()["field"] == "ttl_seconds", (route, bad, r.text)
    listed = rest_client(server).list_user_checkpoints().result().checkpoints
    assert state in {c.tinker_path for c in listed} and not any(c.checkpoint_id.endswith("/never") for c in listed)
    assert httpx.put(ttl_url, json={"ttl_seconds": 3600}, headers={"X-API-Key": KEYS["alice"]}).status_code == 200
    assert httpx.put(ttl_url, json={"ttl_seconds": None}, headers={"X-API-Key": KEYS["alice"]}).status_code == 200


def test_a_corrupted_checkpoint_is_the_same_clear_error_from_every_reader(server, sdk):
    import os

    from dsv4flash.lifecycle import AdapterStore

    tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=41).result()
    path = tc.save_state("damaged").result().path
    run = tinker.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
    with AdapterStore.open(server.store) as store:
        blob = store.blobs.path(store.resolve(f"{run}:weights.damaged").id)
    os.chmod(blob, 0o644)
    damaged = bytearray(blob.read_bytes())
    damaged[-1] ^= 0xFF  # one bit of tensor data: the header still parses, the hash does not match
    blob.write_bytes(bytes(damaged))
    answers = {"weights_info": _post(server, "weights_info", json={"tinker_path": path}),
               "asample": _post(server, "asample", json=_asample_body(path, [0, 10])),
               "sampling session": _post(server, "create_sampling_session", json={
                   "session_id": tc.model_id.split(":", 1)[0], "sampling_session_seq_id": 91, "model_path": path}),
               "archive": httpx.get(f"{server.url}/api/v1/training_runs/{run}/checkpoints/weights/damaged/"
                                    f"external_weights_urls", headers={"X-API-Key": KEYS["alice"]}),
               "archive (SDK 0.22)": httpx.get(f"{server.url}/api/v1/training_runs/{run}/checkpoints/weights/"
                                               f"damaged/archive", headers={"X-API-Key": KEYS["alice"]})}
    for what, r in answers.items():
        assert r.status_code == 500 and r.headers.get("x-should-retry") == "false", (what, r.status_code, r.text)
    details = {r.json()["detail"] for r in answers.values()}
    assert len(details) == 1, details
    message = details.pop()
    assert message.startswith(f"checkpoint {path}: its stored bytes are damaged") and "\n" not in message
    with pytest.raises(tinker.RequestFailedError) as failed:  # load_weights reports it through its future
        sdk.create_training_client_from_state(path).result()
    assert message in str(failed.value)


def test_retried_create_model_returns_the_live_run_never_a_fresh_one(server, sdk):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    data = [_datum([0, 10, 11, 12, 20])]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    session, _, seq = tc.model_id.partition(":train:")
    sent = {"session_id": session, "model_seq_id": int(seq), "base_model": "tiny", "lora_config": {"rank": 4}}
    again = _finish(server, _post(server, "create_model", json=sent))  # what the SDK sent, sent again
    assert again.json()["model_id"] == tc.model_id, again.text
    assert tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == trained
    tc.forward_backward(data, "cross_entropy").result()
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["step"] == 2.0  # Adam state kept
    other = _post(server, "create_model", json={**sent, "lora_config": {"rank": 8}})
    assert other.status_code == 409 and other.json()["field"] == "model_seq_id", other.text
    assert other.headers["x-should-retry"] == "false"  # the SDK would otherwise retry a 409
    assert tc.get_info().lora_rank == 4


def test_a_name_deleted_and_saved_again_is_sampled_with_its_new_weights(server, sdk):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=31).result()
    data, prompt = [_datum([0, 10, 11, 12, 20])], [0, 10, 11, 12]

    def step():
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    def stateless(path):  # asample by path: the server keeps a sampler per checkpoint between such calls
        out = _finish(server, _post(server, "asample", json=_asample_body(path, prompt, prompt_logprobs=True)))
        return np.asarray(out.json()["prompt_logprobs"][1:], dtype=np.float32)

    step()
    path = tc.save_weights_for_sampler("reused").result().path
    old = stateless(path)
    rest_client(server).delete_checkpoint_from_tinker_path(path).result()
    step()
    assert tc.save_weights_for_sampler("reused").result().path == path
    fresh = sdk.create_sampling_client(model_path=path).result()  # a new sampling session reads the path now
    new = fresh.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    new = np.asarray(new[1:], dtype=np.float32)
    assert not np.array_equal(new, old)  # the second save holds other weights
    assert np.array_equal(stateless(path), new)


# ---- key forms, downloads and the served tokenizer ----
def test_which_key_form_sdk_038_accepts(server, monkeypatch):
    """SDK 0.38 takes `tml-` keys and JWTs as `api_key`; an `sk-` key it refuses itself, before connecting (the
    closed port below is never dialled); through `TINKER_CREDENTIAL_CMD` every form works, the `sk-` key too, since
    the SDK then trades what the command prints for a JWT at `/auth/token`."""
    import shlex
    import sys

    from tinker import TinkerError

    for var in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD"):
        monkeypatch.delenv(var, raising=False)
    refused = tinker.ServiceClient(base_url="http://127.0.0.1:1", api_key=KEYS["mallory"])  # connects lazily
    with pytest.raises(TinkerError, match="must start with the 'tml-' prefix"):
        refused.create_lora_training_client(base_model="tiny", rank=4).result()
    jwt = _post(server, "auth/token", tenant="mallory", json={}).json()["jwt"]
    assert jwt.startswith("eyJ")
    owners = {}
    for form, key in (("tml-", KEYS["alice"]), ("JWT", jwt)):
        with tinker.ServiceClient(base_url=server.url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
            run = tinker.RestClient(base_url=server.url, api_key=key).get_training_run(tc.model_id).result()
            owners[form] = run.model_owner
    for form, key in (("tml-", KEYS["alice"]), ("JWT", jwt), ("sk-", KEYS["mallory"])):
        print_key = f"print({key!r})"
        monkeypatch.setenv("TINKER_CREDENTIAL_CMD", f"{shlex.quote(sys.executable)} -c {shlex.quote(print_key)}")
        with tinker.ServiceClient(base_url=server.url) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4).result()
            # this ServiceClient's own RestClient: a bare RestClient() keeps the process's first credential holder
            run = sc.create_rest_client().get_training_run(tc.model_id).result()
            owners[f"{form} via TINKER_CREDENTIAL_CMD"] = run.model_owner
    assert owners == {"tml-": "alice", "JWT": "mallory", "tml- via TINKER_CREDENTIAL_CMD": "alice",
                      "JWT via TINKER_CREDENTIAL_CMD": "mallory", "sk- via TINKER_CREDENTIAL_CMD": "mallory"}


def test_keys_add_sk_says_which_clients_take_it(tmp_path, capsys):
    import argparse

    from dsv4flash.service.plane.keys import KeyRing
    from dsv4flash.service.protocol import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    path = tmp_path / "keys"
    assert serve.run(parser.parse_args(["keys", "add", "carol", "--keys", str(path), "--prefix", "sk-"])) == 0
    out = capsys.readouterr()
    assert KeyRing.load(path).tenant(out.out.strip()) == "carol" and out.out.startswith("sk-")
    assert "TINKER_CREDENTIAL_CMD" in out.err and "refuse sk- keys given as api_key" in out.err


def _download_cli(server, path, output, key=KEYS["alice"]):
    """`tinker checkpoint download PATH --output DIR`: the SDK 0.38 console script, as a user runs it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": key, "OMP_NUM_THREADS": "1"}
    env.pop("TINKER_CREDENTIAL_CMD", None)
    return subprocess.run([str(Path(sys.executable).with_name("tinker")), "--format", "json", "checkpoint",
                           "download", path, "--output", str(output)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_tinker_checkpoint_download_gives_a_peft_adapter(server, sdk, trained, tmp_path):
    """The CLI exports the training checkpoint through a temporary external_weights checkpoint, downloads its
    files over the signed URLs and deletes the export; the directory loads in transformers + PEFT and scores a
    prompt as the server does."""
    from tests.service.http_server import peft_prompt_logprobs, served_tiny_base

    _, state, _ = trained
    done = _download_cli(server, state, tmp_path / "out")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    adapter = tmp_path / "out" / state.replace("tinker://", "").replace("/", "_")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    # the SDK's train_unembed=True default: the export carries the output head's LoRA, which PEFT loads below
    assert "head" in json.loads((adapter / "adapter_config.json").read_text())["target_modules"].split("|")
    tokens = [0, 10, 11, 12, 20, 21, 22]
    served = sdk.create_sampling_client(model_path=state).result().compute_logprobs(
        types.ModelInput.from_ints(tokens)).result()[1:]
    ours = peft_prompt_logprobs(served_tiny_base(tmp_path / "base"), adapter, tokens)
    np.testing.assert_allclose(ours, served, rtol=0, atol=1e-5)
    runs = rest_client(server).list_user_checkpoints().result().checkpoints
    assert not [c for c in runs if c.checkpoint_type == "external"]  # the CLI deleted its temporary export


def test_download_urls_are_signed_expiring_and_checked_at_every_download(server, sdk, tmp_path):
    """`save_weights_external` + `get_external_weights_urls` (SDK 0.38's own calls): the URLs need no API key,
    refuse a changed signature, and stop working as soon as the checkpoint is deleted."""
    from dsv4flash.service.plane.downloads import DownloadSigner, ExpiredGrant
    from dsv4flash.service.plane.keys import SecretFileError

    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    path = tc.save_weights_external("export").result().path
    assert path == f"tinker://{tc.model_id.replace(':', '-')}/external_weights/export"
    rest = rest_client(server)
    listed = rest.list_checkpoints(tc.model_id.replace(":", "-")).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("external", path)]
    urls = rest.get_external_weights_urls(path).result().urls
    weights = httpx.get(urls["adapter_model.safetensors"])
    assert weights.status_code == 200 and weights.content[:8]  # safetensors header length
    token = urls["adapter_config.json"].split("/downloads/")[1].split("/")[0]
    forged = urls["adapter_config.json"].replace(token, token[:-2] + ("AA" if not token.endswith("AA") else "BB"))
    assert httpx.get(forged).status_code == 403
    assert httpx.get(urls["adapter_config.json"].rsplit("/", 1)[0] + "/nope.bin").status_code == 404
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(urls["adapter_config.json"]).status_code == 404  # checked again at every download
    # a name saved again holds other weights: URLs signed for the old revision stop, new ones serve the new bytes
    state = tc.save_state("again").result().path
    run, name = state.split("/")[2], state.split("/")[-1]
    signed = httpx.get(f"{server.url}/api/v1/training_runs/{run}/checkpoints/weights/{name}/external_weights_urls",
                       headers={"X-API-Key": KEYS["alice"]}).json()["urls"]["adapter_model.safetensors"]
    first = httpx.get(signed).content
    tc.forward_backward([_datum([0, 10, 11, 12, 20])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.save_state("again", overwrite=True).result().path == state
    assert httpx.get(signed).status_code == 404
    resigned = httpx.get(f"{server.url}/api/v1/training_runs/{run}/checkpoints/weights/{name}/external_weights_urls",
                         headers={"X-API-Key": KEYS["alice"]}).json()["urls"]["adapter_model.safetensors"]
    assert httpx.get(resigned).content != first
    signer = DownloadSigner(tmp_path / "secret", ttl_s=60)
    grant, expires = signer.sign("alice", path, "rev", now=1000.0)
    assert expires == 1060.0 and signer.sign("alice", path, "rev", not_after=1010.0, now=1000.0)[1] == 1010.0
    assert signer.verify(grant, now=1059.0).tenant == "alice"
    with pytest.raises(ExpiredGrant):
        signer.verify(grant, now=1060.0)
    (tmp_path / "short").write_bytes(b"x" * 8)
    with pytest.raises(SecretFileError, match="short: the download secret is 8 bytes, expected at least 32"):
        DownloadSigner(tmp_path / "short")


def test_served_tokenizer_encodes_any_text_and_the_cookbook_renderers_build_data(sdk, trained, offline):
    """The tokenizer the SDK loads encodes any text and decodes it back exactly (byte fallback), task words keep
    their ids, and tinker-cookbook's chat renderers build data and sample with it (their stop strings included)."""
    from tinker_cookbook import renderers

    from dsv4flash.tasks.text_tokenizer import decode_task_text, encode_task_text
    from dsv4flash.tasks import TaskTokenizer

    tc, _, sampler_path = trained
    tok = tc.get_tokenizer()
    task = TaskTokenizer("tiny")
    for text in ("the quick brown fox", "The Quick  brown\n\nfox:\t12+7=19 ünïcødé 🦊 ", "<｜User｜>hi</think>", ""):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text and all(0 <= i < task.vocab_size for i in ids), text
    assert tok.encode("the", add_special_tokens=False) == task.encode("the")  # a task word keeps its id
    text = "q : numbers 2, 8, 18 target 2 a : what is <image> ?"
    assert encode_task_text(tok, text) == task.encode(text)
    assert decode_task_text(tok, task.encode(text)) == task.decode(task.encode(text))
    conversation = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    for name in ("role_colon", "deepseekv4_1_disable_thinking"):
        renderer = renderers.get_renderer(name, tok)
        model_input, weights = renderer.build_supervised_example(conversation)
        ids = model_input.to_ints()
        assert weights.sum() > 0 and all(0 <= i < task.vocab_size for i in ids), name
        assert "What is 2+2?" in tok.decode(ids) and "4" in tok.decode(ids), name
    deepseek = renderers.get_renderer("deepseekv4_1_disable_thinking", tok)
    prompt = deepseek.build_generation_prompt(conversation[:1])
    assert prompt.to_ints() == tok.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)  # the served chat template
    sampler = sdk.create_sampling_client(model_path=sampler_path).result()
    role_colon = renderers.get_renderer("role_colon", tok)
    for r in (role_colon, deepseek):
        out = sampler.sample(r.build_generation_prompt(conversation[:1]), 1,
                             types.SamplingParams(max_tokens=3, seed=0, stop=r.get_stop_sequences())).result()
        assert 1 <= len(out.sequences[0].tokens) <= 3


def test_rank_preset_and_train_unembed_through_the_sdk(server, sdk, trained):
    """The SDK always sends a rank (32 unless given) and train_unembed (True unless given): the preset comes from
    user_metadata["dsv4flash_preset"], a rank it does not fix wins, a rank that contradicts it is a 400 naming
    lora_config.rank, and train_unembed puts a LoRA on the output head (reported by weights_info)."""
    r8 = {"dsv4flash_preset": "full_linear_r8"}
    r8_run = sdk.create_lora_training_client(base_model="tiny", rank=8, user_metadata=r8).result()
    assert r8_run.get_info().lora_rank == 8
    assert sdk.create_lora_training_client(base_model="tiny", user_metadata={"dsv4flash_preset": "decoder_half"}
                                           ).result().get_info().lora_rank == 32
    with pytest.raises(tinker.BadRequestError, match="lora_config.rank: 32 conflicts with preset 'full_linear_r8'"):
        sdk.create_lora_training_client(base_model="tiny", user_metadata=r8).result()
    sid = _post(server, "create_session", json={"tags": [], "user_metadata": None, "sdk_version": "x"}).json()
    body = {"session_id": sid["session_id"], "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
    r = _post(server, "create_model", json={**body, "user_metadata": r8})
    assert r.status_code == 400 and r.json()["field"] == "lora_config.rank", r.text
    r = _post(server, "create_model", json={**body, "user_metadata": {"dsv4flash_preset": "nope"}})
    assert r.status_code == 400 and r.json()["field"] == "user_metadata.dsv4flash_preset", r.text
    _, state, _ = trained
    rest = rest_client(server)
    assert rest.get_weights_info_by_tinker_path(state).result().train_unembed is True
    off = sdk.create_lora_training_client(base_model="tiny", rank=4, train_unembed=False).result()
    path = off.save_state("no-head").result().path
    assert rest.get_weights_info_by_tinker_path(path).result().train_unembed is False
