"""Interleaved timing on a shared machine: functions run round-robin from cold caches, and paired ratios.

`interleaved_rounds` runs every function once per round, in a fresh seeded order, each call after a cache
flush, and returns every call's time: a load change hits all functions alike, and no function always follows
the same predecessor (measured: one `gather_stored` took 6.8 ms right after a memcpy and 2.3 ms elsewhere).

`paired_ratio` compares two of them fairly. The best of many variants, each a best-of-N, is a minimum over
more noisy draws than one function's best-of-N: that selection bias favours the variants whatever the
implementation. So a separate calibration pass picks the reference variant, and the comparison then times the
product and that one variant over the same rounds, the same number of draws each; the statistic is the median
over rounds of t_reference / t_product (both timed within one round, milliseconds apart, so a slow drift of
the load cancels in each ratio, and the median ignores the rounds a spike hit). It is 1 for equal work and
reads 0.5 for a product that does the work twice: it cannot report a slower implementation as reaching it.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable, Optional

import torch

EVICT_BYTES = 64 << 20  # written before every timed call: twice a 32 MiB L3


def interleaved_rounds(fns: dict[str, Callable[[], object]], rounds: int, *, device: Optional[torch.device] = None,
                       evict_bytes: int = EVICT_BYTES, seed: int = 0, progress: Optional[Callable[[], None]] = None
                       ) -> dict[str, list[float]]:
    """Seconds of every call of each fn over `rounds` rounds (each round: every fn once, shuffled, caches flushed).

    The flush (an `evict_bytes` write) makes each call read its inputs from DRAM, as a new micro-batch out of a
    table far larger than any cache does, instead of finding them in L3 left by the previous call. One
    untimed warm-up call each first (allocator, staging buffers, page faults)."""
    scratch = torch.empty(evict_bytes, dtype=torch.uint8) if evict_bytes else None
    for fn in fns.values():
        fn()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order, rng = list(fns), random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            if scratch is not None:
                scratch.fill_(1)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
        if progress is not None:
            progress()
    return times


def paired_ratios(reference: list[float], product: list[float]) -> list[float]:
    """Per-round speed of the product relative to the reference: t_reference / t_product (1 = equal, < 1 slower)."""
    if len(reference) != len(product) or not reference:
        raise ValueError(f"paired ratios need the same non-zero number of rounds, got {len(reference)} and "
                         f"{len(product)}")
    return [r / p for r, p in zip(reference, product)]


def paired_ratio(reference: list[float], product: list[float]) -> float:
    """The median over rounds of t_reference / t_product: the fair product-vs-reference statistic (see module)."""
    return statistics.median(paired_ratios(reference, product))


def quartiles(values: list[float]) -> tuple[float, float]:
    """(25th, 75th) percentile: the spread of the per-round ratios, printed beside their median."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _sync(device: Optional[torch.device]) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
