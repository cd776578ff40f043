"""Tenants and keys of `dsv4flash serve`: the keys file, `serve keys add`, hashes only, and cross-tenant probes on
every endpoint that takes a run, model, checkpoint, sampler, session or future id (all answered as not found);
published checkpoints readable across tenants."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from dsv4flash.service.plane.keys import KeyFileError, KeyRing, add_key, key_hash
from tests.service.http_server import KEYS, rest_client, running_server, service_client, write_keys


# ---- keys file ----
def test_keys_file_plain_and_hashed(tmp_path):
    ring = KeyRing.load(write_keys(tmp_path / "keys"))
    assert ring.tenant(KEYS["alice"]) == "alice" and ring.tenant(KEYS["bob"]) == "bob"
    assert ring.tenant(KEYS["mallory"]) == "mallory" and ring.tenant("tml-other") is None and ring.tenant(None) is None
    assert KEYS["alice"] not in repr(vars(ring))  # only the hash is kept


@pytest.mark.parametrize("line,error", [("alice", "expected"), ("al ice tml-x", "expected"),
                                        ("alice sha256:abc", "64 lowercase hex"), ("alice hunter2", "must start"),
                                        ("a/b tml-x", "expected")])
def test_malformed_keys_line_names_file_and_line(tmp_path, line, error):
    path = tmp_path / "keys"
    path.write_text(f"# header\nbob tml-fine\n{line}\n")
    with pytest.raises(KeyFileError, match=rf"keys:3: .*{error}"):
        KeyRing.load(path)


def test_same_key_for_two_tenants_is_refused(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"alice tml-shared\nbob sha256:{key_hash('tml-shared')}\n")
    with pytest.raises(KeyFileError, match="already given to tenant 'alice'"):
        KeyRing.load(path)


def test_keys_add_cli_prints_the_key_once_and_stores_its_hash(tmp_path):
    path = tmp_path / "keys"
    out = subprocess.run([sys.executable, "-m", "dsv4flash", "serve", "keys", "add", "carol", "--keys", str(path)],
                         capture_output=True, text=True, check=True)
    key = out.stdout.strip()
    assert key.startswith("tml-") and key not in path.read_text()
    assert path.read_text() == f"carol sha256:{key_hash(key)}\n"
    assert KeyRing.load(path).tenant(key) == "carol"
    key2 = add_key(path, "carol", prefix="sk-")  # MinT-style key, appended
    assert KeyRing.load(path).tenant(key2) == "carol" and len(KeyRing.load(path)) == 2
    bad = subprocess.run([sys.executable, "-m", "dsv4flash", "serve", "keys", "add", "no/pe", "--keys", str(path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "tenant" in bad.stderr


# ---- cross-tenant probes ----
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A server; alice's run with a private and a published checkpoint, a sampler and a finished future."""
    root = tmp_path_factory.mktemp("tenants")
    with running_server(root / "store", write_keys(root / "keys")) as srv, service_client(srv, "alice") as sdk:
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
        d = types.Datum(model_input=types.ModelInput.from_ints([0, 10, 11]),
                        loss_fn_inputs={"target_tokens": np.array([10, 11, 12]),
                                        "weights": np.ones(3, dtype=np.float32)})
        tc.forward_backward([d], "cross_entropy").result()
        private = tc.save_state("private").result().path
        public = tc.save_weights_for_sampler("public").result().path
        rest_client(srv, "alice").publish_checkpoint_from_tinker_path(public).result()
        sampler = sdk.create_sampling_client(model_path=private).result()
        r = httpx.post(f"{srv.url}/api/v1/optim_step", headers={"X-API-Key": KEYS["alice"]},
                       json={"model_id": tc.model_id, "adam_params": {"learning_rate": 1e-3}})
        future_id = r.json()["request_id"]
        yield dict(server=srv, tc=tc, d=d, private=private, public=public, sampler=sampler._sampling_session_id,
                   future=future_id, session=sdk.holder.get_session_id())


def _as(world, tenant, method, path, **kw):
    return httpx.request(method, f"{world['server'].url}/api/v1/{path}", headers={
        "X-API-Key": KEYS[tenant], **kw.pop("headers", {})}, timeout=30, **kw)


def _bob_session(world) -> str:
    r = _as(world, "bob", "POST", "create_session", json={"tags": [], "user_metadata": None, "sdk_version": "t"})
    return r.json()["session_id"]


def _fb_body(model_id, d):
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[d], loss_fn="cross_entropy"), model_id=model_id, seq_id=1)
    return forward_backward_request_to_proto(req).SerializeToString()


