"""`dsv4flash serve --sampler vllm` on a GPU: a run's published sampler revisions are sampled by a vLLM replica on
Ray by version-qualified name (`<policy>@<revision>`, through the catalog resolver), close to the server's own
base within bf16 tolerance. The served base is an import of the synthetic small V4.1 release checkpoint
(tests/gpu/_small_v41.py) and vLLM loads the release checkpoint itself (`--sampler-model`)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

KEY = "tml-gpu-vllm-0123456789"


def test_vllm_replica_samples_published_revisions(tmp_path_factory):
    import tinker
    import torch
    from tinker import types

    from dsv4flash.service.protocol.launch import ServerProcess
    from dsv4flash_bridge.importer import import_release
    from tests.gpu import _small_v41

    cache = Path(os.environ.get("DSV4FLASH_GPU_CACHE", tmp_path_factory.mktemp("v41")))
    release = _small_v41.checkpoint(cache)
    base = cache / f"{release.name}-import-fp32"
    if not (base / "config.json").is_file():
        import_release(release, base, dtype=torch.float32, naming="release", progress=False)
    root = tmp_path_factory.mktemp("vllm_sampler")
    (root / "keys").write_text(f"gpu {KEY}\n")
    args = ("--base", str(base), "--sampler", "vllm", "--sampler-model", str(release))
    with ServerProcess(root / "store", root / "keys", args=args, base=str(base), start_timeout_s=1800) as server:
        sdk = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sdk.create_lora_training_client(base_model=str(base), rank=8, train_mlp=False).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([0, 100, 101, 102]),
                            loss_fn_inputs=dict(target_tokens=np.array([100, 101, 102, 103]),
                                                weights=np.ones(4, np.float32)))
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("v1").result().path
        sampler = sdk.create_sampling_client(model_path=path).result()
        prompt = types.ModelInput.from_ints([0, 100, 101, 102, 103, 104])
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=5, temperature=1.0)).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) > 0 for s in out.sequences)
        scored = sampler.compute_logprobs(prompt).result()  # vLLM's prompt log-probs under the revision
        trained = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(prompt.to_ints()[:-1]),
                                          loss_fn_inputs=dict(target_tokens=np.array(prompt.to_ints()[1:]),
                                                              weights=np.ones(5, np.float32)))],
                             "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), trained, atol=5e-2)
