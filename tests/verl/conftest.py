"""veRL-on-CPU fixtures for tests/verl (the both-forms harness comes from tests/conftest.py).

verl 0.9.1 imports without a GPU; its vLLM-side modules need vLLM importable on CPU (`VLLM_TARGET_DEVICE=cpu`,
set by the suite conftest) and its Megatron-side ones megatron-core with the CUDA redirect (tests/mcore_cpu).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def vllm_cpu():
    """vLLM's config + distributed env (gloo, TP=1)."""
    import vllm  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.vllm._vllm_helpers import cpu_env

    with cpu_env() as config:
        yield config


@pytest.fixture
def mcore_parallel():
    """Single-rank gloo group + `initialize_model_parallel(1, 1)` under the CUDA redirect (megatron-core on CPU)."""
    import megatron.core  # noqa: F401  (a test dependency: ci/install.sh test)
    from tests.mcore_cpu import parallel

    with parallel.model_parallel(seed=1234):
        yield parallel


@pytest.fixture(scope="session")
def verl_text_run(pretrained_base, tmp_path_factory):
    """One uninterrupted `+recipe=decoder_lora_verl_cpu` run (2 GRPO steps) on the pretrained tiny base with the
    recipe's own reward (arithmetic with partial credit) -> (base, run dir, log). The end-to-end checks and the
    resume test's reference run read it."""
    from tests.verl import _runs

    out = tmp_path_factory.mktemp("verl_text") / "run"
    log = _runs.run(_runs.command("decoder_lora_verl_cpu", pretrained_base, out), out)
    return pretrained_base, out, log
