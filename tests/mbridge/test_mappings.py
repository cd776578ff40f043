"""The Megatron-Bridge mappings generated from the name table: every Megatron name of a full checkpoint
(ViT, aligner, delimiters and DSpark included) resolves to the table's release names, and the two layout
transforms agree with Megatron-Bridge's own conventions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv4flash.release.census import census
from dsv4flash.config import load_config
from dsv4flash_bridge import mapping
from dsv4flash_bridge.renamed import pieces

pytestmark = [pytest.mark.upstream]


def test_every_megatron_name_of_a_full_checkpoint_resolves_to_the_table(mbridge):
    from dsv4flash.integrations.mbridge.mappings import build_registry

    registry = build_registry()
    resolved = mapping.resolve([r.name for r in census("tiny_mtp")])
    assert {m.part for m in resolved} == {"text", "vision", "mtp"}
    for m in resolved:
        found = registry.megatron_to_hf_lookup(m.megatron)
        hf = (found.hf_param,) if isinstance(found.hf_param, str) else tuple(found.hf_param.values())
        assert hf == m.release, m.megatron
        back = registry.hf_to_megatron_lookup(m.release[-1])
        assert back is not None and back.megatron_param == m.megatron, m.release[-1]


@pytest.mark.parametrize("bias", [False, True])
def test_vit_qkv_order_is_megatron_bridges(mbridge, bias):
    from megatron.bridge.models.conversion.param_mapping import merge_qkv_biases, merge_qkv_weights

    vision = load_config("tiny_mtp").vision
    heads, width = vision.num_attention_heads, vision.hidden_size
    shape = (3 * width,) if bias else (3 * width, width)
    wqkv = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    config = SimpleNamespace(num_attention_heads=heads, num_query_groups=heads, kv_channels=width // heads,
                             hidden_size=width, attention_output_gate=False)
    q, k, v = wqkv.split(width)
    theirs = (merge_qkv_biases if bias else merge_qkv_weights)(config, q, k, v)
    name = f"vision.blocks.0.attn.wqkv.{'bias' if bias else 'weight'}"
    m, _ = mapping.release_lookup(name)
    ours = torch.cat([wqkv[p.start:p.stop] for p in pieces(m, lambda n: wqkv.shape[0], heads)])
    assert torch.equal(ours.reshape(theirs.shape), theirs)


def test_fused_gate_up_mapping_splits_each_half_over_tensor_parallel_ranks(mbridge, monkeypatch):
    from dsv4flash.integrations.mbridge.mappings import FusedGatedMLPMapping

    mapping_ = FusedGatedMLPMapping("vision_model.decoder.layers.0.mlp.linear_fc1.weight",
                                    "vision.blocks.0.mlp.w1.weight")
    fused = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # [gate (4 rows) ; up (4 rows)]
    gate, up = fused.chunk(2)
    shards = [torch.cat([gate[:2], up[:2]]), torch.cat([gate[2:], up[2:]])]  # what ranks 0 and 1 hold
    monkeypatch.setattr(FusedGatedMLPMapping, "tp_size", property(lambda self: 2))
    monkeypatch.setattr(FusedGatedMLPMapping, "gather_from_tp_ranks", lambda self, w: shards)
    monkeypatch.setattr(FusedGatedMLPMapping, "broadcast_from_pp_rank", lambda self, w, cache_key=None: w)
    out = mapping_.megatron_to_hf(shards[0], None)
    assert list(out) == ["vision.blocks.0.mlp.w1.weight"] and torch.equal(out["vision.blocks.0.mlp.w1.weight"], fused)
    seen = {}
    monkeypatch.setattr(FusedGatedMLPMapping, "tp_rank", property(lambda self: 0))
    monkeypatch.setattr(FusedGatedMLPMapping, "scatter_to_tp_ranks",
                        lambda self, splits, *a, **k: seen.setdefault("splits", splits)[0])
    target = SimpleNamespace(weight=torch.empty(4, 3))
    monkeypatch.setattr("megatron.bridge.models.conversion.param_mapping.get_module_and_param_from_name",
                        lambda module, name: (module, module.weight))
    assert torch.equal(mapping_.hf_to_megatron(fused, target), shards[0])
    assert all(torch.equal(a, b) for a, b in zip(seen["splits"], shards))
