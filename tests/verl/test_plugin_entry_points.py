"""Both plugins load through their real entry-point groups in a fresh process (vLLM's and veRL's loaders).

One subprocess does everything (importing vLLM and veRL cold costs tens of seconds): it installs a minimal
distribution declaring the same entry points as pyproject.toml and records what each loader did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROBE = """
    import json, sys
    import verl
    from dsv4flash.integrations import verl as plugin
    before = sorted(plugin.OUTCOMES)
    heavy = "verl.workers.engine.megatron.transformer_impl" in sys.modules
    import verl.workers.rollout.vllm_rollout.utils
    after = {k: getattr(v, "value", repr(v)) for k, v in plugin.OUTCOMES.items()}
    from verl.utils.vllm.utils import VLLMHijack
    marker = getattr(VLLMHijack.__dict__["hijack"], "__dsv4flash_patch__", None)
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm import ModelRegistry
    entry = ModelRegistry.models["DeepseekV41ForCausalLM"]
    print(json.dumps({"before": before, "heavy": heavy, "after": after, "marker": marker,
                      "model": [entry.module_name, entry.class_name]}))
"""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("entry_points")
    info = tmp / "site" / "dsv4flash_ep_probe-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4flash-ep-probe\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ndsv4flash_probe = dsv4flash.integrations.vllm:register\n\n"
        "[verl.plugins]\ndsv4flash_probe = dsv4flash.integrations.verl.plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp / "site"), str(ROOT)]), "VLLM_TARGET_DEVICE": "cpu",
           "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=str(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_verl_plugin_is_imported_and_applies_nothing_eagerly(loaded):
    """`import verl` imports our plugin module; no twin is applied and no heavy module imported yet."""
    assert loaded["before"] == [] and loaded["heavy"] is False


def test_verl_twins_follow_their_modules(loaded):
    """Importing the rollout worker module applies its twins, before its worker extension can hijack."""
    assert loaded["after"]["DSV41-VERL-001"] == "applied"
    assert loaded["after"]["DSV41-VERL-003"] == "applied"
    assert "DSV41-VERL-004" not in loaded["after"]  # the Megatron engine was never imported in this process
    assert loaded["marker"] == "DSV41-VERL-001"


def test_vllm_general_plugin_registers_the_lora_model(loaded):
    assert loaded["model"] == ["dsv4flash.integrations.vllm.model", "DeepseekV41ForCausalLMWithLoRA"]


def test_gate_switches_a_twin_off(monkeypatch):
    """A twin's gate variable set to `off` keeps stock behaviour, whatever the installed version."""
    from tests.vllm._twins import twin

    monkeypatch.setenv("DSV4FLASH_VLLM_LORA_MODEL", "off")
    t = twin("DSV41-VLLM-001")
    with t.suspended():
        assert t.apply().value == "disabled"
        assert not t.applied
