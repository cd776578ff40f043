"""DSV41-MBRIDGE-005: DeepSeek-V4.1's image-token expert bias (`bias_vl`) through the V4.1 bridge.

A tiny release-format checkpoint written here: the tiny config with its vision tower kept in `config.json`, the
text decoder's tensors (no Engram layers) and every gate's `ffn.gate.bias_vl` (random, distinct from `bias`),
but no vision-tower / aligner tensors (DSV41-MBRIDGE-006 maps those). `AutoBridge` -> provider (modality expert
bias on) -> `GPTModel`, called with `token_types` marking image-span tokens, gives the logits of the reference
`dsv4flash.model.Transformer` whose decoder gets the same image mask (its embeddings path with the image rows
marked, as the bridge's model has no vision tower yet), fp32 at 1e-5; export is bit-exact, `bias_vl` included.
Both forms: the runtime twin (on the DSV41-MBRIDGE-001 twin and the megatron-core twins up to DSV41-MCORE-012)
and the patched megatron-bridge tree on the patched megatron-core tree.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.patches.test_mbridge_deepseek_v41 import (  # noqa: F401  (v41: the CSA2 / mHC fixture)
    _bridge, _canonical_scales, _decoded, _model, _stored, _tiny, v41)

PATCH_ID = "DSV41-MBRIDGE-005"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
VISION = ("vision.", "aligner.", "image_start", "image_newline", "image_end")


def _config(root: Path) -> Path:
    data = _tiny()
    data["text_config"].update(engram_layer_ids=[], engram_num_embeddings=[])
    assert data["vision_config"]["num_hidden_layers"] > 0  # the vision tower stays in the config
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(data, indent=1))
    return root / "config.json"


@pytest.fixture(scope="module")
def bias_vl_release(tmp_path_factory) -> Path:
    """Text decoder + `bias_vl` gates of the tiny config (vision tower in the config, not in the tensors)."""
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    from dsv4flash.release.census import census
    from dsv4flash.config import load_config
    from dsv4flash.integrations.mbridge import save_release

    root = tmp_path_factory.mktemp("v41_bias_vl")
    config = _config(root / "cfg")
    rows = [r for r in census(load_config(str(config))) if not r.name.startswith(VISION)]
    assert any(r.name.endswith(".ffn.gate.bias_vl") for r in rows)
    synthetic = write_release_checkpoint(root / "synthetic", rows=rows, shards=2, seed=5)
    (synthetic / "config.json").write_text(config.read_text())
    gen = torch.Generator().manual_seed(7)

    def weights():
        for name, tensor in _canonical_scales(synthetic):
            if name.endswith(".ffn.gate.bias_vl"):  # large enough to move image tokens to other experts
                tensor = (0.5 * torch.randn(tensor.shape, generator=gen)).to(tensor.dtype)
            yield name, tensor

    return save_release(weights(), synthetic, root / "release")


def _token_types(batch: int, seq: int) -> torch.Tensor:
    """-1 text, >= 0 the image-span index (the processor's convention): one span per row."""
    types = torch.full((batch, seq), -1)
    types[0, 4:16] = 0
    types[1, 20:31] = 0
    types[1, 33:36] = 1
    return types


def test_stock_bridge_refuses_a_vision_config(patch_form, v41):
    from megatron.bridge.models.deepseek_v41 import deepseek_v41_bridge as bridge

    # The DSV41-MBRIDGE-001 body alone refuses the vision field; its runtime files are shared with DSV41-MBRIDGE-006
    # (which maps the vision tower), so that refusal is checked on 001's patched tree by
    # test_mbridge_deepseek_v41_vision.py::test_without_the_patch_the_v41_bridge_refuses_the_vision_tower.
    kwargs = bridge.provider_kwargs_from_hf(_tiny())
    assert kwargs["moe_router_modality_expert_bias"] is True
    patch_form.record("modality_bias", kwargs["moe_router_modality_expert_bias"])


def test_vision_tensors_are_refused_by_name(patch_form, v41, tmp_path):
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    full = write_release_checkpoint(tmp_path / "full", _config(tmp_path / "cfg"), shards=1, seed=3)
    with pytest.raises(ValueError, match=r"^aligner\.w1\.bias: the V4\.1 vision tower and aligner tensors") as info:
        _bridge(full).to_megatron_provider(load_weights=False)
    patch_form.record("error", str(info.value))


@pytest.mark.slow
def test_image_tokens_route_with_bias_vl_like_the_reference(patch_form, v41, mcore_parallel, bias_vl_release,
                                                          monkeypatch):
    from dsv4flash.model import attention, indexer
    from dsv4flash.model.state import CSA2State
    from dsv4flash.model.transformer import Transformer

    release = bias_vl_release
    model = _model(_bridge(release))
    routers = [layer.mlp.router for layer in model.decoder.layers]
    assert all(r.modality_expert_bias is not None for r in routers)
    stored = _stored(release)
    for i, router in enumerate(routers):  # imported, and distinct from the text bias
        bias_vl = stored[f"layers.{i}.ffn.gate.bias_vl"]
        assert torch.equal(router.modality_expert_bias.expert_bias, bias_vl.float())
        assert not torch.equal(router.modality_expert_bias.expert_bias, router.expert_bias)
    reference = Transformer(str(release / "config.json"), seed=None)
    missing, unexpected = reference.load_state_dict(_decoded(release), strict=False)
    assert not unexpected and missing and all(name.startswith(VISION) for name in missing), missing
    for module, name in ((attention, "fake_quant_window_kv"), (attention, "fake_quant_compressed_kv"),
                         (indexer, "fake_quant_index")):
        monkeypatch.setattr(module, name, lambda x: x)  # DSV41-MCORE-008 has no fake-quant points
    ids = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40).expand(2, -1)
    token_types = _token_types(2, 40)
    maps = []
    for router in routers:
        router.register_forward_hook(lambda module, args, out: maps.append(out[1]))
    with torch.no_grad():
        got = model(ids, positions, attention_mask=None, token_types=token_types).float()
        text_only = model(ids, positions, attention_mask=None).float()
    image_rows = (token_types >= 0).T.reshape(-1)  # the routers' [s, b] token order
    image_maps, text_maps = maps[: len(routers)], maps[len(routers):]
    assert all(torch.equal(a[~image_rows], b[~image_rows]) for a, b in zip(image_maps, text_maps))
    assert any(not torch.equal(a[image_rows], b[image_rows]) for a, b in zip(image_maps, text_maps))
    with torch.no_grad():
        streams, pre_mix, context = reference.eval().embed_inputs(ids)  # token embeddings, as the bridge's model
        context = dataclasses.replace(context, image_mask=token_types >= 0)
        streams, pre_mix, _ = reference.run_layers(streams, pre_mix, CSA2State(), context)
        want = reference.logits(streams, pre_mix)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The synthetic weights are small (std 0.02): bias_vl moves the logits by ~1e-6, so the parity must also
    # be far tighter than that effect, or routing image tokens with the text bias would pass as well.
    assert (got - want).abs().max() < 0.01 * (got - text_only).abs().max(), "parity looser than bias_vl's effect"
    torch.testing.assert_close(text_only, reference(ids), rtol=1e-5, atol=1e-5)
    patch_form.record("logits", got, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_export_is_bit_exact_with_bias_vl(patch_form, v41, mcore_parallel, bias_vl_release):
    release = bias_vl_release
    auto = _bridge(release)
    exported = dict(auto.export_hf_weights([_model(auto)], show_progress=False))
    stored = _stored(release)
    assert exported.keys() == stored.keys()
    bias_vl = sorted(n for n in stored if n.endswith(".ffn.gate.bias_vl"))
    assert bias_vl and all(stored[n].dtype == torch.float32 for n in bias_vl)
    for name, tensor in stored.items():
        got = exported[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name
    patch_form.record("bias_vl", torch.stack([exported[n] for n in bias_vl]))
