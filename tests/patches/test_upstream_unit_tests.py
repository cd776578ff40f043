"""The upstream-style unit tests a megatron-lm format-patch adds, run here on the patched tree.

Each file the patch adds under tests/unit_tests/ runs in a fresh pytest on a copy of the pinned release with
the patch (and its Depends-On) applied. Upstream's `tests.unit_tests.test_utilities.Utils` (NCCL, one GPU
per rank) is not in the wheel: files that use it get a CPU stand-in with the same API (one gloo rank under
the CUDA redirect of tests/mcore_cpu), so they run unchanged; a test needing more ranks skips itself
(upstream's own `Utils.world_size` guard: two pipeline stages, two context-parallel ranks) and runs in
upstream CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4flash.patchseries import copies, fetch
from dsv4flash.patchseries.series import load_series

pytestmark = [pytest.mark.patches, pytest.mark.upstream]
ROOT = Path(__file__).resolve().parents[2]
SERIES = load_series(ROOT / "patches")["megatron-lm"]


def _added_unit_tests(patch) -> list[str]:
    """Files under tests/unit_tests/ that the patch creates."""
    return [f for f in patch.files if f.startswith("tests/unit_tests/") and f.endswith(".py")
            and f"--- /dev/null\n+++ b/{f}" in patch.diff]


CASES = [(p.patch_id, rel) for p in SERIES.patches for rel in _added_unit_tests(p)]

UTILS_STANDIN = '''"""CPU stand-in for upstream's tests/unit_tests/test_utilities.py (written by dsv4flash's test run)."""
import contextlib


class Utils:
    world_size = 1
    rank = 0
    _stack = None

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, **kwargs):
        from tests.mcore_cpu import parallel

        Utils.destroy_model_parallel()
        Utils._stack = contextlib.ExitStack()
        Utils._stack.enter_context(parallel.model_parallel(tp=tensor_model_parallel_size,
                                                           pp=pipeline_model_parallel_size))

    @staticmethod
    def destroy_model_parallel():
        if Utils._stack is not None:
            Utils._stack.close()
            Utils._stack = None
'''
# `tests` resolves to the stand-in folder first and this repository's tests/ second (the verl wheel ships a
# regular top-level `tests` package that would shadow both); optimizers see host tensors as CUDA types.
CONFTEST = '''import contextlib, importlib.machinery, importlib.util, sys

for _name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
    del sys.modules[_name]
_tests = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("tests", None, is_package=True))
_tests.__path__ = [{standin!r}, {project!r}]
sys.modules["tests"] = _tests

import pytest
from tests.mcore.test_engram_pinned import cuda_type_names


@pytest.fixture(autouse=True)
def _cuda_type_names():
    with cuda_type_names():
        yield
'''


# Skip reasons of in-patch tests that need more than one rank (covered by the multi-rank both-forms tests).
MULTI_RANK_GUARDS = ("needs at least two pipeline stages", "needs at least two context-parallel ranks")


def test_every_upstream_patch_but_the_backport_adds_unit_tests():
    assert {pid for pid, _ in CASES} == {p.patch_id for p in SERIES.patches} - {"DSV41-MCORE-001"}


@pytest.mark.slow
@pytest.mark.parametrize("patch_id, rel", CASES, ids=[f"{pid}:{Path(rel).name}" for pid, rel in CASES])
def test_upstream_unit_tests_pass_on_the_patched_tree(patch_id, rel, tmp_path):
    copy = copies.patched_copy(SERIES, (patch_id,), fetch.FetchOptions(source=os.environ.get(
        "DSV4FLASH_PATCH_SOURCE", "auto")))
    assert (copy.root / rel).is_file(), f"{rel} missing from the patched copy"
    run_dir = tmp_path / "run"
    (run_dir / rel).parent.mkdir(parents=True)
    shutil.copyfile(copy.root / rel, run_dir / rel)
    standin = tmp_path / "standin" / "tests"
    (standin / "unit_tests").mkdir(parents=True)
    (standin / "unit_tests" / "test_utilities.py").write_text(UTILS_STANDIN)
    (run_dir / "conftest.py").write_text(CONFTEST.format(standin=str(standin), project=str(ROOT / "tests")))
    env = {k: v for k, v in os.environ.items() if k != "DSV4FLASH_STRICT_SKIPS"}  # upstream's own skips
    env["PYTHONPATH"] = os.pathsep.join([str(copy.sys_path), str(ROOT)])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", rel,
                           "--rootdir", str(run_dir)], cwd=run_dir, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]  # e.g. "3 passed, 1 skipped, 7 warnings in 1.91s"
    assert re.search(r"\b\d+ passed\b", summary) and not re.search(r"\b(failed|error|errors)\b", summary), summary
    for line in proc.stdout.splitlines():  # the only skips allowed: upstream-style guards for more ranks
        if line.startswith("SKIPPED"):
            assert any(guard in line for guard in MULTI_RANK_GUARDS), line
