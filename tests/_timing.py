"""Where the suite's time goes: the slowest test phases, the time per test directory, and the time budget.

A pytest plugin (registered in tests/conftest.py). At the end of a run it prints the 30 slowest phases (setup,
call, teardown: a fixture's cost shows as the setup of the first test that builds it) and the total per
directory under tests/, under pytest-xdist each worker's busy seconds and the `whole_machine` unit's (whether that
serial chain is the critical path), and holds the run to the suite's budget: past `test_time_warn_minutes` of wall
time it warns with the top offenders, past `test_time_fail_minutes` the run fails. `--timing-json PATH` writes the
same figures, and every phase, for docs/testing.md. Under pytest-xdist only the controller reports (workers'
reports reach it).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

TOP = 30


def pytest_addoption(parser):
    """The budget (ini) and the JSON dump (command line)."""
    parser.addini("test_time_warn_minutes", "warn when the run's wall time exceeds this", default="35")
    parser.addini("test_time_fail_minutes", "fail the run when its wall time exceeds this", default="55")
    parser.addoption("--timing-json", metavar="PATH", default=None,
                     help="write the per-phase durations and per-directory totals to PATH")


def pytest_configure(config):
    """Register the collector in the controller only (or in a plain serial run)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteTiming(config), "dsv4flash-suite-timing")


def directory_of(nodeid: str) -> str:
    """`tests/<dir>` of a node id (`tests` for the suite's top-level modules)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def slowest(phases: list[tuple[float, str, str]], n: int = TOP) -> list[tuple[float, str, str]]:
    """The `n` longest (seconds, phase, nodeid) entries, longest first."""
    return sorted(phases, key=lambda p: -p[0])[:n]


def per_directory(phases: list[tuple[float, str, str]]) -> dict[str, tuple[float, int]]:
    """tests/<dir> -> (seconds over all its phases, number of tests), longest first."""
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    for duration, _phase, nodeid in phases:
        seconds[directory_of(nodeid)] += duration
        tests[directory_of(nodeid)].add(nodeid)
    return {d: (seconds[d], len(tests[d])) for d in sorted(seconds, key=lambda d: -seconds[d])}


class SuiteTiming:
    """Collects every phase's duration and reports them with the budget check at the end of the session."""

    def __init__(self, config):
        self.config = config
        self.phases: list[tuple[float, str, str]] = []
        self.busy: dict[str, float] = defaultdict(float)  # xdist worker -> seconds of phases it ran
        self.chain = 0.0  # seconds of the whole_machine unit (one worker's serial work)
        self.start = time.monotonic()
        self.warn_s = float(config.getini("test_time_warn_minutes")) * 60
        self.fail_s = float(config.getini("test_time_fail_minutes")) * 60
        self.wall = 0.0

    def pytest_runtest_logreport(self, report):
        """Record one phase (xdist hands the controller each worker's reports)."""
        nodeid, _, group = report.nodeid.partition("@")  # loadgroup's "@group" suffix is not part of the name
        self.phases.append((report.duration, report.when, nodeid))
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
        if worker:
            self.busy[worker] += report.duration
        if group == "whole_machine":  # tests/_scheduling.py's WHOLE_MACHINE unit (this plugin loads on its own)
            self.chain += report.duration

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        """Past the failing budget the run fails, whatever its tests said."""
        self.wall = time.monotonic() - self.start
        if self.wall > self.fail_s and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        path = self.config.getoption("--timing-json")
        if path:
            Path(path).write_text(json.dumps({
                "wall_s": round(self.wall, 1),
                "slowest": [{"seconds": round(d, 2), "phase": w, "test": n} for d, w, n in slowest(self.phases)],
                "directories": {d: {"seconds": round(s, 1), "tests": c}
                                for d, (s, c) in per_directory(self.phases).items()},
                "workers": {w: round(s, 1) for w, s in sorted(self.busy.items())},
                "whole_machine_s": round(self.chain, 1),
                "phases": [{"seconds": round(d, 2), "phase": w, "test": n} for d, w, n in self.phases],
            }, indent=1) + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        """The slowest-phases table, the per-directory totals and the budget verdict."""
        tr = terminalreporter
        if not self.phases:
            return
        tr.write_sep("=", f"{TOP} slowest test phases (a fixture's cost is the setup of its first test)")
        for duration, when, nodeid in slowest(self.phases):
            tr.write_line(f"{duration:9.1f}s  {when:<8s} {nodeid}")
        tr.write_sep("-", "time per test directory (sum over its phases; under xdist, worker time)")
        for directory, (seconds, count) in per_directory(self.phases).items():
            tr.write_line(f"{seconds:9.1f}s  {count:5d} tests  {directory}")
        total = sum(p[0] for p in self.phases)
        tr.write_line(f"{total:9.1f}s  in all phases; wall time {self.wall:.1f}s")
        if self.busy:  # the idle worker's slack says whether the whole_machine chain is the critical path
            tr.write_line("busy per worker: " + ", ".join(f"{w} {s:.0f}s" for w, s in sorted(self.busy.items()))
                          + f"; the whole_machine unit (one worker, serial) {self.chain:.0f}s")
        if self.wall > self.fail_s:
            tr.write_sep("!", f"FAILED: the suite took {self.wall / 60:.1f} min, over its "
                              f"{self.fail_s / 60:.0f}-minute limit (test_time_fail_minutes): make the offenders "
                              "above cheaper")
        elif self.wall > self.warn_s:
            tr.write_sep("!", f"WARNING: the suite took {self.wall / 60:.1f} min, over its "
                              f"{self.warn_s / 60:.0f}-minute budget (test_time_warn_minutes); top offenders:")
            for duration, when, nodeid in slowest(self.phases, 10):
                tr.write_line(f"{duration:9.1f}s  {when:<8s} {nodeid}")