def test_every_id_taking_endpoint_refuses_another_tenant(world):
    tc, mid, priv = world["tc"], world["tc"].model_id, world["private"]
    run, kind_name = priv.split("/")[2], "/".join(priv.split("/")[3:])
    bob_sid = _bob_session(world)
    bob_model = f"{bob_sid}:train:0"
    created = _as(world, "bob", "POST", "create_model", json={
        "session_id": bob_sid, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}})
    while "model_id" not in (done := _as(world, "bob", "POST", "retrieve_future",
                                         json={"request_id": created.json()["request_id"]}).json()):
        assert done.get("type") == "try_again", done
    assert _as(world, "bob", "POST", "get_info", json={"model_id": bob_model}).status_code == 200
    probes = {
        "create_model in alice's session": ("POST", "create_model", dict(json={
            "session_id": world["session"], "model_seq_id": 99, "base_model": "tiny"})),
        "session_heartbeat": ("POST", "session_heartbeat", dict(json={"session_id": world["session"]})),
        "finish session": ("POST", f"sessions/{world['session']}/finish", dict(json={})),
        "get_info": ("POST", "get_info", dict(json={"model_id": mid})),
        "forward_backward": ("POST", "forward_backward", dict(content=_fb_body(mid, world["d"]),
                                                              headers={"Content-Type": "application/x-protobuf"})),
        "optim_step": ("POST", "optim_step", dict(json={"model_id": mid, "adam_params": {}})),
        "save_weights": ("POST", "save_weights", dict(json={"model_id": mid, "path": "x"})),
        "save_weights_for_sampler": ("POST", "save_weights_for_sampler", dict(json={"model_id": mid, "path": "x"})),
        "load_weights into alice's model": ("POST", "load_weights", dict(json={
            "model_id": mid, "path": priv, "optimizer": False})),
        "load alice's checkpoint into bob's model": ("POST", "load_weights", dict(json={
            "model_id": bob_model, "path": priv, "optimizer": True})),
        "create from alice's checkpoint": ("POST", "load_weights", dict(json={
            "session_id": bob_sid, "model_seq_id": 5, "path": priv, "optimizer": True})),
        "sampling session on alice's checkpoint": ("POST", "create_sampling_session", dict(json={
            "session_id": bob_sid, "sampling_session_seq_id": 0, "model_path": priv})),
        "join alice's sampler": ("POST", "join_sampling_session", dict(json={"sampling_session_id": world["sampler"]})),
        "get alice's sampler": ("GET", f"samplers/{world['sampler']}", {}),
        "sample alice's sampler": ("POST", "asample", dict(json={
            "sampling_session_id": world["sampler"], "seq_id": 0, "prompt": {"chunks": [
                {"type": "encoded_text", "tokens": [0, 10]}]}, "sampling_params": {"max_tokens": 1}})),
        "sample alice's checkpoint": ("POST", "asample", dict(json={
            "model_path": priv, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [0, 10]}]},
            "sampling_params": {"max_tokens": 1}})),
        "get run": ("GET", f"training_runs/{run}", {}),
        "list run checkpoints": ("GET", f"training_runs/{run}/checkpoints", {}),
        "delete checkpoint": ("DELETE", f"training_runs/{run}/checkpoints/{kind_name}", {}),
        "publish": ("POST", f"training_runs/{run}/checkpoints/{kind_name}/publish", {}),
        "unpublish the published one": ("DELETE", f"training_runs/{run}/checkpoints/sampler_weights/public/publish",
                                        {}),
        "ttl": ("PUT", f"training_runs/{run}/checkpoints/{kind_name}/ttl", dict(json={"ttl_seconds": 3600})),
        "archive url": ("GET", f"training_runs/{run}/checkpoints/{kind_name}/external_weights_urls", {}),
        "archive (SDK 0.22)": ("GET", f"training_runs/{run}/checkpoints/{kind_name}/archive", {}),
        "save_weights_external of alice's model": ("POST", "save_weights_external", dict(json={
            "model_id": mid, "path": "stolen"})),
        "weights_info": ("POST", "weights_info", dict(json={"tinker_path": priv})),
        "MinT reverse KL on alice's model": ("POST", "mint/forward_backward_reverse_kl", dict(json={
            "model_id": mid, "reference_model_path": world["public"], "data": []})),
        "MinT reverse KL against alice's private checkpoint": ("POST", "mint/forward_backward_reverse_kl", dict(json={
            "model_id": bob_model, "reference_model_path": priv, "data": []})),
        "MinT interpolate alice's private checkpoint": ("POST", "mint/checkpoints/interpolate", dict(json={
            "source_paths": [priv], "coefficients": [1.0]})),
        "MinT interpolate into alice's run": ("POST", "mint/checkpoints/interpolate", dict(json={
            "source_paths": [world["public"]], "coefficients": [1.0],
            "output_path": f"tinker://{run}/sampler_weights/stolen"})),
    }
    for what, (method, path, kw) in probes.items():
        r = _as(world, "bob", method, path, **kw)
        assert r.status_code == 404 and "not found" in r.json()["detail"], (what, r.status_code, r.text)
    # futures: another tenant's id polls exactly like an id never issued; cancelling it does nothing
    theirs = _as(world, "bob", "POST", "retrieve_future", json={"request_id": world["future"]})
    never = _as(world, "bob", "POST", "retrieve_future", json={"request_id": "optim_step-00000000-1"})
    assert theirs.status_code == never.status_code == 410
    assert _as(world, "bob", "POST", "cancel_future", json={"request_id": world["future"]}).status_code == 200
    mine = _as(world, "alice", "POST", "retrieve_future", json={"request_id": world["future"]}).json()
    assert "metrics" in mine, mine
    # listings hold only the caller's own runs and checkpoints
    assert run not in {r.training_run_id for r in rest_client(world["server"], "bob").list_training_runs().result()
                       .training_runs}
    assert not any(c.tinker_path.split("/")[2] == run
                   for c in rest_client(world["server"], "bob").list_user_checkpoints().result().checkpoints)
    with pytest.raises(tinker.NotFoundError):
        rest_client(world["server"], "bob").get_training_run(run).result()
    # nothing of alice's changed
    assert {c.tinker_path for c in rest_client(world["server"], "alice").list_checkpoints(run).result()
            .checkpoints} == {priv, world["public"]}
    assert tc.get_info().model_id == mid


