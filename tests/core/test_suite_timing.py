"""The suite's timing report and budget guard (tests/_timing.py), run on a throwaway suite in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._timing import directory_of, per_directory, slowest

REPO = Path(__file__).resolve().parents[2]


def test_slowest_phases_and_directory_totals():
    phases = [(3.0, "call", "tests/a/test_x.py::t1"), (0.5, "setup", "tests/a/test_x.py::t1"),
              (9.0, "setup", "tests/b/test_y.py::t2[p]"), (1.0, "call", "tests/test_top.py::t3")]
    assert slowest(phases, 2) == [(9.0, "setup", "tests/b/test_y.py::t2[p]"), (3.0, "call", "tests/a/test_x.py::t1")]
    assert per_directory(phases) == {"tests/b": (9.0, 1), "tests/a": (3.5, 1), "tests": (1.0, 1)}
    assert directory_of("tests/mcore/test_z.py::C::t") == "tests/mcore"


def _suite(tmp_path: Path, warn: str, fail: str) -> subprocess.CompletedProcess:
    (tmp_path / "suite" / "sub").mkdir(parents=True, exist_ok=True)
    (tmp_path / "suite" / "sub" / "test_sleepy.py").write_text(
        "import time\n\ndef test_sleeps():\n    time.sleep(0.3)\n\ndef test_quick():\n    pass\n")
    (tmp_path / "pytest.ini").write_text(f"[pytest]\ntest_time_warn_minutes = {warn}\n"
                                         f"test_time_fail_minutes = {fail}\n")
    # loaded by path, as the suite's root conftest registers it (another installed package owns the name `tests`)
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('suite_timing', {str(REPO / 'tests' / '_timing.py')!r})\n"
        "sys.modules['suite_timing'] = module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "pytest_plugins = ['suite_timing']\n")
    env = {"PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--timing-json", str(tmp_path / "t.json"), "suite"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_report_prints_and_the_budget_warns_then_fails(tmp_path):
    import json

    within = _suite(tmp_path, "10", "20")
    assert within.returncode == 0, within.stdout[-2000:]
    assert "slowest test phases" in within.stdout and "time per test directory" in within.stdout
    assert "call     suite/sub/test_sleepy.py::test_sleeps" in within.stdout
    assert "WARNING" not in within.stdout
    figures = json.loads((tmp_path / "t.json").read_text())
    assert figures["directories"]["suite/sub"]["tests"] == 2 and figures["slowest"][0]["seconds"] >= 0.3

    warned = _suite(tmp_path, "0.001", "20")  # 0.06 s
    assert warned.returncode == 0 and "WARNING: the suite took" in warned.stdout, warned.stdout[-2000:]

    failed = _suite(tmp_path, "0.001", "0.002")
    assert failed.returncode == 1 and "FAILED: the suite took" in failed.stdout, failed.stdout[-2000:]
    assert "2 passed" in failed.stdout  # the tests passed; the budget failed the run


def test_loadgroup_runs_whole_machine_tests_and_module_fixtures_on_one_worker(tmp_path):
    """A real `-n 2 --dist loadgroup` run of a throwaway suite with tests/_scheduling.py: every whole_machine test
    (two modules) on one worker, the users of a module fixture on one worker, a module's both-forms tests (the
    `patch_form` fixture of dsv4flash/patchseries/testing.py, here a stand-in of that name) on one worker, the
    whole_machine tests first."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    whole_machine: uses both cores\n")
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('suite_scheduling', "
        f"{str(REPO / 'tests' / '_scheduling.py')!r})\n"
        "sys.modules['suite_scheduling'] = module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"spec = importlib.util.spec_from_file_location('suite_timing', {str(REPO / 'tests' / '_timing.py')!r})\n"
        "sys.modules['suite_timing'] = module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "pytest_plugins = ['suite_scheduling', 'suite_timing']\n"
        "import pytest\n\n"
        "@pytest.fixture(params=['runtime', 'series'])\n"
        "def patch_form(request):\n"
        "    return request.param\n")
    record = ("import os, time\nimport pytest\n\n"
              "def _seen(name):\n"
              f"    with open({str(tmp_path / 'seen.txt')!r}, 'a') as f:\n"
              "        f.write(f\"{name} {os.environ['PYTEST_XDIST_WORKER']} {time.monotonic()}\\n\")\n"
              "    time.sleep(0.3)\n\n")
    for module in ("a", "b"):
        (suite / f"test_{module}.py").write_text(
            record + "@pytest.fixture(scope='module')\ndef shared():\n    return object()\n\n"
            + "".join(f"def test_plain_{i}():\n    _seen('{module}.plain')\n\n" for i in range(3))
            + "".join(f"def test_shared_{i}(shared):\n    _seen('{module}.shared')\n\n" for i in range(3))
            + "".join(f"def test_forms_{i}(patch_form):\n    _seen('{module}.forms')\n\n" for i in range(3))
            + (f"@pytest.mark.whole_machine\ndef test_forms_machine(patch_form):\n    _seen('{module}.forms')\n\n"
               if module == "b" else "")
            + "".join(f"@pytest.mark.whole_machine\ndef test_machine_{i}():\n    _seen('machine')\n\n"
                      for i in range(2)))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--no-loadscope-reorder", "--timing-json", str(tmp_path / "t.json"), "suite"],
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    rows = [line.split() for line in (tmp_path / "seen.txt").read_text().splitlines()]
    workers: dict[str, set[str]] = {}
    for name, worker, _ in rows:
        workers.setdefault(name, set()).add(worker)
    assert len(workers["machine"]) == 1 and len(workers["a.shared"]) == 1 and len(workers["b.shared"]) == 1, workers
    assert len(workers["a.forms"]) == 1 and len(workers["b.forms"]) == 1, workers
    assert workers["b.forms"] == workers["machine"], workers  # a whole_machine both-forms test takes its module's
    assert {w for name, w, _ in rows} == {"gw0", "gw1"}  # the other work went to both workers
    (chain,) = workers["machine"]
    on_chain = [name for name, worker, _ in sorted(rows, key=lambda r: float(r[2])) if worker == chain]
    assert sorted(on_chain[:12]) == ["b.forms"] * 8 + ["machine"] * 4  # the chain is its worker's first work
    import json

    figures = json.loads((tmp_path / "t.json").read_text())  # each worker's busy time, the chain's
    assert set(figures["workers"]) == {"gw0", "gw1"} and 1.2 <= figures["whole_machine_s"] < sum(
        figures["workers"].values()), figures
    assert "busy per worker: gw0" in done.stdout and "the whole_machine unit" in done.stdout
