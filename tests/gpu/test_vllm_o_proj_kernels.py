"""vLLM's real V4.1 o-projection kernels (Triton inverse RoPE, grouped bmm) with the grouped wo_a LoRA (GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from dsv4flash.lora.serving import cos_sin_cache, grouped_o_proj_base, inverse_rope_heads, split_groups

pytestmark = [pytest.mark.gpu, pytest.mark.upstream]
H, HD, ROPE, G, OUT_G = 64, 512, 64, 8, 1024
IN_G = H * HD // G


@pytest.fixture(scope="module")
def vllm_cuda():
    import vllm  # noqa: F401  (installed by ci/install.sh test)
    from tests.vllm._vllm_helpers import cpu_env  # gloo TP=1 group; tensors live on CUDA

    from dsv4flash.integrations.vllm import register

    with cpu_env() as config:
        register(model_code=True)
        yield config


def test_real_o_proj_kernels_add_each_tokens_adapter(vllm_cuda):
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper
    from vllm.models.deepseek_v41.nvidia import flashmla

    from tests.vllm import _vllm_helpers as vh

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(G * OUT_G, IN_G, generator=gen) * 0.02).to(torch.bfloat16).cuda()
    with torch.device("cuda"):
        wrapped = vh.wrap(vh.grouped_wo_a(weight, G), max_loras=2, rank=16)
    assert getattr(wrapped, "grouped_output_projection", False)
    adapters = [(torch.randn(G, 8, IN_G, generator=gen) * 0.02, torch.randn(G, OUT_G, 8, generator=gen) * 0.02)
                for _ in range(2)]
    for slot, (a, b) in enumerate(adapters):
        wrapped.set_lora(slot, a.cuda(), b.cuda())
    punica = get_punica_wrapper(256, max_batches=8, device="cuda", lora_config=wrapped.lora_config)
    wrapped.set_mapping(punica)
    slots = [0, 1, -1, 1, 0, 0, -1, 1, 0, 1, 1]
    ids = {-1: 0, 0: 11, 1: 12}
    punica.update_metadata(LoRAMapping(tuple(ids[s] for s in slots), (11, 12, 0), is_prefill=True), [11, 12], 3, 512)
    cache = cos_sin_cache(1.0 / (10000 ** (torch.arange(0, ROPE, 2) / ROPE)), 4096).cuda()
    stub = types.SimpleNamespace(wo_a=wrapped, rotary_emb=types.SimpleNamespace(cos_sin_cache=cache), n_local_heads=H,
                                 n_local_groups=G, nope_head_dim=HD - ROPE, rope_head_dim=ROPE, o_lora_rank=OUT_G,
                                 _einsum_recipe=(1, 128, 128), _tma_aligned_scales=False,
                                 wo_b=types.SimpleNamespace(quant_method=None), _wo_b_proj=lambda z: z)
    attn_out = torch.randn(len(slots), H, HD, generator=gen).to(torch.bfloat16).cuda()
    positions = torch.arange(100, 100 + len(slots)).cuda()
    z = flashmla.dsv41_o_proj(stub, attn_out, positions).float().cpu()
    o_rot = split_groups(inverse_rope_heads(attn_out.float().cpu(), positions.cpu(), cache.cpu()), G)
    want = grouped_o_proj_base(o_rot, weight.float().cpu())
    for t, s in enumerate(slots):
        if s >= 0:
            a, b = adapters[s]
            want[t] += torch.einsum("gor,grd,gd->go", b, a, o_rot[t]).flatten()
    rel = (z - want).norm() / want.norm()
    assert rel < 1e-2, f"real-kernel z differs from the reference by {rel:.2e} (bf16 tolerance 1e-2)"
