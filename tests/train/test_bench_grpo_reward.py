"""`python -m dsv4flash.bench grpo_reward`'s table and plot (dsv4flash/bench/grpo_reward.py) from per-step rewards: each
step beside the frozen run's, the thirds, MET/MISS per target. No run here (the bench runs the recipe)."""

import pytest

from dsv4flash.bench.grpo_reward import build_report, plot, thirds


def test_each_step_is_beside_the_frozen_runs_and_both_targets_are_judged():
    trained = [0.2, 0.2, 0.3, 0.3, 0.3, 0.3]
    frozen = [0.2, 0.2, 0.2, 0.2, 0.2, 0.25]
    report = build_report(trained, frozen, (0.15, 0.16), "t")
    figures = report.as_dict()
    assert figures["reward@1/frozen@1"] == 1.0 and figures["reward@4/frozen@4"] == pytest.approx(1.5)
    assert figures["reward_first_third"] == pytest.approx(0.2) and figures["reward_last_third"] == pytest.approx(0.3)
    assert figures["reward_last_third/frozen_last_third"] == pytest.approx(0.3 / 0.225)
    assert figures["reward_last_third/max_reward"] == pytest.approx(0.3)
    assert figures["rise_last_over_first"] == pytest.approx(1.5) and figures["val_reward_final/val_reward_initial"] > 1
    assert [t[:4] for t in report.targets] == ["MET ", "MET "]
    assert "1.50 x" in report.targets[0] and "1.33 x" in report.targets[1]


def test_a_rise_the_frozen_run_shows_too_is_not_learning():
    """The frozen run's own rise (the draw) is the same as the trained run's: rising MET, learned MISS."""
    same = [0.18, 0.2, 0.22, 0.24, 0.25, 0.26]
    report = build_report(same, same, None, "t")
    assert report.targets[0].startswith("MET   rising") and report.targets[1].startswith("MISS  learned")
    assert "val_reward_initial" not in report.as_dict()
    with pytest.raises(ValueError, match="same >= 3 steps"):
        build_report(same, same[:-1], None, "t")


def test_thirds_and_the_plot(tmp_path):
    assert thirds([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (1.5, 6.5)
    plot([0.2, 0.25, 0.3], [0.2, 0.2, 0.21], str(tmp_path / "curve.png"), "t")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_shortened_run_of_the_bench_scores_non_zero_rewards(pretrained_base, tmp_path, capsys):
    """The bench end to end, shortened (3 steps of 2 problems x 8 samples, 16 held-out problems): both runs on the
    trained tiny base the main job uses, the table, the JSON and the plot. The graded arithmetic reward is non-zero
    in every step of both runs, and step 1 is the same in both (no update has happened yet), which is what makes
    the frozen run the baseline."""
    import json

    from dsv4flash.bench.__main__ import main

    figures, png = tmp_path / "grpo_reward.json", tmp_path / "grpo_reward.png"
    assert main(["grpo_reward", "--steps", "3", "--json", str(figures), "--plot", str(png),
                 f"model.cache_dir={pretrained_base.parents[2]}", "data.train_size=2", "algorithm.group_size=8",
                 "engine.batch_size=16", "data.val_size=16", "engine.progress=off"]) == 0
    out = capsys.readouterr().out
    assert "+recipe=decoder_lora_grpo, 3 steps x 2 problems x 8 samples (train_size 2)" in out
    assert sum(line.startswith(("MET ", "MISS")) for line in out.splitlines()) == 2
    got = json.loads(figures.read_text())
    for step in (1, 2, 3):
        assert got[f"reward@{step}"] > 0 and got[f"frozen@{step}"] > 0, got
    assert got["reward@1"] == got["frozen@1"]
    assert got["val_reward_initial"] >= 0 and "rise_last_over_first" in got
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
