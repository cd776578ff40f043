"""DSV41-VERL-001: veRL's in-memory (TensorLoRARequest) adapter loader on vLLM 0.33 (real classes, CPU)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.vllm import _vllm_helpers as vh
from tests.vllm._twins import applied, stock, twin

PATCH_ID = "DSV41-VERL-001"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
P = "base_model.model."


@pytest.fixture
def restore_load_adapter():
    """veRL's hijack assigns a class attribute of vLLM globally: put the stock one back after each test."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    saved = LRUCacheWorkerLoRAManager.__dict__.get("_load_adapter")
    yield
    if twin(PATCH_ID).applied:
        return  # the applied twin owns the attribute: its revert restores what it replaced, in order
    if saved is None:
        if "_load_adapter" in LRUCacheWorkerLoRAManager.__dict__:
            delattr(LRUCacheWorkerLoRAManager, "_load_adapter")
    else:
        LRUCacheWorkerLoRAManager._load_adapter = saved


def _worker(ep_spec=None, mixed=True):
    """The attributes a worker LoRA manager's `_load_adapter` reads, around a V4.1 weights mapper."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.models.deepseek_v41.nvidia.model import _make_deepseek_v4_weights_mapper

    model = types.SimpleNamespace(hf_to_vllm_mapper=_make_deepseek_v4_weights_mapper("fp4"), lora_skip_prefixes=["mtp."])
    manager = types.SimpleNamespace(model=model, supported_lora_modules=["wq_a", "wo_a", "experts"],
                                    packed_modules_mapping={}, moe_ep_load_spec=ep_spec, modules={},
                                    _enable_mixed_moe_lora_format=mixed, _classification_head=None)
    for name in ("_validate_moe_lora_format", "_validate_classification_head_lora"):
        setattr(manager, name, types.MethodType(getattr(LoRAModelManager, name), manager))
    return types.SimpleNamespace(_adapter_manager=manager, lora_config=vh.lora_config(max_loras=1, rank=8),
                                 vocab_size=512, _lora_model_cls=LoRAModel, max_position_embeddings=128)


def _tensors(seed=0):
    """A V4.1 adapter in PEFT names: attention, block-diagonal wo_a, 4 experts, and a DSpark `mtp.` module."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    t = {f"{P}layers.0.attn.wq_a.lora_A.weight": r(4, 64), f"{P}layers.0.attn.wq_a.lora_B.weight": r(32, 4),
         f"{P}layers.0.attn.wo_a.lora_A.weight": r(2, 4, 64), f"{P}layers.0.attn.wo_a.lora_B.weight": r(2, 16, 4),
         f"{P}mtp.0.attn.wq_a.lora_A.weight": r(4, 64), f"{P}mtp.0.attn.wq_a.lora_B.weight": r(32, 4)}
    for e in range(4):
        for w in ("w1", "w2", "w3"):
            t[f"{P}layers.0.ffn.experts.{e}.{w}.lora_A.weight"] = r(4, 64 if w != "w2" else 32)
            t[f"{P}layers.0.ffn.experts.{e}.{w}.lora_B.weight"] = r(32 if w != "w2" else 64, 4)
    return t


def _request(tensors, target_parameters=()):
    from verl.utils.vllm import TensorLoRARequest

    config = {"r": 4, "lora_alpha": 8, "target_modules": ["wq_a", "wo_a", "w1", "w2", "w3"]}
    if target_parameters:
        config["target_parameters"] = list(target_parameters)
    return TensorLoRARequest(lora_name="123", lora_int_id=123, lora_path="simon_lora_path", peft_config=config,
                             lora_tensors=tensors)


def test_tensor_adapter_loads_like_vllm_033(patch_form, vllm_cpu, restore_load_adapter):
    """Rename mapper, `mtp.` skipped, non-local experts dropped under EP, 3-D flag from the PEFT config."""
    from vllm.lora.lora_model import MoEEPLoadSpec
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from verl.utils.vllm import VLLMHijack

    VLLMHijack.hijack()  # what veRL's worker extension does after vLLM's plugins have run
    worker = _worker(ep_spec=MoEEPLoadSpec(ep_rank=1, local_num_experts=2, global_num_experts=4))
    lora = LRUCacheWorkerLoRAManager._load_adapter(worker, _request(_tensors(), ["ffn.experts.gate_up_proj"]))
    names = sorted(lora.loras)
    assert "model.layers.0.attn.wq_a" in names and not any("mtp" in n for n in names)
    assert {n.split(".")[5] for n in names if ".experts." in n} == {"2", "3"}
    assert lora.is_3d_lora_weight is True
    plain = LRUCacheWorkerLoRAManager._load_adapter(_worker(), _request(_tensors()))
    assert plain.is_3d_lora_weight is False and len([n for n in plain.loras if ".experts." in n]) == 12
    # a parameter LoRA on wo_a (dsv4flash's PEFT layout) beside 2-D experts is not a fused MoE payload
    wo_a_param = LRUCacheWorkerLoRAManager._load_adapter(_worker(), _request(_tensors(), ["layers.0.attn.wo_a.weight"]))
    assert wo_a_param.is_3d_lora_weight is False
    torch.testing.assert_close(lora.loras["model.layers.0.attn.wo_a"].lora_a,
                               _tensors()[f"{P}layers.0.attn.wo_a.lora_A.weight"])
    patch_form.record("names", names)
    patch_form.record("is_3d", [lora.is_3d_lora_weight, plain.is_3d_lora_weight])
    patch_form.record("rank", lora.rank)


