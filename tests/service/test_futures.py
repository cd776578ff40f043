"""OrderedExecutor: strict submission order, errors delivered to the future, and no idle thread left behind."""

from __future__ import annotations

import threading
import time

import pytest

from dsv4flash.service.futures import OrderedExecutor


def test_order_errors_and_idle_exit():
    ex = OrderedExecutor("unit", idle_s=0.2)
    seen: list[int] = []
    futures = [ex.submit(seen.append, i) for i in range(200)]
    [f.result(10) for f in futures]
    assert seen == list(range(200)) and futures[-1].request_id == "unit:200"
    with pytest.raises(ZeroDivisionError):
        ex.submit(lambda: 1 / 0).result(10)
    deadline = time.time() + 5
    while ex._thread is not None and time.time() < deadline:
        time.sleep(0.05)
    assert ex._thread is None  # the idle worker exited
    assert not any(t.name == "dsv4flash-unit" for t in threading.enumerate())
    more = [ex.submit(seen.append, i) for i in range(200, 300)]  # a new worker picks up, still in order
    [f.result(10) for f in more]
    assert seen == list(range(300))
