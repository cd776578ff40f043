"""Every preset targets exactly the intended modules; the frozen KV-write, indexer, router and ViT rules."""

from __future__ import annotations

import re

import pytest

from dsv4flash.lora import PRESETS, LoraConfig, apply_lora, kv_write_modules, lora_parameters
from dsv4flash.lora.targets import rule_matches

from .conftest import lm_linear_modules, vit_modules


def _expected(cfg, preset: str) -> set[str]:
    ds, n = cfg.decoder_start, cfg.text.num_hidden_layers
    full = lm_linear_modules(cfg)
    decoder = lm_linear_modules(cfg, range(ds, n))
    kv_write = {f"layers.{ds}.attn.wkv", f"layers.{ds}.attn.compressor.wkv"}  # ratio 1: no wgate
    lean = {m for m in full if not re.search(r"attn\.(wq_b|wo_a|compressor\.)", m)}
    no_down = {m for m in full if not re.search(r"experts\.\d+\.w2$", m)}
    return {
        "full_linear": full,
        "full_linear_r8": full,
        "decoder_half": decoder - kv_write,
        "encoder_half": lm_linear_modules(cfg, range(ds)),
        "lean_attention": lean,
        "no_down_proj": no_down,
        "vit_lr_0p1": full | vit_modules(cfg),
        "decoder_lean_no_down": (decoder - kv_write) & lean & no_down,
    }[preset]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_targets_exactly_the_intended_modules(make_model, tiny_cfg, preset):
    model = make_model()
    handle = apply_lora(model, preset)
    assert set(handle.modules) == _expected(tiny_cfg, preset)
    assert len(handle.modules) == len(set(handle.modules))
    # Never: the indexer, the router, the head, the DSpark blocks.
    assert not any(".indexer." in m or m.endswith("ffn.gate") or m == "head" or m.startswith("mtp.")
                   for m in handle.modules)
    # Only the adapter factors train; every base parameter is frozen.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(re.search(r"\.lora_[AB]$", n) for n in trainable)
    assert sum(p.numel() for p in lora_parameters(model).values()) == handle.trainable_params
    assert handle.master_bytes == 4 * handle.trainable_params


def test_preset_ranks_alpha_and_switches():
    assert LoraConfig(preset="full_linear").rank == 16 and LoraConfig(preset="full_linear").alpha == 32
    assert LoraConfig(preset="full_linear_r8").rank == 8 and LoraConfig(preset="full_linear_r8").alpha == 16
    assert LoraConfig(preset="decoder_half").freeze_kv_write is True
    assert LoraConfig(preset="full_linear").freeze_kv_write is False
    vit = LoraConfig(preset="vit_lr_0p1")
    assert (vit.vit, vit.vit_lr_mult) == ("train", 0.1)
    # Explicit fields win over the preset; a preset that fixes its rank refuses another one.
    assert LoraConfig(preset="full_linear", rank=4, alpha=4.0).scaling == 1.0
    assert LoraConfig(preset="full_linear_r8", rank=8).rank == 8
    with pytest.raises(ValueError, match=r"^LoraConfig.rank: 4 conflicts with preset 'full_linear_r8', which fixes "
                                         r"rank 8"):
        LoraConfig(preset="full_linear_r8", rank=4)
    assert LoraConfig(preset="decoder_half", freeze_kv_write=False).freeze_kv_write is False


