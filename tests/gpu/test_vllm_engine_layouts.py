"""A real vLLM 0.33 engine serves a dsv4flash adapter from both its `peft` and its `vllm` directory alike (GPU).

The adapter covers the grouped `wo_a` (per-group: rank G·r in `peft`, rank r in `vllm`), `wq_a`, the shared
experts and every routed expert (2-D per expert), written by dsv4flash's own writer for the V4.1 checkpoint
of `$DSV4FLASH_V41_CHECKPOINT` or the synthetic small one (tests/gpu/_small_v41.py). Run by ci/gpu_checks.sh.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.upstream, pytest.mark.slow]
RANK = 8
PROMPTS = [[200 + 11 * i + j for j in range(40)] for i in range(2)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from vllm import LLM

    from dsv4flash.config import load_config
    from dsv4flash.lora import LoraConfig, apply_lora, lora_parameters
    from dsv4flash.lora.peft_io import model_adapter_files, write_adapter_dir
    from dsv4flash.model.transformer import Transformer
    from tests.gpu import _small_v41

    cache = Path(os.environ.get("DSV4FLASH_GPU_CACHE", tmp_path_factory.mktemp("v41")))
    model_dir = _small_v41.checkpoint(cache)
    cfg = load_config(model_dir)
    meta = Transformer(cfg, device="meta", seed=None)  # the placement's shapes, no base weights
    handle = apply_lora(meta, LoraConfig(preset="custom", rank=RANK, alpha=2.0 * RANK, include=[
        "layers.*.attn.wo_a", "layers.*.attn.wq_a", "layers.*.ffn.shared_experts.w[123]", "layers.*.ffn.experts.*.w[123]"]))
    gen = torch.Generator().manual_seed(5)
    canonical = {k: torch.randn(p.shape, generator=gen) * 0.02 for k, p in lora_parameters(meta).items()}
    out = tmp_path_factory.mktemp("adapters")
    paths = {}
    for layout in ("peft", "vllm"):
        config, files = model_adapter_files(meta, handle, canonical, str(model_dir), layout)
        paths[layout] = write_adapter_dir(out / layout, config, files)
    llm = LLM(model=str(model_dir), enable_lora=True, max_loras=2, max_lora_rank=RANK * cfg.text.o_groups,
              max_cpu_loras=2, max_model_len=1024, enforce_eager=True, skip_tokenizer_init=True,
              gpu_memory_utilization=0.85, limit_mm_per_prompt={"image": 0})
    return llm, paths


def _generate(served, name: str | None, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    llm, paths = served
    lora = None if name is None else LoRARequest(name, {"peft": 1, "vllm": 2}[name], str(paths[name]))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, detokenize=False)
    comp = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=[lora], use_tqdm=False)[0].outputs[0]
    return list(comp.token_ids), [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]


def test_peft_and_vllm_directories_serve_the_same_adapter(served):
    for prompt in PROMPTS:
        base, peft_dir, vllm_dir = (_generate(served, name, prompt) for name in (None, "peft", "vllm"))
        assert peft_dir[1] != base[1]  # the adapter is applied
        assert peft_dir[0] == vllm_dir[0]
        assert max(abs(x - y) for x, y in zip(peft_dir[1], vllm_dir[1])) < 5e-2
