"""The catalog `LoRAResolver` against vLLM 0.33's real resolver interface and registry (CPU): a service
checkpoint resolves by `<policy>:<tag>` or tinker:// path to a vLLM 3-D LoRA directory holding exactly its
tensors, once per revision; unknown names and other bases resolve to None. The engine test is GPU-only."""

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
    tc = service.create_lora_training_client(rank=4, run_id="policy-a")
    tc.forward_backward([core.types.Datum(core.types.ModelInput.from_ints([0, 10, 11]), {
        "target_tokens": [10, 11, 12], "weights": [1.0, 1.0, 1.0]})], "cross_entropy").result()
    tc.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_for_sampler("step-1").result().path
    tensors = {k: p.detach().clone() for k, p in tc.adapter.items()}
    return root, path, tensors, tc.placement


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

    root, path, tensors, placement = catalog
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
    tc = service.create_lora_training_client(rank=8, run_id="gpu-policy")
    tc.save_weights_for_sampler("w").result()
    req = asyncio.run(CatalogLoRAResolver(root).resolve_lora(str(model.resolve()), "gpu-policy:sampler_weights.w"))
    assert req is not None
    llm = LLM(model=str(model), enable_lora=True, max_loras=1, max_lora_rank=16, max_model_len=512,
              enforce_eager=True, skip_tokenizer_init=True, gpu_memory_utilization=0.5,
              limit_mm_per_prompt={"image": 0})
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": [100, 101, 102]}], params, lora_request=[req], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
