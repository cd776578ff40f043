"""Base fingerprint = config + tensor census + quantization plan; a foreign base is a clear error."""

from __future__ import annotations

import json

import pytest

from dsv4flash.lifecycle.errors import BaseMismatchError
from dsv4flash.lifecycle.fingerprint import base_fingerprint, check_compatible, fingerprint_from_parts
from dsv4flash.lifecycle.store import AdapterStore

CFG = {"model_type": "deepseek_v41", "text_config": {"num_hidden_layers": 2, "hidden_size": 8, "n_routed_experts": 4}}
ROWS = [("layers.0.ffn.experts.0.w1.weight", "I8", (6, 4)), ("layers.0.attn.wq_a.weight", "F8_E4M3", (8, 8)), ("embed.weight", "BF16", (16, 8))]


def test_parts_hash_is_canonical():
    a = fingerprint_from_parts(json.dumps(CFG), ROWS)
    b = fingerprint_from_parts(json.dumps(CFG, indent=4, sort_keys=True), list(reversed(ROWS)))
    assert a == b and a.digest.startswith("sha256:") and "L2 D8 E4 tensors=3" in a.summary


@pytest.mark.parametrize("change", ["config", "shape", "dtype", "name", "quant", "extra_tensor"])
def test_every_ingredient_changes_the_digest(change):
    base = fingerprint_from_parts(CFG, ROWS)
    cfg, rows, roles = json.loads(json.dumps(CFG)), list(ROWS), None
    if change == "config":
        cfg["text_config"]["hidden_size"] = 16
    elif change == "shape":
        rows[0] = (rows[0][0], rows[0][1], (6, 8))
    elif change == "dtype":
        rows[2] = (rows[2][0], "F32", rows[2][2])
    elif change == "name":
        rows[2] = ("embed_tokens.weight", *rows[2][1:])
    elif change == "quant":
        from dsv4flash.release.quant_plan import quant_role

        roles = {r[0]: quant_role(r[0]).value for r in rows}
        roles["embed.weight"] = "dense_fp8"  # a different quantization plan over the same census
    else:
        rows.append(("head.weight", "BF16", (16, 8)))
    assert fingerprint_from_parts(cfg, rows, roles).digest != base.digest


def test_bad_census_rows():
    with pytest.raises(ValueError, match="twice"):
        fingerprint_from_parts(CFG, ROWS + [ROWS[0]])
    with pytest.raises(ValueError, match="quant roles missing"):
        fingerprint_from_parts(CFG, ROWS, {"embed.weight": "bf16"})


def test_release_census_of_tiny_config(tiny_cfg):
    fp = base_fingerprint(tiny_cfg)
    assert fp == base_fingerprint(tiny_cfg)
    assert fp.summary.startswith("deepseek_v41 L12 D64 E8")
    assert base_fingerprint(tiny_cfg.replace_text(moe_intermediate_size=64)).digest != fp.digest


def test_loading_on_an_incompatible_base_is_a_clear_error(tmp_path, base_fp, other_fp, adapter_factory):
    store = AdapterStore(tmp_path)
    store.create_policy("pol", base_fp)
    rev = store.publish("pol", adapter_factory())
    store.load(rev.id, resident_base=base_fp)
    with pytest.raises(BaseMismatchError, match=r"adapter revision [0-9a-f]{12} \(policy 'pol'\) was trained on base sha256:.*resident base is"):
        store.load(rev.id, resident_base=other_fp)
    with pytest.raises(BaseMismatchError, match=r"x was trained on base .*\(toy D8 tensors=1\) but the resident base is .*\(toy D16 tensors=1\)"):
        check_compatible(base_fp, other_fp, what="x")
