"""The handoff benchmark runs end to end at tiny size and reports every figure (no timing assertions:
timings belong to `python -m dsv4flash.bench handoff`)."""

from __future__ import annotations

import argparse

import pytest

from dsv4flash.bench import BENCHMARKS


@pytest.mark.slow  # fsync'd files and the release census: ~20 s quiet, a minute on a busy machine
def test_handoff_bench_quick(tmp_path, one_thread):
    from dsv4flash.bench import handoff
    from dsv4flash.release.census import census

    assert "handoff" in BENCHMARKS
    parser = argparse.ArgumentParser()
    handoff.add_arguments(parser)
    args = parser.parse_args(["--presets", "decoder_half", "--rank", "4", "--repeats", "1", "--probe-mib", "4",
                              "--workdir", str(tmp_path)])
    figures = handoff.run(args).as_dict()
    for key in ("disk_roundtrip_GBps", "tiny_decoder_half_merged_s", "tiny_decoder_half_adapter_s",
                "v41_decoder_half_merged_s", "v41_decoder_half_adapter_s"):
        assert figures[key] > 0, key
    assert figures["tiny_decoder_half_adapter_bytes"] < figures["tiny_decoder_half_merged_bytes"]
    adapter, merged = handoff.v41_bytes("decoder_half", 4)
    assert figures["v41_decoder_half_merged_bytes"] == merged == sum(t.nbytes for t in census("flash"))
    assert figures["v41_decoder_half_adapter_bytes"] == adapter and adapter * 40 < merged
    assert not list(tmp_path.glob("*.tmp"))  # every file was renamed into place
