"""DeepseekV41ForCausalLM on CUDA: a release checkpoint loads onto the GPU, saves back bit-exactly from there,
and gives the CPU model's logits and greedy tokens (run by ci/gpu_checks.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dsv4flash  # noqa: F401  (registers the auto classes)
from dsv4flash_bridge.safetensors_io import SafetensorsReader
from dsv4flash_bridge.synthetic import write_release_checkpoint

pytestmark = pytest.mark.gpu


def _tensor_bytes(directory: Path) -> dict[str, bytes]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with SafetensorsReader(shard) as reader:
            for name in reader.names():
                out[name] = reader.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()
    return out


def test_release_checkpoint_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM

    release = write_release_checkpoint(tmp_path / "release", "tiny", shards=2, seed=4)
    cuda = AutoModelForCausalLM.from_pretrained(release, device="cuda")
    assert all(p.device.type == "cuda" for p in cuda.parameters())
    cuda.save_pretrained(tmp_path / "saved")
    assert _tensor_bytes(tmp_path / "saved") == _tensor_bytes(release)

    cpu = AutoModelForCausalLM.from_pretrained(release)
    ids = torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(cuda(ids.cuda()).logits.cpu(), cpu(ids).logits, rtol=1e-3, atol=1e-3)
    greedy = cuda.generate(ids.cuda(), max_new_tokens=4, do_sample=False).cpu()
    assert torch.equal(greedy[:, :16], ids) and greedy.shape == (2, 20)
