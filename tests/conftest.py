"""Suite-wide test setup: CPU defaults, GPU-marker skipping, shared tiny fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# megatron-core's jit_fuser is torch.compile: a cold CPU machine would spend ~15 s compiling per process.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

DATA = Path(__file__).parent / "data"


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`/`multi_gpu` tests cleanly where CUDA is absent."""
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs more than one CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(scope="session")
def tiny_cfg():
    """The tiny test config (architecture.md §14)."""
    from dsv4flash.config import load_config

    return load_config("tiny")


@pytest.fixture()
def tiny_model(tiny_cfg):
    """A freshly initialised tiny reference model in fp32 (seed 0)."""
    from dsv4flash.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(tiny_cfg, seed=0)
