"""Smoke test of `python -m dsv4flash.bench codecs` at toy size: every figure and target is reported."""

from __future__ import annotations

import argparse
import json

from dsv4flash.bench import codecs as bench
from dsv4flash.bench.__main__ import main


def test_codecs_benchmark_reports_every_layout(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--repeats", "1", "--scale", "0.001", "--naive-elements", "64",
                              "--plot", str(tmp_path / "codecs.png"), "--convert-config", "tiny",
                              "--convert-naming", "megatron"])
    report = bench.run(args)
    names = {f.name for f in report.figures}
    for layout in bench.LAYOUTS:
        for fig in ("decode bf16", "decode fp32", "naive decode bf16", "encode", "encode like_scale"):
            assert f"{layout} {fig}" in names
            assert report.value(f"{layout} {fig}") > 0
    decode_targets = [t for t in report.targets if "of memcpy" in t]
    assert len(decode_targets) == 2 * len(bench.LAYOUTS) and all(t.split()[0] in ("MET", "MISS") for t in decode_targets)
    rss = [t for t in report.targets if "peak RSS" in t]
    assert len(rss) == 1 and rss[0].split()[0] in ("MET", "MISS")
    assert report.value("convert peak RSS growth") > 0 and report.value("convert largest tensor") > 0
    assert (tmp_path / "codecs.png").stat().st_size > 1000
    flat = report.as_dict()
    assert "dense_fp8 decode bf16/memcpy" in flat and "mxfp4 decode fp32/mxfp4 naive decode fp32" in flat


def test_codecs_benchmark_cli_writes_json(tmp_path, capsys):
    assert main(["codecs", "--repeats", "1", "--scale", "0.001", "--naive-elements", "64",
                 "--json", str(tmp_path / "c.json"), "--convert-config", "tiny"]) == 0
    assert "memcpy" in json.loads((tmp_path / "c.json").read_text())
    assert "stored-format codecs" in capsys.readouterr().out
