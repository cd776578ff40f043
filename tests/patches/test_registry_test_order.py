"""Regression: the registry's "no twin left applied" check passes after a test that imports veRL.

`tests/train/test_losses.py` imports `verl.trainer.ppo.rollout_corr_helper`, which imports `verl.workers.config`;
the installed `verl.plugins` entry point then applies DSV41-VERL-010/011 (documented plugin behaviour). Run in
that order in one pytest process, `test_runtime_registry.py` must still pass, and the veRL twins must really
have been applied by the plugin (so the order is the one that used to fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.patches, pytest.mark.upstream, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
RUN = """
    import json, sys
    import pytest
    rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/train/test_losses.py",
                      "tests/patches/test_runtime_registry.py"])
    from dsv4flash.patching import twins
    from dsv4flash.integrations import verl as plugin
    applied = sorted(pid for pid, outcome in plugin.OUTCOMES.items()
                     if outcome is twins.Outcome.APPLIED and twins.REGISTRY.get(pid).applied)
    print(json.dumps({"rc": int(rc), "plugin_applied": applied}))
"""


def test_registry_checks_pass_after_a_test_that_imports_verl():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN)], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0, proc.stdout[-3000:]
    assert {"DSV41-VERL-010", "DSV41-VERL-011"} <= set(result["plugin_applied"]), result
