"""Adapter state: canonical state dicts, PEFT directories (bit-exact, atomic), zeroing, optimizer groups."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dsv4flash.lora import (LoraConfig, apply_lora, forward_with_early_stop, load_lora_state_dict, load_peft_adapter,
                            lora_parameters, lora_state_dict, module_group, param_groups, save_peft_adapter, zero_lora)
from dsv4flash.lora import peft_io

from .conftest import randomize_adapters


def _trained(make_model, cfg="full_linear"):
    model = make_model()
    handle = apply_lora(model, cfg)
    randomize_adapters(model)
    return model, handle


def _bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_state_dict_round_trip(make_model, ids):
    model, _ = _trained(make_model)
    other = make_model()
    apply_lora(other, "full_linear")
    loaded = load_lora_state_dict(other, {k: v.clone() for k, v in lora_state_dict(model).items()})
    assert len(loaded) == len(lora_state_dict(model))
    assert _bit_equal(lora_state_dict(other), lora_state_dict(model))
    with torch.no_grad():
        assert torch.equal(other(ids), model(ids))


@pytest.mark.parametrize("cfg", [LoraConfig(preset="full_linear"), LoraConfig(preset="vit_lr_0p1", wo_a_lora="shared_a"),
                                 LoraConfig(preset="decoder_half", lora_dtype="bfloat16"),
                                 LoraConfig(preset="no_down_proj", expert_lora="shared_outer", wo_a_lora="shared_a")])
def test_peft_round_trip_is_bit_exact(make_model, tmp_path, vl_batch, cfg):
    ids, types, images = vl_batch
    model, handle = _trained(make_model, cfg)
    path = save_peft_adapter(model, handle, tmp_path / "adapter")
    assert sorted(os.listdir(path)) == ["adapter_config.json", "adapter_model.safetensors", "dsv4flash_adapter.json"]
    assert os.listdir(tmp_path) == ["adapter"]  # no temp directory left behind
    fresh = make_model()
    fresh_handle = load_peft_adapter(fresh, path)  # rebuilds the placement from the directory
    assert fresh_handle.modules == handle.modules and fresh_handle.config == handle.config
    assert _bit_equal(lora_state_dict(fresh), lora_state_dict(model))
    with torch.no_grad():
        assert torch.equal(fresh(ids, types, images), model(ids, types, images))
    # Loading again into a model that already carries the placement only copies the tensors.
    assert load_peft_adapter(fresh, path) is fresh_handle


def test_peft_files_describe_the_layout(make_model, tmp_path, tiny_cfg):
    import re

    model, handle = _trained(make_model)
    path = save_peft_adapter(model, handle, tmp_path / "a", base_model_name_or_path="tiny")
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == ("LORA", 16, 32.0, "tiny")
    assert config["task_type"] == "CAUSAL_LM" and "dsv4flash" not in config  # stock PEFT sees only its own keys
    ours = json.loads((path / "dsv4flash_adapter.json").read_text())
    n, groups, experts = tiny_cfg.text.num_hidden_layers, tiny_cfg.text.o_groups, tiny_cfg.text.n_routed_experts
    assert (ours["format"], ours["layout"], ours["wo_a_lora"], ours["expert_lora"]) == \
        ("dsv4flash-lora/2", "peft", "per_group", "per_expert")
    assert ours["grouped_modules"] == sorted(f"layers.{i}.attn.wo_a" for i in range(n))
    assert ours["trainable_params"] == handle.trainable_params
    # wo_a: a PEFT parameter LoRA at rank G·r (alpha G·alpha: same scaling); experts: one 2-D LoRA per expert
    assert config["target_parameters"] == sorted(f"layers.{i}.attn.wo_a.weight" for i in range(n))
    assert config["rank_pattern"] == {r"attn\.wo_a(\.weight)?": groups * 16}
    assert config["alpha_pattern"] == {r"attn\.wo_a(\.weight)?": groups * 32.0}
    target = re.compile(config["target_modules"])
    assert target.fullmatch("layers.3.ffn.experts.7.w2") and target.fullmatch("layers.3.attn.wq_a")
    assert not target.fullmatch("layers.3.attn.wo_a") and not target.fullmatch("layers.3.ffn.experts.w2")
    assert not target.fullmatch("layers.3.attn.indexer.wq_b")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert all(k.startswith("base_model.model.") for k in tensors)
    stem = "base_model.model.layers.2"
    a, b = lora_state_dict(model)["layers.2.attn.wo_a.lora_A.weight"], lora_state_dict(model)["layers.2.attn.wo_a.lora_B.weight"]
    assert torch.equal(tensors[f"{stem}.attn.wo_a.lora_A.weight"], a.reshape(groups * 16, -1))
    assert torch.equal(tensors[f"{stem}.attn.wo_a.lora_B.weight"], torch.block_diag(*b))
    packed = lora_state_dict(model)["layers.2.ffn.experts.w3.lora_A.weight"]
    assert torch.equal(tensors[f"{stem}.ffn.experts.5.w3.lora_A.weight"], packed[5])
    assert not any(re.search(r"ffn\.experts\.w[123]\.", k) for k in tensors)
    n_experts_tensors = 2 * 3 * experts * n
    assert len(tensors) == 2 * len(handle.adapters) - 2 * 3 * n + n_experts_tensors


@pytest.mark.parametrize("cfg", [LoraConfig(preset="full_linear"),
                                 LoraConfig(preset="no_down_proj", expert_lora="shared_outer", wo_a_lora="shared_a")])
def test_every_layout_round_trips_bit_exactly_into_every_other(make_model, tmp_path, cfg):
    from dsv4flash.lora.layouts import LAYOUTS, from_layout, to_layout

    model, handle = _trained(make_model, cfg)
    canonical = lora_state_dict(model)
    for source in LAYOUTS:
        files = to_layout(canonical, source).tensors
        back = from_layout(files, source, rank=cfg.rank, wo_a_lora=cfg.wo_a_lora, expert_lora=cfg.expert_lora)
        assert _bit_equal(back, canonical), source
        for target in LAYOUTS:  # directory in one layout -> directory in another -> same tensors
            save_peft_adapter(model, handle, tmp_path / source, layout=source, overwrite=True)
            fresh = make_model()
            load_peft_adapter(fresh, tmp_path / source)
            save_peft_adapter(fresh, None, tmp_path / target, layout=target, overwrite=True)
            again = make_model()
            load_peft_adapter(again, tmp_path / target)
            assert _bit_equal(lora_state_dict(again), canonical), (source, target)


def test_legacy_packed_directories_still_load(make_model, tmp_path, ids):
    """A `dsv4flash-lora/1` directory (packed tensors, the LoraConfig in the section) loads unchanged."""
    model, handle = _trained(make_model, "decoder_half")
    path = save_peft_adapter(model, handle, tmp_path / "v1", layout="packed")
    config = json.loads((path / "adapter_config.json").read_text())
    ours = json.loads((path / "dsv4flash_adapter.json").read_text())
    (path / "dsv4flash_adapter.json").unlink()  # v1 carried the section inline
    legacy = {"format": "dsv4flash-lora/1", "lora_config": ours["lora_config"], "base": ours["base"],
              "grouped_modules": ours["grouped_modules"], "packed_experts": ours["packed_experts"],
              "trainable_params": ours["trainable_params"]}
    (path / "adapter_config.json").write_text(json.dumps({**config, "dsv4flash": legacy}))
    assert len(load_file(str(path / "adapter_model.safetensors"))) == 2 * len(handle.adapters)
    fresh = make_model()
    load_peft_adapter(fresh, path)
    assert _bit_equal(lora_state_dict(fresh), lora_state_dict(model))
    (path / "adapter_config.json").write_text(json.dumps({**config, "dsv4flash": {**legacy, "format": "dsv4flash-lora/9"}}))
    with pytest.raises(ValueError, match="dsv4flash.format is 'dsv4flash-lora/9'"):
        load_peft_adapter(make_model(), path)


def test_save_is_atomic_and_refuses_to_clobber(make_model, tmp_path, monkeypatch):
    model, handle = _trained(make_model)
    target = tmp_path / "adapter"

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(peft_io, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_peft_adapter(model, handle, target)
    assert os.listdir(tmp_path) == []  # nothing half-written, no temp left
    monkeypatch.undo()
    save_peft_adapter(model, handle, target)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        save_peft_adapter(model, handle, target)
    zero_lora(model)
    save_peft_adapter(model, handle, target, overwrite=True)
    assert os.listdir(tmp_path) == ["adapter"]
    assert all(torch.count_nonzero(v) == 0 for k, v in load_file(str(target / "adapter_model.safetensors")).items()
               if k.endswith("lora_B.weight"))


def test_load_errors_name_the_file_and_tensor(make_model, tmp_path):
    model, handle = _trained(make_model)
    path = save_peft_adapter(model, handle, tmp_path / "a")
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = "base_model.model.layers.3.attn.wq_a.lora_B.weight"

    save_file({k: v for k, v in tensors.items() if k != key}, str(weights))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: layers.3.attn.wq_a.lora_A.weight has no "
                                         r"layers.3.attn.wq_a.lora_B.weight"):
        load_peft_adapter(make_model(), path)
    save_file({k: v for k, v in tensors.items() if ".layers.3.attn.wq_a." not in k}, str(weights))
    with pytest.raises(KeyError, match=r"adapter_model.safetensors.*missing \['layers.3.attn.wq_a.lora_A.weight', "
                                       r"'layers.3.attn.wq_a.lora_B.weight'\].*the placement adapts layers.3.attn.wq_a, "
                                       r"expected shape \[16, 64\]"):
        load_peft_adapter(make_model(), path)
    save_file({**tensors, key: torch.zeros(3, 3)}, str(weights))
    with pytest.raises(ValueError, match=r"'layers.3.attn.wq_a.lora_B.weight' has shape \[3, 3\]"):
        load_peft_adapter(make_model(), path)

    section = json.loads((path / "dsv4flash_adapter.json").read_text())
    section["base"]["hidden_size"] = 128
    (path / "dsv4flash_adapter.json").write_text(json.dumps(section))
    with pytest.raises(ValueError, match="dsv4flash_adapter.json: .*hidden_size=128"):
        load_peft_adapter(make_model(), path)
    other = make_model()
    apply_lora(other, "full_linear_r8")
    with pytest.raises(ValueError, match="r=16.*rank 8"):
        load_peft_adapter(other, path)
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        load_peft_adapter(make_model(), tmp_path / "nowhere")
    with pytest.raises(RuntimeError, match="no LoRA adapters"):
        lora_state_dict(make_model())


def test_zero_lora_by_group(make_model, ids):
    model, _ = _trained(make_model)
    zeroed = zero_lora(model, "attention")
    assert zeroed and all(module_group(m) in ("attn_q", "attn_kv", "attn_out") for m in zeroed)
    for key, p in lora_parameters(model).items():
        is_b = key.endswith("lora_B.weight")
        assert (torch.count_nonzero(p) == 0) == (is_b and module_group(key) in ("attn_q", "attn_kv", "attn_out"))
    assert set(zero_lora(model, ["routed_down"])) == {f"layers.{i}.ffn.experts.w2" for i in range(12)}
    zero_lora(model)
    with torch.no_grad():
        assert torch.equal(model(ids), make_model()(ids))
    with pytest.raises(ValueError, match="unknown module group 'attn'"):
        zero_lora(model, "attn")


@pytest.mark.parametrize("name, group", [
    ("layers.3.attn.wq_a", "attn_q"), ("layers.3.attn.wq_b.lora_A.weight", "attn_q"), ("layers.3.attn.wkv", "attn_kv"),
    ("layers.3.attn.wo_a.lora_B.weight", "attn_out"), ("layers.3.attn.wo_b", "attn_out"),
    ("layers.2.attn.compressor.wgate", "compressor"), ("layers.2.attn.indexer.wq_b.weight", "indexer"),
    ("layers.3.ffn.shared_experts.w2", "shared_expert"), ("layers.3.ffn.experts.7.w1", "routed_gate_up"),
    ("layers.3.ffn.experts.w3.lora_A.weight", "routed_gate_up"), ("layers.3.ffn.experts_lora.w2.lora_B", "routed_down"),
    ("base_model.model.layers.3.ffn.experts.w2.lora_B.weight", "routed_down"), ("layers.3.ffn.gate.bias_vl", "router"),
    ("layers.1.engram.wkv", "engram"), ("layers.1.hc_attn_fn", "mhc"), ("layers.1.attn_norm.weight", "norm"),
    ("vision.blocks.0.mlp.w1", "vit"), ("aligner.w2", "aligner"), ("mtp.0.attn.wq_a", "mtp"), ("head", "head"),
    ("embed.weight", "embed"), ("image_start", "image_delimiters"), ("layers.3.attn.attn_sink", "attn_sink"),
])
def test_module_groups(name, group):
    assert module_group(name) == group


def test_param_groups_apply_the_vit_multiplier(make_model):
    model, handle = _trained(make_model, "vit_lr_0p1")
    groups = param_groups(model, handle, 5e-5, weight_decay=0.0)
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in groups] == [("lora", 5e-5, 0.0), ("lora_vit", 5e-6, 0.0)]
    ids_in = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids_in) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    assert all(module_group(n) in ("vit", "aligner") for n, p in model.named_parameters()
               if p.requires_grad and id(p) in {id(q) for q in groups[1]["params"]})
    decoder, dh = _trained(make_model, "decoder_half")
    assert [g["name"] for g in param_groups(decoder, dh, 1e-4)] == ["lora"]


def _step(model, opt, ids):
    opt.zero_grad()
    logits = forward_with_early_stop(model, ids)
    F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()).backward()
    opt.step()


def test_resume_from_a_saved_adapter_is_bit_identical(make_model, ids, tmp_path):
    """Save adapter + optimizer state mid-run, rebuild from disk, continue: identical to never stopping."""
    model = make_model()
    handle = apply_lora(model, "decoder_half")
    opt = torch.optim.AdamW(param_groups(model, handle, 1e-3))
    _step(model, opt, ids)
    save_peft_adapter(model, handle, tmp_path / "ckpt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    _step(model, opt, ids)

    resumed = make_model()
    rh = load_peft_adapter(resumed, tmp_path / "ckpt")
    ropt = torch.optim.AdamW(param_groups(resumed, rh, 1e-3))
    ropt.load_state_dict(torch.load(tmp_path / "opt.pt"))
    _step(resumed, ropt, ids)
    assert _bit_equal(lora_state_dict(resumed), lora_state_dict(model))


def test_deepcopy_keeps_packed_experts_wired_to_the_copy(make_model, ids):
    import copy

    model, _ = _trained(make_model)
    clone = copy.deepcopy(model)
    assert clone.layers[0].ffn.experts[2].w1._factors is clone.layers[0].ffn.experts_lora.w1
    with torch.no_grad():
        assert torch.equal(clone(ids), model(ids))
        clone.layers[0].ffn.experts_lora.w1.lora_B.zero_()
    assert model.layers[0].ffn.experts_lora.w1.lora_B.abs().sum() > 0  # the original is untouched


def test_dropout_acts_on_the_adapter_input_in_train_mode_only(make_model, ids):
    model = make_model()
    apply_lora(model, LoraConfig(preset="decoder_half", dropout=0.5))
    randomize_adapters(model)
    model.eval()
    with torch.no_grad():
        a, b = model(ids), model(ids)
        model.train()
        torch.manual_seed(0)
        c = model(ids)
    assert torch.equal(a, b) and not torch.equal(a, c)
