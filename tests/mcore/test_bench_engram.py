"""The engram benchmark on realistic ids: real n-gram hashes of the built-in tasks (no timing assertions:
timings belong to `python -m dsv4flash.bench engram`)."""

from __future__ import annotations

import argparse

import torch


def test_task_row_ids_are_the_release_hashes_of_the_task_streams():
    from dsv4flash.bench.engram import task_row_ids
    from dsv4flash.config import load_config

    ids = task_row_ids(2048, 24, rows=10**6)
    assert ids.shape == (2048, 24) and int(ids.min()) >= 0 and int(ids.max()) < 10**6
    distinct = torch.unique(ids).numel()
    assert distinct < 0.5 * ids.numel()  # task text repeats its n-grams: realistic ids deduplicate
    unfolded = task_row_ids(2048, 24, rows=2**62)  # no fold: the layer-1 bucket ranges of the release
    layout = load_config("flash").engram_layouts[0]
    offsets = [o for order in layout.offsets for o in order]
    primes = [p for order in layout.primes for p in order]
    for col in range(24):  # each (order, head) column lands in its own prime bucket
        lo, hi = offsets[col], offsets[col] + primes[col]
        assert bool(((unfolded[:, col] >= lo) & (unfolded[:, col] < hi)).all()), col


def test_engram_bench_quick(one_thread):
    from dsv4flash.bench import engram

    parser = argparse.ArgumentParser()
    engram.add_arguments(parser)
    report = engram.run(parser.parse_args(["--table-gib", "0.01", "--tokens", "512", "--repeats", "1"]))
    figures = report.as_dict()
    for key in ("memcpy_GBps", "limit_GBps", "limit_distinct_GBps", "gather_GBps", "gather_dedup_GBps", "lookup_GBps",
                "naive_GBps", "gather_GBps/limit_GBps"):
        assert figures[key] > 0, key
    assert "tasks ids" in report.title and len(report.targets) == 1
