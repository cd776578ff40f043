"""MinT's client, `import mint` (mindlab-toolkit 0.2.0 on its pinned tinker 0.22.0, from a separate target
directory), against the same `dsv4flash serve` the 0.38 SDK uses: an `sk-` key through the key -> JWT exchange,
`MINT_BASE_URL`, a training loop, and MinT's two extensions — each result equal to the in-process core's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.service.http_server import KEYS, running_server, write_keys

ROOT = Path(__file__).resolve().parents[2]
MINT_SDK = Path(os.environ.get("DSV4FLASH_MINT_SDK", ROOT / ".sdk" / "mint"))


@pytest.fixture(scope="module")
def mint_run(tmp_path_factory):
    if not (MINT_SDK / "mint" / "__init__.py").exists():
        pytest.skip(f"mindlab-toolkit 0.2.0 is not installed in {MINT_SDK} (ci/install.sh installs it there)")
    root = tmp_path_factory.mktemp("mint")
    with running_server(root / "store", write_keys(root / "keys")) as srv:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(MINT_SDK), str(ROOT)]), "OMP_NUM_THREADS": "1",
               "MINT_BASE_URL": srv.url, "MINT_API_KEY": KEYS["mallory"], "DSV4FLASH_TML_KEY": KEYS["alice"],
               "DSV4FLASH_DOWNLOAD_DIR": str(root / "download")}
        env.pop("TINKER_API_KEY", None)
        env.pop("TINKER_BASE_URL", None)
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("mint_client.py"))], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        out = json.loads(done.stdout)
        out["download_dir"] = str(root / "download")
        yield out, root / "store", srv


def _datum(mod):
    tokens = [0, 10, 11, 12, 20, 21, 22, 1]
    return mod.Datum(model_input=mod.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": np.ones(7, np.float32)})


@pytest.fixture(scope="module")
def local(mint_run, resident, tmp_path_factory):
    """The same calls on the in-process core, on one intra-op thread as the server runs (launch.py): a module
    fixture is built before the function-scoped `one_thread`, and another thread count rounds differently."""
    import dsv4flash.service as core
    from dsv4flash.service.compute.distill import ReverseKLDatum, forward_backward_reverse_kl
    from tests._threads import single_thread

    tokens = [0, 10, 11, 12, 20, 21, 22, 1]
    with single_thread():
        service = core.ServiceClient(root=tmp_path_factory.mktemp("local"), resident=resident)
        tc = service.create_lora_training_client(rank=4)
        losses = []
        for _ in range(2):
            fb = tc.forward_backward([_datum(core.types)], "cross_entropy")
            tc.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        logprobs = tc.forward([_datum(core.types)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        a = tc.save_weights_for_sampler("a").result().path
        tc.forward_backward([_datum(core.types)], "cross_entropy").result()
        tc.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
        kl = forward_backward_reverse_kl(tc, [ReverseKLDatum(tokens[:-1], tokens[:-1], tokens[1:], [1.0] * 7)],
                                         a).result()
    return dict(losses=losses, logprobs=logprobs, kl=kl)


def test_mint_client_trains_through_the_server(mint_run, local):
    out, _, _ = mint_run
    assert (out["mint"], out["tinker"]) == ("0.2.0", "0.22.0")  # MinT's own pinned SDK, not the server's 0.38
    assert out["losses"] == local["losses"]
    assert out["forward_logprobs"] == local["logprobs"]
    assert out["a"].endswith("/sampler_weights/a") and len(out["sampled"]) == 2


def test_which_key_form_sdk_022_accepts(mint_run):
    """Plain tinker 0.22 takes tml- keys and JWTs and refuses the sk- key before sending; MinT's client takes sk-
    (the training above), tml- keys and JWTs."""
    out, _, _ = mint_run
    assert out["plain_sk"] == "TinkerError: The api_key must start with the 'tml-' prefix"
    assert out["plain_tml"] == [] and out["plain_jwt"] == []  # accepted: alice's and (then) mallory's empty lists
    assert out["mint_tml_runs"] == 0  # alice's key through MinT's client: accepted, her (empty) run list
    assert out["mint_jwt_owners"] == ["mallory"]  # mallory's JWT through MinT's client: her runs, trained above


def test_get_checkpoint_archive_url_gives_a_peft_adapter(mint_run, tmp_path):
    """SDK 0.22's archive URL (a 302 to a signed URL on the same server) downloads a tar of the checkpoint's PEFT
    adapter, which loads in transformers + PEFT and scores a prompt as the server's sampler did."""
    from tests.service.http_server import peft_prompt_logprobs, served_tiny_base

    out, _, srv = mint_run
    assert out["archive_url"].startswith(f"{srv.url}/api/v1/downloads/")
    assert out["archive_members"][-1] == "checkpoint_complete"  # last, after every file
    tokens = [0, 10, 11, 12, 20, 21, 22]
    ours = peft_prompt_logprobs(served_tiny_base(tmp_path / "base"), Path(out["download_dir"]), tokens)
    np.testing.assert_allclose(ours, out["a_logprobs"], rtol=0, atol=1e-5)


def test_mint_interpolate_checkpoints(mint_run):
    from dsv4flash.lifecycle import AdapterStore

    out, store_dir, _ = mint_run
    mixed = out["interpolated"]
    assert mixed["coefficients"] == [0.25, 0.75] and mixed["path"].endswith("/sampler_weights/mix")
    store = AdapterStore(store_dir)
    run = out["a"].split("/")[2]
    a, b, m = (store.load_adapter(f"{run}:sampler_weights.{n}") for n in ("a", "b", "mix"))
    assert set(m) == set(a) and any(not torch.equal(a[k], b[k]) for k in a)
    for k in m:
        torch.testing.assert_close(m[k], 0.25 * a[k] + 0.75 * b[k], rtol=0, atol=1e-7)


def test_mint_forward_backward_reverse_kl(mint_run, local):
    out, _, _ = mint_run
    kl = out["reverse_kl"]
    assert kl["metrics"]["loss:sum"] == pytest.approx(local["kl"].metrics["loss:sum"], rel=1e-6)
    got = np.asarray(kl["outputs"][0]["loss"]["data"], np.float32)
    np.testing.assert_allclose(got, local["kl"].losses[0].to_numpy(), rtol=1e-6, atol=0)
    assert (got > 0).all()  # the student moved one step past the reference: KL > 0 at every position


def test_both_sdk_versions_share_one_server(mint_run):
    """The 0.38 SDK (alice, tml- key) on the server MinT's 0.22 client (mallory, sk- key) just used: after
    mallory publishes a checkpoint, alice samples from it; her own run trains alongside."""
    import httpx
    from tinker import types

    from tests.service.http_server import service_client

    out, _, srv = mint_run
    run, name = out["a"].split("/")[2], out["a"].split("/")[-1]
    r = httpx.post(f"{srv.url}/api/v1/training_runs/{run}/checkpoints/sampler_weights/{name}/publish",
                   headers={"X-API-Key": KEYS["mallory"]})
    assert r.status_code == 200, r.text
    with service_client(srv, "alice") as sdk:
        sampler = sdk.create_sampling_client(model_path=out["a"]).result()
        seq = sampler.sample(types.ModelInput.from_ints([0, 10, 11]), 2, types.SamplingParams(max_tokens=3, seed=5))
        assert [list(s.tokens) for s in seq.result().sequences] == out["sampled"]  # same sampler, same seed
        tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
        assert tc.forward([_datum(types)], "cross_entropy").result().loss_fn_outputs
