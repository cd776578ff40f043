"""The worked example of docs/lifecycle.md runs as written (train → save → sample → tag → rollback → serve)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def test_worked_example_runs(capsys):
    text = DOC.read_text()
    section = text.split("## Worked example", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {"__name__": "lifecycle_example"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # intra-op spinning on a shared 2-core runner costs more than it gains here
    try:
        exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "LoadAccount(" in out and "GCReport(blobs_deleted=0" in out
    store, first = namespace["store"], namespace["first"]
    record = store.policy("math-sft")
    assert record.tags["prod"] == first and record.rollout_count == 1 and record.state.step == 2
    assert (Path(namespace["root"]) / "peft" / "adapter_config.json").is_file()
    # the head revision is a packed MoE LoRA revision under the canonical dsv4flash.lora keys
    assert store.catalog.lookup(record.head).format == "packed_moe_lora/1"