def _fused_3d_tensors(seed=1):
    """A PEFT `target_parameters` (3-D fused) MoE adapter for layer 0 with 4 experts at rank 4."""
    gen = torch.Generator().manual_seed(seed)
    stem = f"{P}layers.0.ffn.experts"
    return {f"{stem}.base_layer.lora_A.weight": torch.randn(16, 64, generator=gen),
            f"{stem}.base_layer.lora_B.weight": torch.randn(64, 16, generator=gen),
            f"{stem}.lora_A.weight": torch.randn(16, 32, generator=gen),
            f"{stem}.lora_B.weight": torch.randn(64, 16, generator=gen)}


def test_3d_adapter_without_mixed_format_is_refused(patch_form, vllm_cpu, restore_load_adapter):
    """vLLM's own MoE-format validation runs: a fused 3-D adapter for a 2-D MoE wrapper names the fix."""
    from vllm.lora.layers import FusedMoEWithLoRA
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from verl.utils.vllm import VLLMHijack

    VLLMHijack.hijack()
    worker = _worker(mixed=False)
    manager = worker._adapter_manager
    manager.modules = {"model.layers.0.ffn.experts": FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)}
    manager.is_pooling_model = False
    for name in ("_get_lora_layer_weights", "_get_text_lora_name", "_get_text_lora_names"):
        setattr(manager, name, types.MethodType(getattr(LoRAModelManager, name), manager))
    manager.supports_mm = False
    with pytest.raises(ValueError, match="enable_mixed_moe_lora_format") as err:
        LRUCacheWorkerLoRAManager._load_adapter(worker, _request(_fused_3d_tensors(), ["ffn.experts.gate_up_proj"]))
    manager._enable_mixed_moe_lora_format = True
    lora = LRUCacheWorkerLoRAManager._load_adapter(worker, _request(_fused_3d_tensors(), ["ffn.experts.gate_up_proj"]))
    patch_form.record("refused", "is_3d_lora_weight=True" in str(err.value))
    patch_form.record("accepted_3d", lora.is_3d_lora_weight)


def test_stock_verl_loader_breaks_on_vllm_033(vllm_cpu, restore_load_adapter):
    """docs/upstream.md §4.1 on the real code: veRL 0.9.1's loader calls the renamed mapper method."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from verl.utils.vllm import VLLMHijack

    with stock(PATCH_ID):
        VLLMHijack.hijack()
        with pytest.raises(AttributeError, match="get_unstacked_mapper"):
            LRUCacheWorkerLoRAManager._load_adapter(_worker(), _request(_tensors()))


def test_hijack_ordering_keeps_the_fixed_loader(vllm_cpu, restore_load_adapter):
    """docs/upstream.md §4.1: vLLM's plugins run first, veRL's hijack later; the chained hijack keeps ours on top."""
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from verl.utils.vllm import VLLMHijack

    with stock(PATCH_ID):  # start unpatched even when the plugin already applied the twin in this process
        stock_loader = LRUCacheWorkerLoRAManager.__dict__.get("_load_adapter")  # None, or veRL's from an earlier hijack
        with applied(PATCH_ID) as loader_twin:
            VLLMHijack.hijack()
            VLLMHijack.hijack()
            current = LRUCacheWorkerLoRAManager.__dict__["_load_adapter"]
            assert getattr(current, "__dsv4flash_patch__", None) == loader_twin.meta.patch_id
        assert LRUCacheWorkerLoRAManager.__dict__.get("_load_adapter") is stock_loader


def test_path_requests_use_vllms_own_loader(vllm_cpu, restore_load_adapter, tmp_path):
    """A plain LoRARequest is not a tensor request: it goes to vLLM's path loader (here: a missing path)."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from dsv4flash.integrations.verl.adapter_loader import load_adapter

    with applied(PATCH_ID):
        with pytest.raises(Exception, match="not found|No adapter|does not exist|Loading lora"):
            load_adapter(_worker(), LoRARequest("x", 7, str(tmp_path / "missing")))
        assert LRUCacheWorkerLoRAManager._load_adapter is not None
