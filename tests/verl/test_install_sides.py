"""Item 5 (dependency reality): vLLM 0.33 and veRL 0.9.1 conflict; dsv4flash never needs both; recipes hold."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_install_sides", ROOT / "ci" / "check_install_sides.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_transformers_release_satisfies_vllm_and_verl():
    """The conflict is real (from the installed wheels' own METADATA, not from our notes)."""
    c = _checker()
    vllm, verl = c.allowed(c.declared("vllm", "transformers")), c.allowed(c.declared("verl", "transformers"))
    assert vllm and verl and not (vllm & verl)


def test_side_recipes_match_the_real_pins():
    c = _checker()
    assert [p for side in c.WITH_DEPS for p in c.check(side)] == []
    assert c.no_deps_needed("rollout") == ["verl", "megatron-bridge"]
    assert c.no_deps_needed("trainer") == ["vllm"]
    assert c.no_deps_needed("cluster") == ["vllm"]
    import transformers

    assert transformers.__version__ in {str(v) for v in c.allowed(c.recipe("cluster")["transformers"])}


def test_dsv4flash_never_requires_both_stacks():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    assert "vllm" not in core and "verl" not in core
    extras = {name: " ".join(reqs).lower() for name, reqs in project["optional-dependencies"].items()}
    assert not any("vllm" in reqs and "verl" in reqs for reqs in extras.values())


BLOCK = """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == {blocked!r} or name.startswith({blocked!r} + "."):
                raise ImportError(f"{{name}} is not installed (blocked by the test)")
    sys.meta_path.insert(0, Block())
"""


def _run(blocked: str, body: str) -> dict:
    code = textwrap.dedent(BLOCK.format(blocked=blocked)) + textwrap.dedent(body)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_vllm_plugin_without_verl():
    out = _run("verl", """
        import json
        from dsv4flash.integrations.vllm import register
        print(json.dumps({k: v.value for k, v in register(model_code=True).items()}))
    """)
    assert out == {"DSV41-VLLM-001": "applied", "DSV41-VLLM-002": "applied", "DSV41-VLLM-003": "applied"}


@pytest.mark.slow
def test_verl_plugin_without_vllm():
    """On a trainer image without vLLM: rollout-side twins are skipped, the replay twin still applies."""
    out = _run("vllm", """
        import json
        import verl
        from dsv4flash.integrations.verl import register
        out = register(now=True)
        print(json.dumps({k: getattr(v, "value", "skipped") for k, v in out.items()}))
    """)
    assert out["DSV41-VERL-004"] == "applied"
    assert {out[k] for k in ("DSV41-VERL-001", "DSV41-VERL-002", "DSV41-VERL-003", "DSV41-VERL-005")} == {"skipped"}


@pytest.mark.slow
@pytest.mark.parametrize("side", ["trainer", "rollout", "cluster"])
def test_pip_resolves_each_side(side):
    """pip resolves each recipe (opt-in: it needs the package index and downloads metadata)."""
    if os.environ.get("DSV4FLASH_CHECK_INSTALL") != "1":
        pytest.skip("set DSV4FLASH_CHECK_INSTALL=1 to let pip resolve the install recipes (network)")
    got = _checker().resolve(side)
    assert got.get("verl" if side != "rollout" else "vllm")
