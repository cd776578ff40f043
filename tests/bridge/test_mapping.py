"""The name table: total and one-to-one on every census (and the real release's tensor list), the identity
to the reference model, one truth with the Megatron model's loader, and clear errors."""

from __future__ import annotations

import functools
import gzip
from collections import Counter
from pathlib import Path

import pytest

from dsv4flash.release.census import census, parse_tsv
from dsv4flash.config import load_config
from dsv4flash.release.quant_plan import quant_role, scale_name
from dsv4flash_bridge import mapping
from dsv4flash_bridge.mapping import MappingError, Rule

DATA = Path(__file__).resolve().parents[1] / "data"


@functools.lru_cache(maxsize=1)
def _release_names() -> tuple[str, ...]:
    return tuple(r.name for r in parse_tsv(gzip.open(DATA / "release_tensors.tsv.gz", "rt").read()))


def release_names() -> list[str]:
    """The real release's 96,085 tensor names (headers of the published shards)."""
    return list(_release_names())


def names_of(flavour: str) -> list[str]:
    """A census as release names; 'release' is the published checkpoint's list."""
    return release_names() if flavour == "release" else [r.name for r in census(flavour)]


@pytest.mark.parametrize("flavour", ["tiny", "tiny_mtp", "release"])
def test_the_table_places_every_tensor_exactly_once(flavour):
    names = names_of(flavour)
    resolved = mapping.resolve(names)
    sources = Counter(r for m in resolved for r in m.release)
    assert max(sources.values()) == 1  # no release tensor feeds two Megatron tensors
    megatron = Counter(m.megatron for m in resolved)
    assert max(megatron.values()) == 1  # no Megatron tensor is produced twice
    scales = {n for n in names if n not in sources}
    assert all(n.endswith(".scale") and n[: -len(".scale")] + ".weight" in sources for n in scales)
    assert all(scale_name(w) in scales for w in sources if quant_role(w).value in ("dense_fp8", "expert_mxfp4",
                                                                                  "engram_fp8"))
    assert len(sources) + len(scales) == len(names)
    for m in resolved:  # both directions of the lookup give the same instance
        assert mapping.megatron_lookup(m.megatron) == m
        assert all(mapping.release_lookup(r) == (m, i) for i, r in enumerate(m.release))


def test_release_covers_every_part_with_the_expected_counts():
    resolved = mapping.resolve(release_names())
    parts = Counter(m.part for m in resolved)
    assert parts["vision"] == 8 * 32 + 2 + 1 + 4 + 3  # 266 tensors, each its own Megatron tensor
    mtp = [m for m in resolved if m.part == "mtp"]
    assert sum(len(m.release) for m in mtp) == 2401 - sum(1 for n in release_names() if n.startswith("mtp.")
                                                          and n.endswith(".scale"))
    glu = [m for m in resolved if m.layout == "glu" and len(m.release) == 2]
    assert len(glu) == 40 * (384 + 1) + 3 * (128 + 1)  # routed + shared experts, backbone and DSpark


@pytest.mark.parametrize("flavour", ["tiny", "tiny_mtp"])
def test_reference_names_are_the_release_names(flavour):
    from dsv4flash.model.transformer import Transformer

    model = Transformer(flavour, device="meta", seed=None)
    reference = set(model.state_dict().keys())
    mapped = {r for m in mapping.resolve(names_of(flavour)) for r in m.reference}
    assert mapped == reference


@pytest.mark.parametrize("flavour", ["tiny", "tiny_mtp", "flash"])
def test_megatron_text_names_equal_the_megatron_loader(flavour):
    """The Megatron loader's pairs are the table's text part (one truth; guards against a local override)."""
    from dsv4flash.integrations.mcore.csa2.weights import name_map

    names = release_names() if flavour == "flash" else names_of(flavour)
    ours = {(m.megatron, m.reference, m.layout, m.expert) for m in mapping.resolve(names) if m.part == "text"}
    theirs = {(p.megatron, p.reference, p.layout, p.expert) for p in name_map(load_config(flavour))}
    assert ours == theirs


def test_chosen_megatron_names_outside_the_text_stack():
    look = {m.release[0]: m for m in mapping.resolve(names_of("tiny_mtp"))}
    assert look["vision.blocks.0.attn.wqkv.weight"].megatron == "vision_model.decoder.layers.0.self_attention.linear_qkv.weight"
    assert look["vision.blocks.0.attn.wqkv.weight"].transform == "qkv"
    assert look["aligner.w1.weight"].megatron == "vision_projection.encoder.linear_fc1.weight"
    assert look["image_newline"].megatron == "embedding.image_newline"
    assert look["mtp.0.attn.wq_a.weight"].megatron == "mtp.layers.0.mtp_model_layer.self_attention.linear_q_down.weight"
    assert look["mtp.0.ffn.experts.3.w1.weight"].expert == 3
    assert look["mtp.0.ffn.experts.3.w1.weight"].release[1] == "mtp.0.ffn.experts.3.w3.weight"
    last = load_config("tiny_mtp").text.num_nextn_predict_layers - 1
    assert look[f"mtp.{last}.norm.weight"].megatron == f"mtp.layers.{last}.final_layernorm.weight"


def test_unplaceable_names_are_errors_naming_the_tensor():
    with pytest.raises(MappingError, match="layers.0.attn.made_up.weight"):
        mapping.resolve(["layers.0.attn.made_up.weight"])
    with pytest.raises(MappingError, match="layers.0.ffn.experts.1.w1.weight.*needs layers.0.ffn.experts.1.w3.weight"):
        mapping.resolve(["layers.0.ffn.experts.1.w1.weight"])
    with pytest.raises(MappingError, match="layers.0.attn.wq_a.scale"):  # a scale without its weight
        mapping.resolve(["layers.0.attn.wq_a.scale"])
    with pytest.raises(MappingError, match="listed twice"):
        mapping.resolve(["norm.weight", "norm.weight"])
    with pytest.raises(MappingError, match="decoder.layers.0.nothing"):
        mapping.megatron_lookup("decoder.layers.0.nothing")


def test_rules_are_checked_when_declared():
    with pytest.raises(ValueError, match="same 1 wildcard"):
        Rule("decoder.layers.*.x", ("x",), "copy")
    with pytest.raises(ValueError, match="whole dotted component"):
        Rule("decoder.layers.*.weight*", ("layers.*.w*",), "copy")
    with pytest.raises(ValueError, match="bad layout"):
        Rule("a", ("b",), "diagonal")


def test_megatron_names_maps_scales_to_their_weights_tensor():
    out = mapping.megatron_names(["layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.0.w1.scale",
                                  "layers.0.ffn.experts.0.w3.weight", "layers.0.ffn.experts.0.w3.scale"])
    assert set(out.values()) == {"decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"}
    assert len(out) == 4
