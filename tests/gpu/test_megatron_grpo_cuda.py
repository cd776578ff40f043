"""One Megatron actor GRPO update on CUDA at tiny size: CSA2 layers, host-pinned Engram, decoder-half LoRA.

The update is `tests/mbridge/grpo_step.py` (the bridge-built actor, the project's GRPO loss, megatron-core's
distributed Adam), the same code the CPU test runs (tests/mbridge/test_grpo_step.py). Here it runs on the GPU
with real CUDA (one NCCL rank, TF32 off, no Transformer Engine: the local backend) and is compared with the
CPU fp32 run of the same code in a child interpreter with no GPU visible:

- old-policy log-probs (before the step) to 1e-4 absolute: the same fp32 math, GPU kernels sum in another
  order (~1e-6 relative on logits);
- the GRPO loss to 1e-4 relative, the gradient norm to 1e-3 relative;
- the step itself: the log-prob change it makes (after − before, on each device) to 10% of the CPU's largest
  change, and the adapter update's direction (cosine ≥ 0.99): Adam's first step is ±lr for every entry whose
  gradient is above its eps, so an entry whose gradient is at rounding level may step either way on either
  device; such entries are few and barely move the log-probs.

Runs on the device image (Python 3.12, CUDA torch, no vLLM / TE): `bash ci/gpu_checks.sh` (docs/verl.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.mbridge import grpo_step as step
from tests.mcore.single_gpu import single_gpu_megatron

pytestmark = [pytest.mark.gpu, pytest.mark.upstream]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=1, seed=7)


def test_megatron_actor_grpo_update_on_cuda_matches_cpu(release, tmp_path, tiny_cfg):
    from dsv4flash.cpu_mode import mbridge_import

    # megatron-bridge 0.6.2 imports Transformer Engine unconditionally and the image has none: the same import
    # shim as on CPU (every TE class raises if used; the local backend uses none).
    mbridge_import.install()
    torch.manual_seed(1234)
    with single_gpu_megatron():
        gpu = step.grpo_step(release, "cuda")
    cpu = step.cpu_run_in_subprocess(release, tmp_path / "cpu.pt")
    for res in (gpu, cpu):
        step.check_update(res, tiny_cfg.decoder_start, tiny_cfg.text.num_hidden_layers)
    assert gpu.model_device.startswith("cuda") and cpu.model_device == "cpu"
    assert all(gpu.engram_pinned.values()), gpu.engram_pinned  # page-locked host tables on a CUDA machine
    assert gpu.trainable == cpu.trainable
    step.assert_same_update(gpu, cpu)
