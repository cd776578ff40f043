"""Placement command: argument parsing, resumability (finished cells are skipped) and a tiny real run."""

import json

import pytest

from dsv4flash.study.__main__ import main, parse
from dsv4flash.study.placement import PlacementArgs, run_placement
from dsv4flash.study.runner import RESULT, make_spec, run_dir
from dsv4flash.study.variants import resolve_variant

TINY = ["model.base=random", "data.val_size=4", "engine.batch_size=2"]


def test_parse_splits_study_options_from_train_overrides():
    pos, opts, over = parse("placement", ["seeds=2", "steps=30", "presets=[full_linear, decoder_half+vit]",
                                          "plateau=[0.5,1.0]", "engine.lr=1e-3", "+x=1"])
    assert pos == [] and over == ["engine.lr=1e-3", "+x=1"]
    assert opts == {"seeds": 2, "steps": 30, "presets": ["full_linear", "decoder_half+vit"], "plateau": [0.5, 1.0]}
    pos, opts, over = parse("diagnose", ["a/adapter", "steps=4", "data.val_size=8"])
    assert pos == ["a/adapter"] and opts == {"steps": 4} and over == ["data.val_size=8"]
    with pytest.raises(ValueError, match="seeds= expects int"):
        parse("placement", ["seeds=three"])
    with pytest.raises(ValueError, match="unknown study command"):
        parse("plot", [])
    assert main(["placement", "presets=full_linear"]) == 2  # not a list: clear usage error


def test_unknown_placement_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown placement 'decoder_full'.*decoder_half"):
        resolve_variant("decoder_full")
    assert resolve_variant("decoder_half+vit").train_overrides() == ["lora=decoder_half", "lora.vit=train",
                                                                     "lora.vit_lr_mult=1.0"]


def test_finished_cell_is_not_rerun(tmp_path):
    args = PlacementArgs(seeds=1, steps=4, presets=["decoder_half"], out=str(tmp_path), overrides=TINY)
    spec = make_spec(resolve_variant("decoder_half"), 0, 4, TINY, args.plateau)
    cell = run_dir(tmp_path, spec)
    cell.mkdir(parents=True)
    fake = {**spec.to_dict(), "plateau_val_loss": 1.25, "final_val_loss": 1.0, "trainable_params": 10,
            "master_bytes": 40, "step_time_median_s": 0.1, "peak_mem_bytes": 2**20,
            "curve": [{"step": s, "val_loss": 1.0 + s} for s in (0, 2, 3, 4)]}
    (cell / RESULT).write_text(json.dumps(fake))
    out = run_placement(args, log=lambda *_: None)
    assert out["ran"] == 0 and out["skipped"] == 1 and not out["failed"]
    assert not (cell / "train").exists()  # nothing was trained
    assert out["rows"][0]["plateau_val_loss"] == 1.25
    assert "| decoder_half | 1 | 1.2500 |" in (tmp_path / "table2.md").read_text()
    # Other settings are another cell (another folder), so they would run.
    assert run_dir(tmp_path, make_spec(resolve_variant("decoder_half"), 0, 6, TINY, args.plateau)) != cell


def test_tiny_study_end_to_end(tmp_path):
    args = PlacementArgs(seeds=1, steps=2, presets=["decoder_half"], out=str(tmp_path),
                         overrides=[*TINY, f"model.cache_dir={tmp_path / 'cache'}"])
    out = run_placement(args, log=lambda *_: None)
    assert out["ran"] == 1 and not out["failed"]
    (cell,) = (tmp_path / "runs" / "decoder_half").iterdir()
    result = json.loads((cell / RESULT).read_text())
    vals = {p["step"]: p["val_loss"] for p in result["curve"] if "val_loss" in p}
    assert sorted(vals) == [0, 1, 2] and result["plateau"] == [1, 2]
    assert result["plateau_val_loss"] == pytest.approx((vals[1] + vals[2]) / 2)
    assert result["trainable_params"] == 305_664 and result["master_bytes"] == 4 * 305_664
    assert result["peak_mem_bytes"] > 0 and (cell / "train" / "adapter" / "adapter_config.json").is_file()
    for name in ("table2.md", "table2.csv", "overview.png", "curves/decoder_half.png"):
        assert (tmp_path / name).is_file(), name
    again = run_placement(args, log=lambda *_: None)
    assert again["ran"] == 0 and again["skipped"] == 1
    # The run's adapter feeds the other two commands (seed read from the run's summary).
    from dsv4flash.study.diagnose import run_diagnose
    from dsv4flash.study.image_swap import run_image_swap

    adapter = cell / "train" / "adapter"
    rows = run_image_swap([str(adapter)], args.overrides, out=str(tmp_path / "swap"), log=lambda *_: None)
    assert [r["model"] for r in rows] == ["base", "decoder_half/seed0"]
    assert rows[1]["val_loss"] == pytest.approx(result["final_val_loss"], abs=1e-6)
    assert all(r["rise"] == r["swapped_val_loss"] - r["val_loss"] for r in rows)
    diag = run_diagnose(str(adapter), args.overrides, out=str(tmp_path / "diag"), steps=1, log=lambda *_: None)
    zero = {r["zeroed"]: r["val_loss"] for r in diag["zeroing"]}
    assert zero["all"] == diag["base_loss"] == result["initial_val_loss"]
    assert (tmp_path / "diag" / "diagnose.png").is_file() and (tmp_path / "swap" / "image_swap.csv").is_file()