def test_parameter_count_follows_the_factor_shapes(make_model, tiny_cfg):
    """rank·(in + out) per plain linear, G·rank·(in_g + out_g) for wo_a, E·rank·(in + out) per packed unit."""
    text, r = tiny_cfg.text, 16
    model = make_model()
    handle = apply_lora(model, "full_linear")
    expected = 0
    for name in handle.modules:
        module = model.get_submodule(name)
        if name.endswith("attn.wo_a"):
            expected += module.groups * r * (module.in_per_group + module.rank)
        else:
            expected += r * (module.in_features + module.out_features)
    assert handle.trainable_params == expected
    units = {a.name: a for a in handle.adapters}
    w2 = units["layers.0.ffn.experts.w2"]
    assert (w2.kind, w2.shape_a, w2.shape_b) == ("packed_experts", (text.n_routed_experts, r, text.moe_intermediate_size),
                                                  (text.n_routed_experts, text.hidden_size, r))
    assert units["layers.0.attn.wo_a"].shape_a == (text.o_groups, r, text.num_attention_heads // text.o_groups * text.head_dim)


def test_freeze_kv_write_covers_the_ced_source_kv_writers(make_model, tiny_cfg):
    ds = tiny_cfg.decoder_start
    model = make_model()
    assert kv_write_modules(model) == (f"layers.{ds}.attn.wkv", f"layers.{ds}.attn.compressor.wkv")
    frozen = apply_lora(make_model(), LoraConfig(preset="full_linear", freeze_kv_write=True))
    assert set(frozen.modules) == lm_linear_modules(tiny_cfg) - set(kv_write_modules(model))
    # Other layers' compressors and the CED source's query side keep their adapters.
    assert {"layers.2.attn.compressor.wkv", f"layers.{ds}.attn.wq_a", f"layers.{ds}.attn.wo_a"} <= set(frozen.modules)


def test_train_head_adds_the_output_head_to_any_placement(make_model, tiny_cfg):
    handle = apply_lora(make_model(), LoraConfig(preset="decoder_half", train_head=True))
    assert "head" in handle.modules and not any(m.startswith("layers.0.") for m in handle.modules)
    with pytest.raises(ValueError, match="LoraConfig.train_head must be a bool"):
        LoraConfig(train_head="yes")


def test_explicit_rules_glob_regex_layers_and_router_opt_in(make_model):
    handle = apply_lora(make_model(), LoraConfig(preset="custom", include=["layers.*.attn.w?_a", "re:layers\\.1[01]\\.ffn\\.gate"],
                                                 layers="9-11"))
    assert set(handle.modules) == {f"layers.{i}.attn.{w}" for i in (9, 10, 11) for w in ("wq_a", "wo_a")} | {
        "layers.10.ffn.gate", "layers.11.ffn.gate"}
    # `*` stays inside one component, `**` crosses components.
    assert rule_matches("layers.*.attn.wkv", "layers.3.attn.wkv")
    assert not rule_matches("layers.*.attn.wkv", "layers.3.attn.compressor.wkv")
    assert rule_matches("layers.**.wkv", "layers.3.attn.compressor.wkv")
    assert not rule_matches("layers.*.ffn.experts.*.w[13]", "layers.3.ffn.experts.0.w2")


@pytest.mark.parametrize("kwargs, message", [
    ({"include": ["layers.*.attn.indexer.wq_b"]}, "indexer never gets LoRA"),
    ({"include": ["layers.*.attn.wq_c"]}, "matches no module"),
    ({"include": ["layers.0.ffn.experts.[0-3].w1"]}, "all 8 experts must be targeted"),
    ({"include": ["vision.blocks.*.attn.wqkv"]}, "vit='frozen'"),
    ({"include": ["mtp.**"]}, "never run in training"),
    ({"include": ["layers.*.attn.wq_a"], "exclude": ["layers.*.attn.wq_z"]}, "matches no module"),
    ({"include": ["layers.*.attn.wq_a"], "layers": "3-40"}, "outside 0..11"),
])
def test_impossible_rules_are_clear_errors(make_model, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_lora(make_model(), LoraConfig(preset="custom", **kwargs))


def test_config_validation_errors():
    with pytest.raises(ValueError, match="unknown preset 'full'"):
        LoraConfig(preset="full")
    with pytest.raises(ValueError, match="needs explicit `include`"):
        LoraConfig(preset="custom")
    with pytest.raises(ValueError, match="vit must be one of"):
        LoraConfig(vit="half")
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match=r"unknown keys \['rnak'\]"):
        LoraConfig.from_dict({"preset": "full_linear", "rnak": 4})
    cfg = LoraConfig(preset="no_down_proj", rank=4)
    assert LoraConfig.from_dict(cfg.to_dict()) == cfg


def test_apply_twice_is_idempotent_or_a_clear_error(make_model):
    model = make_model()
    first = apply_lora(model, "decoder_half")
    assert apply_lora(model, LoraConfig(preset="decoder_half")) is first
    n_params = sum(1 for _ in model.parameters())
    with pytest.raises(RuntimeError, match="already carries LoRA preset 'decoder_half'"):
        apply_lora(model, "full_linear")
    assert sum(1 for _ in model.parameters()) == n_params  # nothing half-applied


def test_meta_model_counts_without_allocating(tiny_cfg):
    from dsv4flash.model.transformer import Transformer

    meta = Transformer(tiny_cfg, device="meta")
    handle = apply_lora(meta, "full_linear")
    assert all(p.is_meta for p in lora_parameters(meta).values())
    assert handle.trainable_params == apply_lora(Transformer(tiny_cfg), "full_linear").trainable_params


@pytest.mark.parametrize("cfg", [LoraConfig(preset="vit_lr_0p1"), LoraConfig(preset="decoder_half", wo_a_lora="shared_a"),
                                 LoraConfig(preset="custom", include=["layers.*.ffn.gate", "head"], rank=4)])
def test_plan_lora_is_a_faithful_dry_run(make_model, cfg):
    from dsv4flash.lora import plan_lora

    model = make_model()
    before = dict(model.named_parameters())
    planned = plan_lora(model, cfg)
    assert dict(model.named_parameters()) == before and not any(p.grad is not None for p in before.values())
    assert all(p.requires_grad for p in before.values())  # untouched: not even frozen
    applied = apply_lora(model, cfg)
    assert planned == applied


def test_text_only_model_takes_every_text_preset_but_not_vit(tiny_cfg):
    from dsv4flash.model.transformer import Transformer

    text_only = tiny_cfg.replace_vision(num_hidden_layers=0)
    model = Transformer(text_only)
    assert set(apply_lora(model, "full_linear").modules) == lm_linear_modules(text_only)
    with pytest.raises(ValueError, match="no vision tower"):
        apply_lora(Transformer(text_only), "vit_lr_0p1")