def test_published_checkpoint_is_readable_across_tenants(world):
    srv, public = world["server"], world["public"]
    with service_client(srv, "bob") as bob:
        sampler = bob.create_sampling_client(model_path=public).result()
        out = sampler.sample(types.ModelInput.from_ints([0, 10, 11]), 1, types.SamplingParams(max_tokens=2, seed=0))
        assert len(out.result().sequences[0].tokens) <= 2
        assert rest_client(srv, "bob").get_weights_info_by_tinker_path(public).result().lora_rank == 4
    urls = _as(world, "bob", "GET", f"training_runs/{public.split('/')[2]}/checkpoints/sampler_weights/public/"
                                    f"external_weights_urls").json()["urls"]
    assert httpx.get(urls["adapter_config.json"]).json()["peft_type"] == "LORA"  # signed for bob, no key sent
    # readable is not writable: unpublishing or deleting it stays alice's
    assert _as(world, "mallory", "DELETE", "training_runs/{}/checkpoints/sampler_weights/public".format(
        public.split("/")[2])).status_code == 404


@pytest.mark.parametrize("secret", [b"", b"x" * 31])
def test_an_empty_or_short_jwt_secret_is_refused(tmp_path, secret):
    from dsv4flash.service.plane.keys import SecretFileError, TokenSigner

    path = tmp_path / "jwt_secret"
    path.write_bytes(secret)  # with b"" any client could sign a token for any tenant
    with pytest.raises(SecretFileError, match=rf"jwt_secret: the JWT signing secret is {len(secret)} bytes, "
                                              rf"expected at least 32"):
        TokenSigner(path)
    assert path.read_bytes() == secret  # refused, not silently replaced


def test_key_to_jwt_exchange(world, tmp_path):
    from dsv4flash.service.plane.keys import TokenSigner

    jwt = _as(world, "mallory", "POST", "auth/token", json={}).json()["jwt"]
    assert jwt.startswith("eyJ")
    url = f"{world['server'].url}/api/v1/training_runs"
    assert httpx.get(url, headers={"X-API-Key": jwt}).status_code == 200
    forged = jwt[:-4] + ("AAAA" if not jwt.endswith("AAAA") else "BBBB")
    assert httpx.get(url, headers={"X-API-Key": forged}).status_code == 401
    signer = TokenSigner(tmp_path / "secret", ttl_s=60)
    token = signer.issue("carol", now=1000.0)
    assert signer.tenant(token, now=1059.0) == "carol" and signer.tenant(token, now=1061.0) is None
    assert TokenSigner(tmp_path / "other").tenant(token, now=1000.0) is None  # another server's secret
