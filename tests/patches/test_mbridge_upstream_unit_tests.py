"""The upstream-style unit tests a megatron-bridge format-patch adds, run here on the patched tree.

Each file the patch adds under tests/unit_tests/ runs in a fresh pytest on a copy of the pinned release with
the patch (and its Depends-On) applied; a patch on megatron-core patches (`Depends-On: megatron-lm/<Patch-Id>`)
also gets the pinned megatron-core with the megatron-lm series applied up to that patch, on the path before
the installed one. megatron-bridge 0.6.2 needs Python 3.12 and Transformer Engine to import, so the run's
conftest installs the CPU import shim (`dsv4flash.cpu_mode.mbridge_import`) first, exactly as this project's own
megatron-bridge tests do; the test files themselves run unchanged.
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
SERIES_MAP = load_series(ROOT / "patches")
SERIES = SERIES_MAP["megatron-bridge"]
CASES = [(p.patch_id, f) for p in SERIES.patches for f in p.files
         if f.startswith("tests/unit_tests/") and f.endswith(".py") and f"--- /dev/null\n+++ b/{f}" in p.diff]
CONFTEST = """from pathlib import Path

from dsv4flash.cpu_mode import mbridge_import

mbridge_import.install()
import megatron.bridge
import megatron.core

assert Path(megatron.bridge.__file__).resolve().is_relative_to(Path({root!r}).resolve()), megatron.bridge.__file__
for other in {others!r}:  # a patched megatron-core (Depends-On: megatron-lm/...) is the one imported
    assert Path(megatron.core.__file__).resolve().is_relative_to(Path(other).resolve()), megatron.core.__file__
"""


def test_every_megatron_bridge_patch_adds_unit_tests():
    assert {pid for pid, _ in CASES} == {p.patch_id for p in SERIES.patches}


@pytest.mark.slow
@pytest.mark.parametrize("patch_id, rel", CASES, ids=[f"{pid}:{Path(rel).name}" for pid, rel in CASES])
def test_upstream_unit_tests_pass_on_the_patched_tree(patch_id, rel, tmp_path):
    opts = fetch.FetchOptions(source=os.environ.get("DSV4FLASH_PATCH_SOURCE", "auto"))
    copy = copies.patched_copy(SERIES, (patch_id,), opts)
    others = copies.upstream_dependency_copies(SERIES_MAP, SERIES.by_id()[patch_id], opts)
    assert (copy.root / rel).is_file(), f"{rel} missing from the patched copy"
    test_file = tmp_path / rel  # run from a scratch root whose conftest installs the shim before collection
    test_file.parent.mkdir(parents=True)
    shutil.copyfile(copy.root / rel, test_file)
    (tmp_path / "conftest.py").write_text(CONFTEST.format(root=str(copy.root), others=[str(o.root) for o in others]))
    env = {k: v for k, v in os.environ.items() if k != "DSV4FLASH_STRICT_SKIPS"}
    env["PYTHONPATH"] = os.pathsep.join([str(copy.sys_path), *(str(o.sys_path) for o in others), str(ROOT)])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(test_file),
                           "--rootdir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary), summary
    assert not re.search(r"\b(failed|error|errors|skipped)\b", summary), summary
