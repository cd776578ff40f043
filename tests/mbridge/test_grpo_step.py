"""One Megatron actor GRPO update on CPU (the CPU side of tests/gpu/test_megatron_grpo_cuda.py, same code):
bridge-built CSA2 model with the pinned Engram and the decoder-half LoRA, the project's GRPO loss, one
megatron-core distributed-Adam step."""

from __future__ import annotations

import pytest
import torch

from tests.mbridge import grpo_step as step

pytestmark = [pytest.mark.upstream]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=1, seed=7)


@pytest.fixture(scope="module")
def result(mbridge, mcore, release):
    """The update on one gloo rank under the CUDA redirect (the `mcore` session, as `step.cpu_run` sets up)."""
    return step.grpo_step(release, "cpu")


@pytest.mark.slow  # ~22 s: megatron-bridge import, bridge load, one step
def test_one_grpo_update_on_cpu(result, tiny_cfg):
    step.check_update(result, tiny_cfg.decoder_start, tiny_cfg.text.num_hidden_layers)
    assert result.model_device == "cpu"



@pytest.mark.slow  # ~25 s: a second interpreter
def test_the_cpu_run_the_gpu_test_compares_with_is_this_run(result, release, tmp_path):
    """The child-interpreter CPU run (what tests/gpu compares CUDA with) repeats this process's run bit for bit."""
    child = step.cpu_run_in_subprocess(release, tmp_path / "cpu.pt")
    assert torch.equal(child.logp_before, result.logp_before) and torch.equal(child.logp_after, result.logp_after)
    assert child.loss == result.loss and child.trainable == result.trainable
    step.assert_same_update(child, result)  # the GPU test's comparison, on two equal runs
