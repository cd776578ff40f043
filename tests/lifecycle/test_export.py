"""Exports: PEFT per-expert and vLLM 3-D layouts round-trip exactly, load in real PEFT / vLLM code with
the same ΔW, and are never half-written (SIGKILL during export leaves the old directory or none)."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dsv4flash.lifecycle.errors import AdapterFormatError
from dsv4flash.lifecycle.export import CONFIG_NAME, WEIGHTS_NAME, export_peft, export_vllm_3d, import_peft, import_vllm_3d
from dsv4flash.lifecycle.packed import EXPERT_PROJECTIONS, PackedMoELoRA

E, H, I, R = 3, 8, 6, 2


def _adapter(dtype=torch.float32, seed=0, dense=True):
    return PackedMoELoRA.random(layers=[0, 1], num_experts=E, hidden=H, moe_inter=I, rank=R, alpha=3.0, dtype=dtype, seed=seed,
                                dense_shapes={"layers.0.attn.wq_a": (5, H)} if dense else None)


def test_peft_round_trip_and_layout(tmp_path):
    ad = _adapter(torch.bfloat16)
    out = export_peft(ad, tmp_path / "peft", base_model_name_or_path="deepseek-ai/DeepSeek-V4.1-Flash")
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["r"] == R and cfg["lora_alpha"] == 3.0 and cfg["peft_type"] == "LORA"
    from safetensors import safe_open

    with safe_open(out / WEIGHTS_NAME, "pt") as f:
        keys = set(f.keys())
        assert "base_model.model.layers.1.ffn.experts.2.w3.lora_B.weight" in keys
        assert f.get_tensor("base_model.model.layers.1.ffn.experts.2.w3.lora_B.weight").shape == (I, R)
    assert len(keys) == ad.tensors_per_expert_layout()
    assert import_peft(out).equal(ad)
    with pytest.raises(FileExistsError):
        export_peft(ad, out)
    export_peft(_adapter(torch.bfloat16, seed=1), out, overwrite=True)
    assert import_peft(out).equal(_adapter(torch.bfloat16, seed=1))


def test_vllm_3d_round_trip_and_layout(tmp_path):
    ad = _adapter(torch.bfloat16)
    out = export_vllm_3d(ad, tmp_path / "v3")
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["rank_pattern"] == {"ffn.experts.gate_up_proj": 2 * R} and cfg["alpha_pattern"] == {"ffn.experts.gate_up_proj": 6.0}
    from safetensors.torch import load_file

    t = load_file(out / WEIGHTS_NAME)
    stem = "base_model.model.layers.1.ffn.experts"
    assert t[f"{stem}.base_layer.lora_A.weight"].shape == (E * 2 * R, H)
    assert t[f"{stem}.base_layer.lora_B.weight"].shape == (2 * I, E * 2 * R)
    assert t[f"{stem}.lora_A.weight"].shape == (E * R, I) and t[f"{stem}.lora_B.weight"].shape == (H, E * R)
    # lora_B is expert-fastest: column k*E + e holds expert e's rank-k column
    a2, b2 = ad.experts[(1, "w2")]
    assert torch.equal(t[f"{stem}.lora_B.weight"][:, 1 * E + 2], b2[2][:, 1])
    assert torch.equal(t[f"{stem}.lora_A.weight"][2 * R + 1], a2[2][1])
    assert import_vllm_3d(out).equal(ad)


def test_vllm_3d_needs_all_three_projections(tmp_path):
    ad = _adapter()
    del ad.experts[(1, "w2")]
    with pytest.raises(AdapterFormatError, match=r"layer 1: .* no \['w2'\] LoRA"):
        export_vllm_3d(ad, tmp_path / "v3")


@pytest.mark.parametrize("point", ["export.mid_write", "export.before_rename"])
def test_export_killed_leaves_old_or_nothing(point, tmp_path, fork):
    old, new = _adapter(seed=0), _adapter(seed=1)
    target = tmp_path / "peft"
    status = fork(lambda: export_peft(new, target), crash_at=point)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not target.exists()
    export_peft(old, target)
    status = fork(lambda: export_peft(new, target, overwrite=True), crash_at=point)
    assert os.WTERMSIG(status) == signal.SIGKILL
    assert import_peft(target).equal(old)  # the previous export is intact


class _Toy(nn.Module):
    """Module names of the release layout: layers.{i}.ffn.experts.{e}.w{1,2,3}, layers.0.attn.wq_a."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.ffn = nn.Module()
            layer.ffn.experts = nn.ModuleList()
            for _ in range(E):
                ex = nn.Module()
                ex.w1, ex.w2, ex.w3 = nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False), nn.Linear(H, I, bias=False)
                layer.ffn.experts.append(ex)
            layer.attn = nn.Module()
            layer.attn.wq_a = nn.Linear(H, 5, bias=False)
            self.layers.append(layer)

    def prepare_inputs_for_generation(self, *args, **kwargs):  # what PEFT's causal-LM wrapper expects
        return {}


