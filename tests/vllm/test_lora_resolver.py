"""The catalog `LoRAResolver` against vLLM 0.33's real resolver interface and registry (CPU): a service
checkpoint resolves by `<policy>:<tag>` or tinker:// path to a vLLM 3-D LoRA directory holding exactly its
tensors, once per revision; every served model name (`<policy>:<tag>`, `<policy>@<revision>`, `<policy>`, a path)
names the revision `dsv4flash serve` resolves it to; unknown names and other bases resolve to None. The engine
tests are GPU-only."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytestmark = pytest.mark.upstream


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    import vllm  # noqa: F401  (a test dependency: ci/install.sh test)
    import dsv4flash.service as core

    root = tmp_path_factory.mktemp("store")
    service = core.ServiceClient("tiny", root=root)
    tc = service.create_lora_training_client(rank=4, run_id="policy-a", train_unembed=False)  # vLLM: no head LoRA
    service.create_lora_training_client(rank=4, run_id="with-head").save_weights_for_sampler("s").result()
    tc.forward_backward([core.types.Datum(core.types.ModelInput.from_ints([0, 10, 11]), {
        "target_tokens": [10, 11, 12], "weights": [1.0, 1.0, 1.0]})], "cross_entropy").result()
    tc.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("step-1").result().path
    tensors = {k: p.detach().clone() for k, p in tc.adapter.items()}
    # a policy published into the store from outside the server (a training run, `dsv4flash lifecycle import`)
    service.store.create_policy("outside", service.fingerprint(), {})
    service.store.publish("outside", tensors, tags=["latest"], extra={"placement": tc.placement.to_dict()})
    return root, path, tensors, tc.placement, service


def test_registered_through_the_vllm_plugin_entry_point(catalog, monkeypatch):
    from vllm.lora.resolver import LoRAResolverRegistry

    from dsv4flash.integrations.vllm import register
    from dsv4flash.integrations.vllm.lora_resolver import RESOLVER_NAME, CatalogLoRAResolver

    monkeypatch.setenv("DSV4FLASH_LORA_STORE", str(catalog[0]))
    register()
    register()  # idempotent
    assert isinstance(LoRAResolverRegistry.get_resolver(RESOLVER_NAME), CatalogLoRAResolver)


def test_resolves_a_catalog_revision_to_vllm_3d_lora(catalog, tmp_path):
    from vllm.lora.request import LoRARequest

    from dsv4flash.integrations.vllm.lora_resolver import CatalogLoRAResolver
    from dsv4flash.lifecycle.export import import_vllm_3d
    from dsv4flash.lifecycle.packed import PackedMoELoRA

    root, path, tensors, placement, _ = catalog
    resolver = CatalogLoRAResolver(root, tmp_path / "cache")
    req = asyncio.run(resolver.resolve_lora("tiny", "policy-a:sampler_weights.step-1"))
    assert isinstance(req, LoRARequest) and req.lora_name == "policy-a:sampler_weights.step-1"
    got = import_vllm_3d(req.lora_path)
    want = PackedMoELoRA.from_packed_tensors(tensors, alpha=float(placement.alpha))
    assert got.equal(want) and got.moe_layers()  # MoE experts in the packed 3-D layout, dense modules too
    mtime = os.stat(os.path.join(req.lora_path, "adapter_model.safetensors")).st_mtime_ns
    again = asyncio.run(resolver.resolve_lora("tiny", path))  # the tinker:// path of the same revision
    assert again.lora_path == req.lora_path and again.lora_int_id == req.lora_int_id
    assert os.stat(os.path.join(req.lora_path, "adapter_model.safetensors")).st_mtime_ns == mtime  # exported once
    with pytest.raises(ValueError, match="^head.lora_A.weight: a LoRA on the output head .* has no vLLM layout"):
        asyncio.run(resolver.resolve_lora("tiny", "with-head:sampler_weights.s"))  # train_unembed's default: refused


def test_the_resolver_and_the_server_name_the_same_revisions(catalog, tmp_path):
    from dsv4flash.integrations.vllm.lora_resolver import CatalogLoRAResolver
    from dsv4flash.lifecycle.refs import lora_int_id

    root, path, _, _, service = catalog
    resolver = CatalogLoRAResolver(root, tmp_path / "cache")
    step1 = service.require_checkpoint(path).id  # the Tinker routes' resolution of the checkpoint path
    outside = service.require_checkpoint("tinker://outside/weights/latest").id
    names = {"policy-a:sampler_weights.step-1": step1, f"policy-a@{step1[:8]}": step1, f"policy-a@{step1}": step1,
             path: step1, "policy-a": service.store.resolve("policy-a").id,
             "outside:latest": outside, "tinker://outside/weights/latest": outside, "outside": outside}
    for name, rev in names.items():
        req = asyncio.run(resolver.resolve_lora("tiny", name))
        assert req is not None and req.lora_int_id == lora_int_id(rev) and req.lora_name == name, name
    assert asyncio.run(resolver.resolve_lora("tiny", f"outside@{step1[:8]}")) is None  # another policy's revision
    assert asyncio.run(resolver.resolve_lora("tiny", "policy-a@zz")) is None  # not a revision id


def test_unknown_names_and_other_bases_resolve_to_none(catalog, tmp_path):
    from dsv4flash.integrations.vllm.lora_resolver import CatalogLoRAResolver

    resolver = CatalogLoRAResolver(catalog[0], tmp_path / "cache")
    for name in ("policy-a:sampler_weights.nope", "nobody:head", "plain-model-name", "tinker://x/weights"):
        assert asyncio.run(resolver.resolve_lora("tiny", name)) is None, name
    assert asyncio.run(resolver.resolve_lora("flash", "policy-a:sampler_weights.step-1")) is None  # base mismatch
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_engine_serves_a_resolved_catalog_adapter(tmp_path_factory):
    """A vLLM engine with LoRA enabled generates with the adapter the resolver returns (needs CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from vllm import LLM, SamplingParams

    from dsv4flash.integrations.vllm.lora_resolver import CatalogLoRAResolver
    from tests.gpu import _small_v41

    model = _small_v41.checkpoint(tmp_path_factory.mktemp("v41"))
    import dsv4flash.service as core

    root = tmp_path_factory.mktemp("store")
    service = core.ServiceClient(str(model), root=root)  # adapter shapes and fingerprint need only the config
    tc = service.create_lora_training_client(rank=8, run_id="gpu-policy", train_unembed=False)
    tc.save_weights_for_sampler("w").result()
    req = asyncio.run(CatalogLoRAResolver(root).resolve_lora(str(model.resolve()), "gpu-policy:sampler_weights.w"))
    assert req is not None
    llm = LLM(model=str(model), enable_lora=True, max_loras=1, max_lora_rank=16, max_model_len=512,
              enforce_eager=True, skip_tokenizer_init=True, gpu_memory_utilization=0.5,
              limit_mm_per_prompt={"image": 0})
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [100, 101, 102]}], params, lora_request=[req], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.gpu
@pytest.mark.slow
def test_vllm_openai_server_resolves_the_served_names(tmp_path_factory):
    """A vLLM OpenAI server with the plugin answers `<policy>:<tag>` and `<policy>@<revision>` of the store with the
    same revision (the same greedy tokens), and an unknown name with 404 (needs CUDA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import json
    import socket
    import subprocess
    import sys
    import time

    import httpx
    import openai

    import dsv4flash.service as core
    from dsv4flash.config import load_config
    from dsv4flash.tasks import TaskTokenizer
    from dsv4flash.tasks.text_tokenizer import save_text_tokenizer
    from tests.gpu import _small_v41

    model = _small_v41.checkpoint(tmp_path_factory.mktemp("v41"))
    tokenizer = save_text_tokenizer(TaskTokenizer(load_config(str(model))), tmp_path_factory.mktemp("tok"))
    root = tmp_path_factory.mktemp("store")
    service = core.ServiceClient(str(model), root=root)
    tc = service.create_lora_training_client(rank=8, run_id="gpu-policy", train_unembed=False)
    rev = service.require_checkpoint(tc.save_weights_for_sampler("w").result().path).id
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "vllm.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
         "--model", str(model), "--tokenizer", str(tokenizer), "--enable-lora", "--max-loras", "2",
         "--max-lora-rank", "16", "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", "0.5",
         "--limit-mm-per-prompt", json.dumps({"image": 0})],
        env={**os.environ, "DSV4FLASH_LORA_STORE": str(root), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 900
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, (root / "vllm.log").read_text()[-4000:]
            time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        outs = [client.completions.create(model=name, prompt=[100, 101, 102], max_tokens=4, temperature=0,
                                          logprobs=0, extra_body={"return_tokens_as_token_ids": True})
                for name in ("gpu-policy:sampler_weights.w", f"gpu-policy@{rev[:10]}")]
        assert outs[0].choices[0].logprobs.tokens == outs[1].choices[0].logprobs.tokens
        assert len(outs[0].choices[0].logprobs.tokens) == 4
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpu-policy:sampler_weights.nope", prompt=[100], max_tokens=1)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
