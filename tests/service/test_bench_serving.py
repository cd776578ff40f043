"""The serving benchmark runs end to end at tiny sizes and reports every figure and target (no timing
assertions: timings belong to `python -m dsv4flash.bench serving`)."""

from __future__ import annotations

import argparse
import json

from dsv4flash.bench import BENCHMARKS


def test_serving_bench_quick(tmp_path):
    from dsv4flash.bench import serving

    assert "serving" in BENCHMARKS
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    serving.add_arguments(parser)
    report = serving.run(parser.parse_args(["--quick", "--plot", str(tmp_path / "serving.png")]))
    figures = report.as_dict()
    for key in ("base.tok_s", "uniform.1.tok_s", "uniform.4.tok_s", "zipf.4.tok_s", "uniform.4.ttft_p50_s",
                "uniform.4.ttft_p99_s", "staircase.serial_4_s", "staircase.pipelined_4_s", "staircase.serial_4_ttft_s",
                "staircase.pipelined_4_ttft_s", "staircase.prewarmed_4_ttft_s",
                "first_token.warm_s", "first_token.prewarmed_alone_s"):
        assert key in figures and figures[key] > 0, key
    assert "uniform.4.tok_s/uniform.1.tok_s" in figures and "staircase.pipelined_4_s/staircase.serial_4_s" in figures
    assert "staircase.pipelined_4_s/staircase.limit_4_s" in figures  # against the machine's core bound
    assert figures["staircase.limit_4_s"] <= figures["staircase.serial_4_s"]
    # the loads alone, and what bounds them: their CPU time, at most their wall time
    for key in ("loads.serial_4_s", "loads.pipelined_4_s", "loads.limit_4_s", "staircase.load_cpu_ms"):
        assert figures[key] > 0, key
    assert figures["staircase.load_cpu_fraction"] > 0 and figures["staircase.load_core_wait_ms"] >= 0
    assert figures["loads.limit_4_s"] <= figures["loads.serial_4_s"]
    assert "loads.pipelined_4_s/loads.limit_4_s" in figures
    assert figures["uniform.4.ttft_p99_s"] >= figures["uniform.4.ttft_p50_s"]
    # 8 distinct and 1,000 are not in the quick run: only the staircase and prewarm targets are judged
    assert sum(t.startswith(("MET", "MISS")) for t in report.targets) == 2
    assert (tmp_path / "serving.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.write_json(tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text())["base.tok_s"] == figures["base.tok_s"]



def test_serving_bench_parts_flag():
    """`--parts` takes throughput and/or staircase; anything else is a usage error (exit 2) naming the flag."""
    import pytest

    from dsv4flash.bench import serving

    parser = argparse.ArgumentParser()
    serving.add_arguments(parser)
    assert serving._parts(parser.parse_args(["--parts", " staircase,"]).parts) == {"staircase"}
    assert serving._parts(parser.parse_args([]).parts) == {"throughput", "staircase"}
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--parts", "staircase,nope"])
    assert exc.value.code == 2
