"""LoRA through Megatron-Bridge on the V4.1 Megatron model: block-diagonal `wo_a` adapters next to
Megatron-Bridge's own, exported unmerged to the plugin's PEFT format (loaded strictly by the reference
model, same logits) and merged into a release-layout export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4flash.release.quant_plan import QuantRole
from dsv4flash_bridge import codecs
from dsv4flash_bridge.sharded import CheckpointReader
from dsv4flash_bridge.synthetic import write_release_checkpoint
from tests.mbridge.test_bridge import decoded

pytestmark = [pytest.mark.upstream, pytest.mark.parity]
TARGETS = ["linear_o_group_proj", "linear_q_down", "linear_proj"]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """The tiny config as a release checkpoint."""
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=2, seed=7)


@pytest.fixture(params=["per_group", "shared_a"])
def adapted(request, mbridge, mcore, release):
    """(AutoBridge, Megatron model loaded from the release with random non-zero adapters, wo_a mode)."""
    from megatron.bridge import AutoBridge

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    model = mbridge.provider_for(release).provide()
    auto.load_hf_weights([model])
    lora = mbridge.DSV41LoRA(target_modules=TARGETS, dim=4, alpha=8, wo_a_lora=request.param)
    model = lora(model, training=True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return auto, model.eval(), request.param


def test_grouped_adapter_is_block_diagonal(adapted):
    from dsv4flash.integrations.mbridge.grouped_lora import GroupedLoRAProjection, grouped_adapters

    _, model, mode = adapted
    wrappers = grouped_adapters(model)
    assert len(wrappers) == model.config.dsv4.text.num_hidden_layers
    wrapper: GroupedLoRAProjection = next(iter(wrappers.values()))
    base = wrapper.to_wrap
    o = torch.randn(2, 3, base.local_groups, base.in_per_group, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = wrapper(o)
        dense = torch.block_diag(*(base.weight + wrapper.delta_weight()).view(base.local_groups, base.rank, -1))
        want = o.flatten(-2) @ dense.T  # group g's outputs see only group g's inputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert isinstance(model.decoder.layers[0].self_attention.linear_o_group_proj, GroupedLoRAProjection)


def test_peft_export_loads_into_the_reference_with_the_same_logits(adapted, mbridge, release, tmp_path):
    from dsv4flash.lora import load_peft_adapter
    from dsv4flash.lora.peft_io import read_adapter_config
    from dsv4flash.model.transformer import Transformer

    _, model, mode = adapted
    out = mbridge.save_peft_adapter(model, tmp_path / "adapter")
    config = read_adapter_config(out)
    assert config["dsv4flash"]["grouped_modules"] == sorted(f"layers.{i}.attn.wo_a" for i in range(12))
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["dsv4flash"]["lora_config"]["wo_a_lora"] == mode
    reference = Transformer("tiny", seed=None)
    reference.load_state_dict(decoded(release), strict=True)
    load_peft_adapter(reference, out)  # strict: every key and shape of the placement
    wo_a = reference.layers[4].attn.wo_a
    megatron_delta = model.decoder.layers[4].self_attention.linear_o_group_proj.delta_weight()
    torch.testing.assert_close(wo_a.delta_weight(), megatron_delta, rtol=0, atol=0)
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.eval()(ids), rtol=0, atol=1e-5)
    # the `megatron` layout is what the bridge streams: same names, shapes and values
    from dsv4flash.lora import lora_state_dict
    from dsv4flash.lora.layouts import to_layout

    streamed = {n: t for n, t in mbridge.register()().stream_adapter_weights_megatron_to_hf([model], show_progress=False)}
    files = to_layout(lora_state_dict(reference), "megatron").tensors
    assert streamed.keys() == files.keys() and all(torch.equal(streamed[k], files[k]) for k in files)
    # and stock PEFT loads the export on the transformers class built from the release directory
    import warnings

    import peft
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(missing|unexpected).*keys.*")
        wrapped = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(release), out)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(input_ids=ids).logits, reference(ids), rtol=0, atol=1e-5)


def test_merged_export_folds_the_grouped_delta_before_requantizing(adapted, mbridge, release, tmp_path):
    auto, model, _ = adapted
    mbridge.save_release(auto.export_hf_weights([model], show_progress=False), release, tmp_path / "merged")
    state = decoded(release)
    wrapper = model.decoder.layers[1].self_attention.linear_o_group_proj
    want = state["layers.1.attn.wo_a.weight"] + wrapper.delta_weight()
    with CheckpointReader(tmp_path / "merged") as out:
        got = codecs.decode(QuantRole.DENSE_FP8, out.read("layers.1.attn.wo_a.weight"), out.read("layers.1.attn.wo_a.scale"))
        untouched = out.read("layers.1.attn.wkv.weight")
    with CheckpointReader(release) as src:
        scale = src.read("layers.1.attn.wo_a.scale")
        assert torch.equal(untouched.view(torch.uint8), src.read("layers.1.attn.wkv.weight").view(torch.uint8))
    q, s = codecs.encode_dense_fp8(want, like_scale=scale)  # W + ΔW in FP8, unchanged blocks keep their scale
    assert torch.equal(got, codecs.decode(QuantRole.DENSE_FP8, q, s))
    assert (got - state["layers.1.attn.wo_a.weight"]).abs().max() > 0  # the delta is in the export
    assert (got - want).abs().max() <= want.abs().max() / 16  # and within FP8 rounding of W + ΔW


def test_unmerged_export_leaves_the_base_bytes(adapted, mbridge, release, tmp_path):
    auto, model, _ = adapted
    weights = auto.export_hf_weights([model], show_progress=False, merge_adapter_weights=False)
    mbridge.save_release(weights, release, tmp_path / "base")
    for path in sorted(release.iterdir()):
        assert (tmp_path / "base" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("adapt_vision", [False, True])
def test_text_patterns_reach_the_vit_only_with_adapt_vision(mbridge, mcore, release, adapt_vision):
    """`linear_proj` names both the text attention output and the ViT's: `DSV41LoRA` keeps adapters off the
    (frozen) ViT and aligner unless asked, and then adapts them like any Megatron-Bridge linear."""
    from megatron.bridge.peft.lora_layers import LoRALinear

    model = mbridge.provider_for(release).provide()
    model = mbridge.DSV41LoRA(target_modules=["*.linear_proj", "*.linear_fc1"], dim=4, alpha=8,
                              adapt_vision=adapt_vision)(model, training=True)
    wrapped = {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    vision = {n for n in wrapped if n.startswith(("vision_model.", "vision_projection."))}
    text = wrapped - vision
    assert "decoder.layers.0.self_attention.linear_proj" in text
    if adapt_vision:
        assert vision == {f"vision_model.decoder.layers.{i}.{m}" for i in range(2)
                          for m in ("self_attention.linear_proj", "mlp.linear_fc1")} | {
                              "vision_projection.encoder.linear_fc1"}
        assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith("vision_") and ".adapter." in n)
    else:
        assert vision == set()
        assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("vision_"))
