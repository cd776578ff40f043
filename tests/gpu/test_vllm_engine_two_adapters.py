"""An actual vLLM 0.33 engine serving a V4.1 checkpoint with two LoRA adapters at once (GPU).

Adapters touch only the paths stock vLLM ignores (grouped `wo_a`, compressor `wkv`/`wgate`), so any change in
the outputs proves the patched call sites run inside the real engine. Checkpoint: `$DSV4FLASH_V41_CHECKPOINT`
or a synthetic small one (tests/gpu/_small_v41.py) generated into `$DSV4FLASH_GPU_CACHE`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.upstream, pytest.mark.slow]
PROMPTS = [[100 + 7 * i + j for j in range(48)] for i in range(4)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from vllm import LLM

    from tests.gpu import _small_v41

    cache = Path(os.environ.get("DSV4FLASH_GPU_CACHE", tmp_path_factory.mktemp("v41")))
    model = _small_v41.checkpoint(cache)
    adapters = tmp_path_factory.mktemp("adapters")
    paths = {
        "a": _small_v41.write_adapter(adapters / "a", model, seed=1, shared_a=False),
        "b": _small_v41.write_adapter(adapters / "b", model, seed=2, shared_a=True),
        "zero": _small_v41.write_adapter(adapters / "zero", model, seed=3, shared_a=False, zero=True),
    }
    llm = LLM(model=str(model), enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3,
              max_model_len=1024, enforce_eager=True, skip_tokenizer_init=True, gpu_memory_utilization=0.85,
              trust_remote_code=False, limit_mm_per_prompt={"image": 0})
    return llm, paths


def _generate(served, requests):
    """requests: [(prompt ids, adapter name | None)] -> per request (token ids, their logprobs)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    llm, paths = served
    ids = {"a": 1, "b": 2, "zero": 3}
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    loras = [None if name is None else LoRARequest(name, ids[name], str(paths[name])) for _, name in requests]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, detokenize=False)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    result = []
    for out in outs:
        comp = out.outputs[0]
        result.append((list(comp.token_ids), [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]))
    return result


def test_engine_accepts_lora_for_v41(engine):
    """`--enable-lora` is accepted for the V4.1 architecture (stock 0.33 rejects it, docs/upstream.md §3.1)."""
    llm, _ = engine
    assert llm.llm_engine.vllm_config.lora_config is not None


def test_wo_a_and_compressor_adapters_change_the_model(engine):
    base, a, b = _generate(engine, [(PROMPTS[0], None), (PROMPTS[0], "a"), (PROMPTS[0], "b")])
    assert a[1] != base[1] and b[1] != base[1] and a[1] != b[1]


def test_two_adapters_in_one_batch_equal_separate_runs(engine):
    mixed = _generate(engine, [(PROMPTS[1], "a"), (PROMPTS[2], "b"), (PROMPTS[3], None), (PROMPTS[0], "a")])
    alone = [_generate(engine, [req])[0] for req in [(PROMPTS[1], "a"), (PROMPTS[2], "b"), (PROMPTS[3], None),
                                                  (PROMPTS[0], "a")]]
    for got, want in zip(mixed, alone):
        assert got[0] == want[0]
        assert max(abs(x - y) for x, y in zip(got[1], want[1])) < 5e-2


def test_zero_adapter_equals_the_base_model(engine):
    base, zero = _generate(engine, [(PROMPTS[2], None), (PROMPTS[2], "zero")])
    assert base[0] == zero[0]
    assert max(abs(x - y) for x, y in zip(base[1], zero[1])) < 1e-3
