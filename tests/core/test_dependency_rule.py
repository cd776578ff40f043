"""Core (config, model, census) never imports an integration or an upstream framework."""

from __future__ import annotations

import subprocess
import sys

UPSTREAM = ("megatron", "vllm", "verl", "transformers", "transformer_engine", "dsv4flash.integrations")


def test_core_imports_no_upstream_framework():
    code = (
        "import sys, dsv4flash, dsv4flash.config, dsv4flash.release.census, dsv4flash.model.transformer, "
        "dsv4flash.release.quant_plan\n"
        "from dsv4flash.model.transformer import Transformer\n"
        "Transformer('tiny')\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {UPSTREAM!r} or m.startswith({UPSTREAM!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"core pulled in: {out}"
