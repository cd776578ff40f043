"""The decode benchmark runs end to end at tiny sizes and reports every figure and target (no timing
assertions: timings belong to `python -m dsv4flash.bench decode`)."""

from __future__ import annotations

import argparse

from dsv4flash.bench import BENCHMARKS
from dsv4flash.config import load_config


def test_decode_bench_quick(tmp_path, one_thread):
    from dsv4flash.bench import decode

    assert "decode" in BENCHMARKS
    parser = argparse.ArgumentParser()
    decode.add_arguments(parser)
    args = parser.parse_args(["--lengths", "4", "12", "--exact-upto", "6", "--full-samples", "3", "--adapters", "3",
                              "--plot", str(tmp_path / "decode.png")])
    report = decode.run(args)
    figures = report.as_dict()
    for key in ("one_token_forward_tok_s", "prefill_tok_s", "full_4_tok_s", "cached_4_tok_s", "full_12_tok_s",
                "cached_12_tok_s", "cached_12_tok_s/full_12_tok_s"):
        assert figures[key] > 0, key
    assert sum(t.startswith(("MET", "MISS")) for t in report.targets) == 2
    # Memory: each extra adapter adds exactly its decoder layers' window KV (+ its Engram look-back ids).
    cfg = load_config("tiny")
    window = (cfg.text.sliding_window - 1) * cfg.text.head_dim * 4
    assert figures["tiny_extra_adapter_bytes"] == (len(cfg.backbone_plan) - cfg.decoder_start) * window + 2 * 3 * 8
    full, per = decode.v41_prompt_cache_bytes(8192)
    assert per == 20 * 127 * 512 * 2 and full == 40 * 127 * 512 * 2 + (3 * 4096 + 8192) * (512 + 128) * 2
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
