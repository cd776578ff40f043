"""Server-side memory stays bounded: snapshot samplers per tenant are capped (oldest dropped), and finishing a
session unloads its models and samplers (runs and checkpoints stay); `dsv4flash serve` user errors exit 2."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import tinker
from tinker import types

from tests.service.http_server import KEYS, rest_client, running_server, service_client, write_keys


def test_sampler_cap_and_session_finish_free_memory(tmp_path):
    with running_server(tmp_path / "store", write_keys(tmp_path / "keys"), args=("--max-samplers", "2")) as srv:
        sdk = service_client(srv)
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
        samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(3)]
        prompt, params = types.ModelInput.from_ints([0, 10]), types.SamplingParams(max_tokens=1, seed=0)
        for s in samplers[1:]:
            assert len(s.sample(prompt, 1, params).result().sequences) == 1
        gone = httpx.get(f"{srv.url}/api/v1/samplers/{samplers[0]._sampling_session_id}",
                         headers={"X-API-Key": KEYS["alice"]})
        assert gone.status_code == 404  # the oldest snapshot was dropped
        path = tc.save_state("kept").result().path
        sdk.close("success").result()  # POST /sessions/{id}/finish
        r = httpx.post(f"{srv.url}/api/v1/get_info", json={"model_id": tc.model_id},
                       headers={"X-API-Key": KEYS["alice"]})
        assert r.status_code == 404 and "not loaded" in r.json()["detail"]
        run = path.split("/")[2]
        assert path in {c.tinker_path for c in rest_client(srv).list_checkpoints(run).result().checkpoints}
        with service_client(srv) as again:  # a new session resumes from the kept checkpoint
            assert again.create_training_client_from_state(path).result().get_info().lora_rank == 4
        assert isinstance(tc, tinker.TrainingClient)


@pytest.mark.parametrize("args,message", [
    (["--keys", "{tmp}/missing"], "cannot read the keys file"),
    (["--keys", "{tmp}/bad"], "bad:1:"),
    (["--base", "{tmp}/nowhere"], "neither a flavour"),
    (["keys", "remove", "x"], "unknown action"),
    (["keys", "add", "alice"], "--keys FILE is required"),
    (["--store", "{tmp}/empty-secret"], "jwt_secret: the JWT signing secret is 0 bytes, expected at least 32"),
    (["--store", "{tmp}/short-secret"], "download_secret: the download secret is 8 bytes, expected at least 32"),
])
def test_serve_user_errors_exit_2_without_traceback(tmp_path, args, message):
    (tmp_path / "bad").write_text("only-one-field\n")
    (tmp_path / "empty-secret" / "service").mkdir(parents=True)
    (tmp_path / "empty-secret" / "service" / "jwt_secret").write_bytes(b"")  # signs tokens anyone can forge
    (tmp_path / "short-secret" / "service").mkdir(parents=True)
    (tmp_path / "short-secret" / "service" / "download_secret").write_bytes(b"x" * 8)  # download URLs guessable
    argv = [a.format(tmp=tmp_path) for a in args]
    done = subprocess.run([sys.executable, "-m", "dsv4flash", "serve", "--store", str(tmp_path / "s"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_silent_session_times_out_and_unloads_its_models(tmp_path):
    import time

    with running_server(tmp_path / "store", write_keys(tmp_path / "keys"),
                        args=("--session-timeout-s", "2")) as srv:
        h = {"X-API-Key": KEYS["alice"]}
        sid = httpx.post(f"{srv.url}/api/v1/create_session", headers=h, json={
            "tags": [], "user_metadata": None, "sdk_version": "raw"}).json()["session_id"]
        rid = httpx.post(f"{srv.url}/api/v1/create_model", headers=h, json={
            "session_id": sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}).json()
        while "model_id" not in httpx.post(f"{srv.url}/api/v1/retrieve_future", headers=h, json={
                "request_id": rid["request_id"]}).json():
            pass
        info = lambda: httpx.post(f"{srv.url}/api/v1/get_info", headers=h, json={"model_id": rid["model_id"]})  # noqa: E731
        assert info().status_code == 200
        time.sleep(3)  # no heartbeat: the client is gone
        assert httpx.post(f"{srv.url}/api/v1/session_heartbeat", headers=h,
                          json={"session_id": sid}).status_code == 410  # the SDK stops its heartbeat loop on 410
        assert info().status_code == 404
        with service_client(srv) as sdk:  # a live SDK session (heartbeats every 10 s) is not reaped meanwhile
            tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
            assert tc.get_info().lora_rank == 4


def test_default_keys_file_is_made_once_and_kept(tmp_path):
    import re

    from dsv4flash.service.protocol.launch import ServerProcess

    with ServerProcess(tmp_path / "store", None) as srv:
        key = re.search(r"\n  (tml-\S+)", srv.log()).group(1)  # printed once, on first start
        assert httpx.get(f"{srv.url}/api/v1/training_runs", headers={"X-API-Key": key}).status_code == 200
    stored = (tmp_path / "store" / "service" / "keys").read_text()
    assert key not in stored and stored.startswith("default sha256:")
    with ServerProcess(tmp_path / "store", None) as again:  # restart: same keys file, no new key printed
        assert httpx.get(f"{again.url}/api/v1/training_runs", headers={"X-API-Key": key}).status_code == 200
        assert again.log().count("new API key") == 1
