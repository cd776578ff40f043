"""dsv4flash adapter directories pass vLLM 0.33's own LoRA loading for DeepSeek-V4.1 (CPU, no engine).

vLLM's `PEFTHelper` + `LoRAModel.from_local_checkpoint` with the names `WorkerLoRAManager._load_adapter` expects
(model class packing, `RoutedExperts` expert mapping, the V4.1 rename mapper, `lora_skip_prefixes`), then the
manager's own packing (`PackedLoRALayerWeights.pack` / `pack_moe`): every tensor is accepted, lands in the
module dsv4flash adapted, and gives dsv4flash's ΔW; routed experts are 2-D per expert (`is_3d_lora_weight`
False, nothing a 2-D MoE wrapper would reject).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dsv4flash.lora import LoraConfig, apply_lora, lora_state_dict, save_peft_adapter
from dsv4flash.lora.layers import ExpertLoraLinear, is_lora_module
from dsv4flash.model.transformer import Transformer
from tests.lora.conftest import randomize_adapters

pytestmark = [pytest.mark.upstream]
RANK = 8  # vLLM max_lora_rank is one of 1, 8, 16, …
PLACEMENTS = {
    "full_linear": LoraConfig(preset="full_linear", rank=RANK),
    "decoder_half": LoraConfig(preset="decoder_half", rank=RANK),
    "vit_shared": LoraConfig(preset="vit_lr_0p1", rank=RANK, wo_a_lora="shared_a", expert_lora="shared_outer"),
}


@pytest.fixture(scope="module")
def names():
    import vllm  # noqa: F401  (a test dependency: ci/install.sh test)
    from dsv4flash.integrations.vllm import adapter_names, register

    register()
    return adapter_names


def _adapted(tiny_cfg, placement):
    model = Transformer(tiny_cfg, seed=0)
    handle = apply_lora(model, PLACEMENTS[placement])
    randomize_adapters(model)
    return model, handle


def _vllm_deltas(lora_model) -> dict[str, torch.Tensor]:
    """vLLM module name -> ΔW after vLLM's own scaling fold (`optimize`)."""
    out = {}
    for name, lw in lora_model.loras.items():
        lw.optimize()
        a, b = lw.lora_a.float(), lw.lora_b.float()
        out[name] = torch.bmm(b, a).flatten(0, 1) if a.dim() == 3 else b @ a
    return out


def test_supported_module_names_are_vllm_v41_layers(names):
    """Each listed suffix is a layer attribute or prefix in the installed vLLM V4.1 sources (catches a rename)."""
    import vllm

    root = Path(vllm.__file__).parent / "models"
    files = ["deepseek_v41/nvidia/model.py", "deepseek_v41/attention.py", "deepseek_v41/compressor.py",
             "deepseek_v41/common/engram.py", "deepseek_v4/common/vision.py", "deepseek_v4/nvidia/model.py"]
    source = "\n".join((root / f).read_text() for f in files)
    for suffix in names.SUPPORTED_LORA_MODULES:
        assert re.search(rf'prefix=(f"\{{prefix\}}\.{suffix}"|maybe_prefix\(prefix, "{suffix}"\))'
                         rf'|self\.{suffix} = \w*(Linear|LMHead)\(', source), suffix
    packed = names.packed_modules_mapping(8)
    assert packed["experts"][:3] == ["experts.0.w1", "experts.0.w2", "experts.0.w3"] and len(packed["experts"]) == 24
    assert {"wq_a", "wkv", "wgate", "w1", "w3", "experts.7.w2", "experts"} <= names.expected_lora_modules(8)