@pytest.mark.upstream
def test_hf_peft_loads_per_expert_export(tmp_path):
    import peft
    ad = _adapter()
    export_peft(ad, tmp_path / "peft")
    model = peft.PeftModel.from_pretrained(_Toy(), tmp_path / "peft")
    inner = model.base_model.model
    assert not hasattr(inner.layers[1].attn.wq_a, "lora_A")  # target_modules names exactly what is adapted
    for layer in (0, 1):
        for e in range(E):
            for proj in EXPERT_PROJECTIONS:
                got = getattr(inner.layers[layer].ffn.experts[e], proj).get_delta_weight("default")
                torch.testing.assert_close(got, ad.delta(f"layers.{layer}.ffn.experts.{proj}", e))
    torch.testing.assert_close(inner.layers[0].attn.wq_a.get_delta_weight("default"), ad.delta("layers.0.attn.wq_a"))


@pytest.mark.upstream
def test_vllm_reads_both_layouts_with_the_same_delta(tmp_path):
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper

    from dsv4flash.lifecycle.safetensors_io import read_safetensors

    ad = _adapter(dense=False)

    def load(directory):
        tensors, _ = read_safetensors(directory / WEIGHTS_NAME)
        helper = PEFTHelper.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
        model = LoRAModel.from_lora_tensors(1, {k: v.clone() for k, v in tensors.items()}, helper, device="cpu", dtype=torch.float32)
        for lora in model.loras.values():
            lora.optimize()  # fold alpha/r into B, as the manager does before packing
        return model

    # 2-D per-expert (what vLLM's V4.1 model loads by default)
    two_d = load(export_peft(ad, tmp_path / "peft"))
    for layer in (0, 1):
        for e in range(E):
            for proj in EXPERT_PROJECTIONS:
                lw = two_d.loras[f"layers.{layer}.ffn.experts.{e}.{proj}"]
                torch.testing.assert_close(lw.lora_b @ lw.lora_a, ad.delta(f"layers.{layer}.ffn.experts.{proj}", e))
    # 3-D fused, run through vLLM's own 3-D -> 2-D conversion
    three_d = load(export_vllm_3d(ad, tmp_path / "v3"))
    fake_manager = SimpleNamespace(
        _get_lora_layer_weights=lambda lm, name: lm.get_lora(name),
        _pop_lora_weights=lambda lm, names: [lm.loras.pop(n, None) for n in names],
        model=SimpleNamespace(config=SimpleNamespace(architectures=["DeepseekV41ForCausalLM"])),
    )
    module = SimpleNamespace(local_num_experts=E, global_num_experts=E, ep_rank=0)
    for layer in (0, 1):
        name = f"layers.{layer}.ffn.experts"
        LoRAModelManager._convert_3d_to_2d_moe_lora(fake_manager, three_d, module, name)
        lw = three_d.loras[name]
        for i, proj in enumerate(("w1", "w2", "w3")):  # vLLM's 2-D slice order
            for e in range(E):
                torch.testing.assert_close(lw.lora_b[i][e] @ lw.lora_a[i][e], ad.delta(f"{name}.{proj}", e))
