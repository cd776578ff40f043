"""`python -m dsv4flash.bench faults` runs the same table and writes the totals as JSON."""

from __future__ import annotations

import json

from dsv4flash.bench.__main__ import main
from dsv4flash.faultcases import OUTCOMES, all_cases


def test_bench_faults_prints_and_writes_the_totals(tmp_path, capsys):
    service_cases = [c for c in all_cases() if c.area == "service"]
    assert main(["faults", "--area", "service", "--no-postgres", "--json", str(tmp_path / "faults.json"),
                 "--plot", str(tmp_path / "faults.png")]) == 0
    out = capsys.readouterr().out
    figures = json.loads((tmp_path / "faults.json").read_text())
    assert figures["tried"] == len(service_cases) == figures["as registered"]
    assert sum(figures[o] for o in OUTCOMES) == figures["tried"]
    assert figures["clean error"] == sum(c.expect == "clean error" for c in service_cases)
    assert all(figures[o] == 0 for o in ("silent wrong", "data lost", "left behind", "unclean error", "hung"))
    assert "MET   every case as registered" in out and "MISS" not in out
    assert (tmp_path / "faults.png").stat().st_size > 0
