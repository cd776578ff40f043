"""The service benchmark's sampling part runs and reports its figures (no timing assertions: timings belong to
`python -m dsv4flash.bench service`)."""

from __future__ import annotations

import argparse


def test_service_bench_sampling_part_quick(one_thread, tmp_path):
    from dsv4flash.bench import service

    parser = argparse.ArgumentParser()
    service.add_arguments(parser)
    args = parser.parse_args(["--part", "sampling", "--seq", "9", "--decode-tokens", "2", "--repeats", "1",
                              "--plot", str(tmp_path / "service.png")])
    report = service.run(args)
    figures = report.as_dict()
    for key in ("sampling_recompute_N8", "sampling_separate_N8", "sampling_shared_prefill_N8", "sampling_shared_N8"):
        assert figures[key] > 0, key
    assert len(report.targets) == 1 and "same continuation" in report.targets[0]
    assert (tmp_path / "service.png").stat().st_size > 0
