"""An adapter that does not fit the base is refused with an error naming the tensor and what was expected.

Missing, extra and wrong-shaped tensors, a rank mismatch, a module the placement forbids (the CED source
layer's KV writers under `decoder_half`, a layer outside its range), a non-block-diagonal per-group `wo_a`,
shared expert factors that differ — in the PEFT and vLLM layouts alike. Never a silent drop.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4flash.lora import LoraConfig, apply_lora, load_peft_adapter, save_peft_adapter
from dsv4flash.model.transformer import Transformer

from .conftest import randomize_adapters

P = "base_model.model."
RANK = 4


@pytest.fixture()
def saved(tmp_path, tiny_cfg):
    """Writer of a randomised adapter (default: decoder_half) saved in a given layout."""
    def write(layout="peft", cfg=None):
        model = Transformer(tiny_cfg, seed=0)
        handle = apply_lora(model, cfg or LoraConfig(preset="decoder_half", rank=RANK))
        randomize_adapters(model)
        return save_peft_adapter(model, handle, tmp_path / layout, layout=layout, overwrite=True)
    return write


def _edit(directory, change):
    weights = directory / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    change(tensors)
    save_file(tensors, str(weights))


def _load(tiny_cfg, directory):
    return load_peft_adapter(Transformer(tiny_cfg, seed=0), directory)


@pytest.mark.parametrize("layout", ["peft", "vllm", "packed"])
def test_dropping_one_wo_a_tensor_fails_the_load(saved, tiny_cfg, layout):
    directory = saved(layout)
    _edit(directory, lambda t: t.pop(f"{P}layers.7.attn.wo_a.lora_B.weight"))
    with pytest.raises(ValueError, match=r"layers\.7\.attn\.wo_a\.lora_A\.weight has no layers\.7\.attn\.wo_a\.lora_B"):
        _load(tiny_cfg, directory)


@pytest.mark.parametrize("layout", ["peft", "vllm"])
def test_a_missing_module_names_the_tensor_and_its_expected_shape(saved, tiny_cfg, layout):
    directory = saved(layout)
    _edit(directory, lambda t: [t.pop(k) for k in list(t) if ".layers.7.attn.wo_a." in k])
    groups = tiny_cfg.text.o_groups
    in_g = tiny_cfg.text.num_attention_heads * tiny_cfg.text.head_dim // groups
    with pytest.raises(KeyError, match=rf"missing \['layers.7.attn.wo_a.lora_A.weight', 'layers.7.attn.wo_a.lora_B.weight'\]"
                                       rf".*the placement adapts layers.7.attn.wo_a, expected shape \[{groups}, {RANK}, {in_g}\]"):
        _load(tiny_cfg, directory)


def test_a_missing_expert_is_named(saved, tiny_cfg):
    directory = saved("peft")
    _edit(directory, lambda t: [t.pop(f"{P}layers.8.ffn.experts.3.w2.lora_{ab}.weight") for ab in "AB"])
    with pytest.raises(ValueError, match=r"missing layers\.8\.ffn\.experts\.3\.w2\.lora_A\.weight / lora_B\.weight .*all 8 "
                                         r"experts need a LoRA"):
        _load(tiny_cfg, directory)


def test_the_frozen_kv_writer_of_the_source_layer_is_refused(saved, tiny_cfg):
    d = tiny_cfg.decoder_start
    directory = saved("peft")
    d_model, kv = tiny_cfg.text.hidden_size, tiny_cfg.text.head_dim

    def add(t):
        t[f"{P}layers.{d}.attn.wkv.lora_A.weight"] = torch.zeros(RANK, d_model)
        t[f"{P}layers.{d}.attn.wkv.lora_B.weight"] = torch.zeros(kv, RANK)
    _edit(directory, add)
    with pytest.raises(KeyError, match=rf"unexpected \['layers.{d}.attn.wkv.lora_A.weight', 'layers.{d}.attn.wkv.lora_B.weight'\]"
                                       rf".*placement 'decoder_half' freezes the CED source layer's KV writers "
                                       rf"\(freeze_kv_write\), so layers.{d}.attn.wkv never carries LoRA"):
        _load(tiny_cfg, directory)


def test_a_layer_outside_the_placement_and_an_unknown_module_are_refused(saved, tiny_cfg):
    directory = saved("vllm")
    original = load_file(str(directory / "adapter_model.safetensors"))
    a, b = original[f"{P}layers.7.attn.wq_a.lora_A.weight"], original[f"{P}layers.7.attn.wq_a.lora_B.weight"]
    _edit(directory, lambda t: t.update({f"{P}layers.2.attn.wq_a.lora_A.weight": a, f"{P}layers.2.attn.wq_a.lora_B.weight": b}))
    with pytest.raises(KeyError, match=r"layers.2.attn.wq_a.lora_A.weight: layer 2 is outside placement 'decoder_half''s "
                                       r"layers='decoder'"):
        _load(tiny_cfg, directory)

    def bogus(t):
        for k in [k for k in t if ".layers.2." in k]:
            del t[k]
        t.update({f"{P}layers.7.attn.bogus.lora_A.weight": a, f"{P}layers.7.attn.bogus.lora_B.weight": b})
    _edit(directory, bogus)
    with pytest.raises(KeyError, match=r"layers.7.attn.bogus is not a LoRA-capable module of this model"):
        _load(tiny_cfg, directory)


def test_wrong_shapes_and_rank_mismatches_are_named(saved, tiny_cfg, tmp_path):
    directory = saved("peft")
    key = f"{P}layers.7.attn.wq_b.lora_A.weight"
    good = load_file(str(directory / "adapter_model.safetensors"))[key]
    _edit(directory, lambda t: t.update({key: torch.zeros(RANK, good.shape[1] + 1)}))
    with pytest.raises(ValueError, match=rf"tensor 'layers.7.attn.wq_b.lora_A.weight' has shape \[{RANK}, {good.shape[1] + 1}\], "
                                         rf"the model's adapter expects \[{RANK}, {good.shape[1]}\]"):
        _load(tiny_cfg, directory)
    # a rank-8 tensor in a rank-4 adapter
    _edit(directory, lambda t: t.update({key: torch.zeros(8, good.shape[1])}))
    with pytest.raises(ValueError, match=r"has shape \[8, .*expects \[4, .*\(placement rank 4\)"):
        _load(tiny_cfg, directory)
    # the config's rank against a model that already carries another placement
    other = Transformer(tiny_cfg, seed=0)
    apply_lora(other, LoraConfig(preset="decoder_half", rank=8))
    with pytest.raises(ValueError, match=r"r=4 lora_alpha=8.0 but the model's adapters have rank 8"):
        load_peft_adapter(other, saved("vllm"))


def test_per_group_wo_a_must_be_block_diagonal_in_the_peft_layout(saved, tiny_cfg):
    directory = saved("peft")
    key = f"{P}layers.9.attn.wo_a.lora_B.weight"

    def smear(t):
        t[key] = t[key].clone()
        t[key][0, -1] = 1.0  # a cross-group term: group 0's output reading group 1's factor
    _edit(directory, smear)
    with pytest.raises(ValueError, match=r"layers.9.attn.wo_a.lora_B.weight is not block-diagonal over its 2 groups"):
        _load(tiny_cfg, directory)


def test_shared_expert_factors_must_agree(saved, tiny_cfg):
    directory = saved("peft", LoraConfig(preset="decoder_half", rank=RANK, expert_lora="shared_outer"))
    key = f"{P}layers.7.ffn.experts.5.w1.lora_A.weight"
    _edit(directory, lambda t: t.update({key: t[key] + 1}))
    with pytest.raises(ValueError, match=r"layers.7.ffn.experts.5.w1.lora_A.weight differs from expert 0's.*shared_outer"):
        _load(tiny_cfg, directory)


def test_a_section_naming_an_unknown_layout_is_refused(saved, tiny_cfg):
    directory = saved("peft")
    section = json.loads((directory / "dsv4flash_adapter.json").read_text())
    (directory / "dsv4flash_adapter.json").write_text(json.dumps({**section, "layout": "fused"}))
    with pytest.raises(ValueError, match=r"dsv4flash_adapter.json: dsv4flash.layout is 'fused'"):
        _load(tiny_cfg, directory)
