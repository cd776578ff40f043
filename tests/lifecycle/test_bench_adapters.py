"""The adapters benchmark runs end to end at tiny sizes and reports every figure and target (no timing
assertions: timings belong to `python -m dsv4flash.bench adapters`)."""

from __future__ import annotations

import argparse
import json

from dsv4flash.bench import BENCHMARKS


def test_adapters_bench_quick(tmp_path):
    from dsv4flash.bench import adapters

    assert "adapters" in BENCHMARKS
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    adapters.add_arguments(parser)
    args = parser.parse_args(["--quick", "--plot", str(tmp_path / "stair.png"), "--workdir", str(tmp_path / "work")])
    report = adapters.run(args)
    figures = report.as_dict()
    for key in ("load.per_expert_s", "load.packed_s", "load.memcpy_s", "catalog.register_per_s", "catalog.lookup_p99_us",
                "staircase.serial_4_s", "staircase.pipelined_4_s", "staircase.warm_pipelined_4_s", "mem.peak_rss_mb"):
        assert key in figures and figures[key] > 0, key
    assert figures["load.tensors_per_expert"] == 2 * 16 * 3 * 2 and figures["load.tensors_packed"] == 2 * 3 * 2
    assert figures["catalog.revisions"] == 20_000 + 200
    assert sum(t.startswith(("MET", "MISS")) for t in report.targets) == 4
    png = (tmp_path / "stair.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    report.write_json(tmp_path / "out.json")
    assert json.loads((tmp_path / "out.json").read_text())["load.bytes"] == figures["load.bytes"]


def test_catalog_bench_on_postgres(pg_dsn, tmp_path):
    """`--catalog postgresql://…` runs the catalog part against a shared PostgreSQL catalog."""
    from dsv4flash.bench import adapters
    from dsv4flash.bench.report import BenchReport

    args = argparse.Namespace(catalog=pg_dsn, revisions=3_000, registers=50, lookups=400)
    report = BenchReport("catalog on postgres")
    adapters.bench_catalog(args, tmp_path, report)
    figures = report.as_dict()
    assert figures["catalog.revisions"] == 3_050 and figures["catalog.lookup_p50_us"] > 0
    assert "catalog.file_mb" not in figures
