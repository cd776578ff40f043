"""Config loading, byte-exact round trip, derived layer plan and validation messages."""

from __future__ import annotations

import hashlib
import json

import pytest

from dsv4flash.config import ConfigError, DSV41FlashConfig, load_config

RELEASE_CONFIG_SHA256 = "8be45ce0476004a3f529fd896115a4a2e800a129ad2d3ec05b16050f52e21879"


def test_flash_round_trips_to_the_release_bytes():
    cfg = load_config("flash")
    assert hashlib.sha256(cfg.to_json().encode()).hexdigest() == RELEASE_CONFIG_SHA256
    assert len(cfg.to_hf()["text_config"]) == 59


def test_tiny_round_trips_and_matches_section_14():
    cfg = load_config("tiny")
    t = cfg.text
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.head_dim, t.o_groups) == (64, 12, 4, 32, 2)
    assert DSV41FlashConfig.from_hf(json.loads(cfg.to_json())) == cfg


def _plan_table(cfg):
    return [(p.layer_id, p.ratio, p.mode, p.kv_source, p.index_source, p.is_candidate_source, p.uses_candidates,
             p.half, p.has_engram) for p in cfg.backbone_plan]


def test_tiny_layer_plan_equals_the_section_14_table(tiny_cfg):
    assert _plan_table(tiny_cfg) == [
        (0, 0, "swa", None, None, False, False, "encoder", False),
        (1, 0, "swa", None, None, False, False, "encoder", True),
        (2, 2, "full", 2, 2, False, False, "encoder", False),
        (3, 2, "reuse", 2, 2, False, False, "encoder", False),
        (4, 2, "full", 4, 4, False, False, "encoder", True),
        (5, 2, "reuse", 4, 4, False, False, "encoder", False),
        (6, 1, "full", 6, 6, True, False, "decoder", False),
        (7, 1, "reuse", 6, 6, False, False, "decoder", False),
        (8, 1, "reindex", 6, 8, False, True, "decoder", False),
        (9, 1, "reuse", 6, 8, False, False, "decoder", False),
        (10, 1, "reindex", 6, 10, False, True, "decoder", False),
        (11, 1, "reuse", 6, 10, False, False, "decoder", False),
    ]
    rope = [(p.rope_theta, p.yarn) for p in tiny_cfg.backbone_plan]
    assert rope[:2] == [(10000.0, False)] * 2 and set(rope[2:]) == {(160000.0, True)}
    assert [p.has_wgate for p in tiny_cfg.backbone_plan] == [p.layer_id in (2, 4) for p in tiny_cfg.backbone_plan]


def test_flash_layer_plan_counts_and_chains():
    cfg = load_config("flash")
    modes = [p.mode for p in cfg.backbone_plan]
    assert {m: modes.count(m) for m in set(modes)} == {"swa": 2, "full": 4, "reindex": 4, "reuse": 30}
    assert [p.layer_id for p in cfg.backbone_plan if p.uses_candidates] == [24, 28, 32, 36]
    assert [p.layer_id for p in cfg.backbone_plan if p.has_wgate] == [2, 8, 14]
    assert cfg.backbone_plan[23].index_source == 20 and cfg.backbone_plan[25].index_source == 24
    assert all(p.kv_source == 20 for p in cfg.backbone_plan[20:])
    assert cfg.decoder_start == 20 and [p.half for p in cfg.backbone_plan].count("decoder") == 20
    assert [p.mode for p in cfg.draft_plan] == ["swa"] * 3 and all(p.is_draft for p in cfg.draft_plan)
    assert [p.layer_id for p in cfg.backbone_plan if p.has_engram] == [1, 14]
    assert cfg.hybrid_pattern == "VE" * 40


def test_engram_layout_matches_the_release():
    layouts = load_config("flash").engram_layouts
    assert [lay.num_rows for lay in layouts] == [384006168, 384016682]
    assert layouts[0].primes[0][0] == 16000057 and layouts[0].primes[-1][-1] == 16000463
    assert layouts[1].primes[0][0] == 16000477 and layouts[1].primes[-1][-1] == 16000889
    assert layouts[0].multipliers == (76632096046245, 4839876093313, 35959672319349, 73987337458391)
    assert layouts[1].multipliers == (67716810739261, 51510806800915, 30921347202721, 82619226485591)
    tiny = load_config("tiny").engram_layouts
    assert [p for order in tiny[0].primes for p in order] == [67, 71, 73, 79, 83, 89]
    assert [p for order in tiny[1].primes for p in order] == [97, 101, 103, 107, 109, 113]
    assert tiny[0].offsets == ((0, 67), (138, 211), (290, 373))


def _mutated(**text_changes):
    data = load_config("tiny").to_hf()
    data["text_config"].update(text_changes)
    return data


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"compress_ratios": [0, 0, 2, 2, 1, 2, 1, 1, 1, 1, 1, 1]}, "ratio changes between kv source 4"),
        ({"kv_source_layer_ids": [2, 4, 6, 7]}, "kv source 7 is not an index source"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1]}, "`text_config.compress_ratios`"),
        ({"candidate_topk_blocks": 2}, "`text_config.candidate_topk_blocks`"),
        ({"candidate_source_layer_id": 7}, "`text_config.candidate_source_layer_id`"),
        ({"engram_num_embeddings": [462, 631]}, "prime buckets sum to 630"),
        ({"o_groups": 3}, "`text_config.o_groups`"),
        ({"index_source_layer_ids": [2, 4, 6, 8, 10, 1]}, "`text_config.index_source_layer_ids`"),
    ],
)
def test_inconsistent_configs_are_rejected_naming_the_key(changes, fragment):
    with pytest.raises(ConfigError) as err:
        DSV41FlashConfig.from_hf(_mutated(**changes), source="bad.json")
    assert fragment in str(err.value) and "bad.json" in str(err.value)


def test_unknown_and_missing_keys_are_named(tmp_path):
    data = load_config("tiny").to_hf()
    data["text_config"]["hiden_size"] = 64
    with pytest.raises(ConfigError, match="unknown key `text_config.hiden_size`"):
        DSV41FlashConfig.from_hf(data)
    data = load_config("tiny").to_hf()
    del data["vision_config"]["patch_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"config.json: missing key `vision_config.patch_size`"):
        load_config(path)


def test_load_from_directory_and_bad_json(tmp_path):
    load_config("tiny").save(tmp_path / "config.json")
    assert load_config(tmp_path) == load_config("tiny")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="neither a flavour"):
        load_config(tmp_path / "missing")


def test_tiny_mtp_flavour_has_three_draft_blocks():
    cfg = load_config("tiny_mtp")
    assert cfg.text.num_nextn_predict_layers == 3 and len(cfg.layer_plan) == 15