@pytest.mark.parametrize("layout", ["peft", "vllm"])
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_vllm_loader_accepts_every_tensor_with_dsv4flash_deltas(names, tiny_cfg, tmp_path, layout, placement):
    from safetensors import safe_open
    from vllm.lora.lora_weights import PackedLoRALayerWeights

    model, handle = _adapted(tiny_cfg, placement)
    directory = save_peft_adapter(model, handle, tmp_path / layout, layout=layout)
    groups, experts = tiny_cfg.text.o_groups, tiny_cfg.text.n_routed_experts
    max_rank = RANK * groups if layout == "peft" and handle.config.wo_a_lora == "per_group" else RANK
    lora_model = names.load_lora_model(directory, experts, max_lora_rank=max_rank)

    mapper = names.rename_mapper()
    vllm_name = mapper._map_name  # checkpoint (release) name -> vLLM module name, vLLM's own rules
    with safe_open(str(directory / "adapter_model.safetensors"), "pt") as f:
        file_modules = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in f.keys()}
    assert set(lora_model.loras) == {vllm_name(m) for m in file_modules}  # every tensor accepted, none extra
    assert all(lw.lora_a is not None and lw.lora_b is not None for lw in lora_model.loras.values())
    # 2-D MoE format: per-expert modules only, nothing a 2-D MoE LoRA wrapper rejects (fused 3-D `experts`)
    assert lora_model.is_3d_lora_weight is False
    assert not [n for n in lora_model.loras if n.endswith((".ffn.experts", ".experts.base_layer"))]

    packed = names.packed_modules_mapping(experts)
    moe_layers = sorted({int(m.split(".")[1]) for m in file_modules if ".ffn.experts." in m})
    stacks = {}
    for layer in moe_layers:  # what the manager does for each `experts` module (2-D, non-shared)
        stem = f"language_model.model.layers.{layer}.ffn"
        parts = [lora_model.loras.pop(f"{stem}.{name}") for name in packed["experts"]]
        stacks[layer] = PackedLoRALayerWeights.pack_moe(parts, f"{stem}.experts")
    deltas = _vllm_deltas(lora_model)

    checked = 0
    for name, module in model.named_modules():
        if not is_lora_module(module):
            continue
        want = module.delta_weight()
        if isinstance(module, ExpertLoraLinear):
            layer, proj = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            stack = stacks[layer]
            i = ("w1", "w2", "w3").index(proj)
            got = stack.scaling[i] * (stack.lora_b[i][module.expert].float() @ stack.lora_a[i][module.expert].float())
        else:
            got = deltas[vllm_name(name)]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        checked += 1
    assert checked == len(handle.modules)


def test_peft_layout_needs_the_larger_rank_the_vllm_layout_avoids(names, tiny_cfg, tmp_path):
    """PEFT's per-group wo_a is one rank-G·r LoRA; vLLM sizes every slot at max_lora_rank, hence `vllm`."""
    model, handle = _adapted(tiny_cfg, "decoder_half")
    experts, groups = tiny_cfg.text.n_routed_experts, tiny_cfg.text.o_groups
    peft_dir = save_peft_adapter(model, handle, tmp_path / "peft")
    with pytest.raises(ValueError, match=f"LoRA rank {RANK * groups} is greater than max_lora_rank {RANK}"):
        names.load_lora_model(peft_dir, experts, max_lora_rank=RANK)
    vllm_dir = save_peft_adapter(model, handle, tmp_path / "vllm", layout="vllm")
    lora_model = names.load_lora_model(vllm_dir, experts, max_lora_rank=RANK)
    wo_a = lora_model.loras["language_model.model.layers.7.attn.wo_a"]
    canonical = lora_state_dict(model)
    assert lora_model.rank == RANK and wo_a.rank == RANK
    assert torch.equal(wo_a.lora_a, canonical["layers.7.attn.wo_a.lora_A.weight"])  # per-group stack, as our layer takes


def test_vllm_3d_export_is_the_fused_moe_format_vllm_converts(names, tiny_cfg, tmp_path):
    """`--format vllm_3d`: vLLM's loader accepts it, the experts arrive as the fused tensors a 2-D wrapper refuses
    unless the request says `is_3d_lora_weight=True`, and vLLM's own 3-D -> 2-D conversion gives our ΔW."""
    from types import SimpleNamespace

    from vllm.lora.model_manager import LoRAModelManager

    from dsv4flash.lifecycle.export import export_adapter_dir

    model, handle = _adapted(tiny_cfg, "decoder_half")
    save_peft_adapter(model, handle, tmp_path / "run" / "adapter")  # a training output
    directory = export_adapter_dir(tmp_path / "run", tmp_path / "v3", "vllm_3d")
    experts = tiny_cfg.text.n_routed_experts
    lora_model = names.load_lora_model(directory, experts, max_lora_rank=2 * RANK)  # fused gate_up at rank 2r
    layer = tiny_cfg.decoder_start
    name = f"language_model.model.layers.{layer}.ffn.experts"
    assert torch.is_tensor(lora_model.loras[name].lora_a) and f"{name}.base_layer" in lora_model.loras
    manager = SimpleNamespace(_get_lora_layer_weights=lambda lm, n: lm.get_lora(n),
                              _pop_lora_weights=lambda lm, ns: [lm.loras.pop(n, None) for n in ns],
                              model=SimpleNamespace(config=SimpleNamespace(architectures=["DeepseekV41ForCausalLM"])))
    module = SimpleNamespace(local_num_experts=experts, global_num_experts=experts, ep_rank=0)
    for lw in lora_model.loras.values():
        lw.optimize()  # fold alpha/r into B first, as the manager does before the conversion
    LoRAModelManager._convert_3d_to_2d_moe_lora(manager, lora_model, module, name)
    fused = lora_model.loras[name]
    for i, proj in enumerate(("w1", "w2", "w3")):
        for e in (0, experts - 1):
            want = model.get_submodule(f"layers.{layer}.ffn.experts.{e}.{proj}").delta_weight()
            torch.testing.assert_close(fused.lora_b[i][e] @ fused.lora_a[i][e], want, rtol=1e-6, atol=1e-6)
