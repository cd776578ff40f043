"""`python -m dsv4flash.bench main`'s table (dsv4flash/bench/main.py) from run summaries: phases beside the wall
time they are part of, tokens/s, and MET/MISS per target. No run is timed here (the bench itself does that)."""

from dsv4flash.bench.main import build_report


def _summary(steps, train_s, eval_s, tok_s):
    return {"steps": steps, "batch_size": 32, "train_time_s": train_s, "eval_time_s": eval_s,
            "train_tokens_per_s": tok_s, "wall_time_s": train_s + eval_s}


def test_report_puts_phases_beside_their_run_and_judges_each_target():
    runs = {"fresh": (400.0, _summary(100, 20.0, 10.0, 5000.0)), "cached": (50.0, _summary(100, 20.0, 10.0, 5100.0))}
    base = {"steps": 200, "wall_time_s": 320.0, "train_tokens_per_s": 9000.0}
    report = build_report(runs, base, cli_s=0.4, full=True)
    figures = report.as_dict()
    assert figures["cached_train_s/cached_wall_s"] == 0.4 and figures["base_build_s/fresh_wall_s"] == 0.8
    assert figures["cached_train_tokens_per_s"] == 5100.0 and figures["cli_argument_error_s"] == 0.4
    assert report.targets == ["MET   main job with a cached base <= 300 s", "MISS  base build <= 300 s",
                              "MET   CLI argument error <= 2 s"]
    table = report.render()
    assert "base_build_s" in table and "0.800× fresh_wall_s" in table


def test_a_shortened_run_says_so_and_a_cached_only_run_has_no_base_row():
    report = build_report({"cached": (9.0, _summary(4, 1.0, 2.0, None))}, None, cli_s=3.0, full=False)
    assert "(shortened)" in report.title and "base_build_s" not in report.as_dict()
    assert "cached_train_tokens_per_s" not in report.as_dict()
    assert report.targets[0].startswith("MET   main job with a cached base <= 300 s (shortened run")
    assert report.targets[-1] == "MISS  CLI argument error <= 2 s"
