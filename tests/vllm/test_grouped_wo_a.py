"""DSV41-VLLM-002: block-diagonal LoRA on `wo_a`, applied by the o-projection (real vLLM 0.33 classes on CPU)."""

from __future__ import annotations

import types

import pytest
import torch

from dsv4flash.lora import LoraConfig, apply_lora
from dsv4flash.lora.serving import cos_sin_cache, grouped_o_proj_base, inverse_rope_heads, split_groups
from dsv4flash.model.rope import rope_frequencies
from tests.vllm import _vllm_helpers as vh
from tests.vllm._twins import applied, stock

PATCH_ID = "DSV41-VLLM-002"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
LAYER = 2  # a compressed (YaRN) layer of the tiny config


@pytest.fixture(scope="module")
def adapters():
    """Two reference wo_a adapters (per-group and shared-A) over the same tiny base, plus wo_b and RoPE."""
    from dsv4flash.model.transformer import Transformer

    out = {}
    for seed, layout in ((21, "per_group"), (22, "shared_a")):
        model = Transformer("tiny", seed=0)
        apply_lora(model, LoraConfig(preset="custom", include=["layers.*.attn.wo_a"], rank=4, alpha=8.0, seed=seed,
                                     wo_a_lora=layout))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out[layout] = model.layers[LAYER].attn
    attn = out["per_group"]
    freqs = rope_frequencies(attn.text, attn.plan.rope_theta, attn.plan.yarn)
    return out, cos_sin_cache(freqs, 128)


class _Rotary:
    def __init__(self, cache):
        self.cos_sin_cache = cache


def _attention_stub(wo_a, ref_attn, cache):
    """The attributes `dsv41_o_proj` reads from a V4.1 attention layer; wo_b as a plain fp32 GEMM."""
    wo_b = ref_attn.wo_b.weight.detach()
    stub = types.SimpleNamespace(
        wo_a=wo_a, rotary_emb=_Rotary(cache), n_local_heads=ref_attn.heads, n_local_groups=ref_attn.groups,
        nope_head_dim=ref_attn.head_dim - ref_attn.text.qk_rope_head_dim, rope_head_dim=ref_attn.text.qk_rope_head_dim,
        o_lora_rank=ref_attn.text.o_lora_rank, _einsum_recipe=(1, 128, 128), _tma_aligned_scales=False,
        wo_b=types.SimpleNamespace(quant_method=None))  # read by the fused-WO-A eligibility check
    stub._wo_b_proj = lambda z: z.float() @ wo_b.t()
    return stub


def _emulated_deep_gemm_o_proj(o, positions, cache, wo_a, wo_b, *, n_groups, heads_per_group, nope_dim, rope_dim,
                               o_lora_rank, einsum_recipe, tma_aligned_scales):
    """CPU stand-in for vLLM's CUDA `deep_gemm_fp8_o_proj` (inverse RoPE + grouped wo_a + wo_b), BF16 branch."""
    o_rot = split_groups(inverse_rope_heads(o, positions, cache), n_groups)
    return wo_b(grouped_o_proj_base(o_rot, wo_a.weight))


def _inputs(ref_attn, tokens=9, seed=3):
    gen = torch.Generator().manual_seed(seed)
    attn_out = torch.randn(tokens, ref_attn.heads + 2, ref_attn.head_dim, generator=gen)  # 2 padded heads
    return attn_out, torch.arange(5, 5 + tokens)


def _expected(adapters, slots, attn_out, positions, cache):
    """Reference: each token through its own adapter's GroupedLoraProjection (or the base), then wo_b."""
    refs = [adapters["per_group"], adapters["shared_a"]]
    attn = refs[0]
    o_rot = split_groups(inverse_rope_heads(attn_out[:, :attn.heads], positions, cache), attn.groups)
    rows = []
    with torch.no_grad():
        for t, s in enumerate(slots):
            z = refs[s].wo_a(o_rot[t][None, None])[0, 0] if s >= 0 else grouped_o_proj_base(o_rot[t:t + 1],
                                                                                              attn.wo_a.weight)[0]
            rows.append(z)
        return torch.stack(rows) @ attn.wo_b.weight.t()


def _load_two_adapters(wrapped, adapters, pw):
    for slot, layout in enumerate(("per_group", "shared_a")):
        w = adapters[layout].wo_a
        wrapped.set_lora(slot, w.lora_A.detach(), w.lora_B.detach() * w.scaling)
    wrapped.set_mapping(pw)


def test_o_proj_call_site_applies_block_diagonal_delta(patch_form, vllm_cpu, adapters, monkeypatch):
    """Two adapters in one batch through vLLM's `dsv41_o_proj`: each token gets exactly its adapter's z."""
    from vllm.models.deepseek_v41.nvidia import flashmla
    from vllm.models.deepseek_v41.nvidia.ops import o_proj as o_proj_module

    refs, cache = adapters
    attn = refs["per_group"]
    wrapped = vh.wrap(vh.grouped_wo_a(attn.wo_a.weight.detach().clone(), attn.groups), rank=8)
    assert getattr(wrapped, "grouped_output_projection", False), type(wrapped).__name__
    pw = vh.punica()
    _load_two_adapters(wrapped, refs, pw)
    slots = [0, 1, -1, 1, 0, 0, -1, 1, 0]
    ids = {-1: 0, 0: 11, 1: 12}
    vh.set_tokens(pw, [ids[s] for s in slots], [11, 12, 0], [11, 12])
    monkeypatch.setattr(o_proj_module, "deep_gemm_fp8_o_proj", _emulated_deep_gemm_o_proj)
    attn_out, positions = _inputs(attn)
    out = flashmla.dsv41_o_proj(_attention_stub(wrapped, attn, cache), attn_out, positions)
    torch.testing.assert_close(out, _expected(refs, slots, attn_out, positions, cache), rtol=1e-5, atol=1e-5)
    patch_form.record("o_proj", out, atol=1e-5)


def test_adapter_layouts_and_tensor_parallel_groups(patch_form, vllm_cpu, adapters):
    """Shared-A and per-group adapters land in the same stacks; a TP rank keeps only its own group."""
    refs, _ = adapters
    attn = refs["shared_a"]
    w = attn.wo_a
    from dsv4flash.lora.serving import grouped_factors

    a, b = grouped_factors(w.lora_A.detach(), w.lora_B.detach(), w.groups, w.rank)
    full = vh.wrap(vh.grouped_wo_a(w.weight.detach().clone(), w.groups), rank=8)
    full.set_lora(0, w.lora_A.detach(), w.lora_B.detach())  # shared-A 2-D
    full.set_lora(1, a, b)  # per-group 3-D
    torch.testing.assert_close(full.lora_a_stacked[0][0], full.lora_a_stacked[0][1], rtol=0, atol=0)
    torch.testing.assert_close(full.lora_b_stacked[0][0], full.lora_b_stacked[0][1], rtol=0, atol=0)
    # rank 1 of TP=2 owns group 1: a one-group wo_a whose wrapper believes it is rank 1 of 2
    rows = slice(w.rank, 2 * w.rank)
    local = vh.wrap(vh.grouped_wo_a(w.weight.detach()[rows].clone(), 1), rank=8)
    local.tp_size, local.tp_rank = 2, 1
    local.set_lora(0, a, b)
    torch.testing.assert_close(local.lora_a_stacked[0][0, 0, :4], a[1], rtol=0, atol=0)
    torch.testing.assert_close(local.lora_b_stacked[0][0, 0, :, :4], b[1], rtol=0, atol=0)
    patch_form.record("local_b", local.lora_b_stacked[0][0, 0, :, :4])


def test_mega_attention_backend_refuses_lora(patch_form):
    """With LoRA the SM100 mega-attention backend (in-place wq_b / wo_a permutation) is refused by name."""
    from vllm.models.deepseek_v41.nvidia.flash_mla_mega_attn import DeepseekV4MegaAttnAttention

    layer = DeepseekV4MegaAttnAttention.__new__(DeepseekV4MegaAttnAttention)
    with pytest.raises(ValueError, match="FLASHMLA_SPARSE_DSV41") as err:
        DeepseekV4MegaAttnAttention.__init__(layer, types.SimpleNamespace(lora_config=object()))
    patch_form.record("refused", "LoRA" in str(err.value))


def test_stock_vllm_silently_drops_wo_a_lora(vllm_cpu, adapters, monkeypatch):
    """docs/upstream.md §3.2 on real 0.33 code: the stock wrapper loads the adapter, the o-projection ignores it."""
    from vllm.lora.layers import ColumnParallelLinearWithLoRA
    from vllm.models.deepseek_v41.nvidia import flashmla
    from vllm.models.deepseek_v41.nvidia.ops import o_proj as o_proj_module

    refs, cache = adapters
    attn = refs["per_group"]
    monkeypatch.setattr(o_proj_module, "deep_gemm_fp8_o_proj", _emulated_deep_gemm_o_proj)
    attn_out, positions = _inputs(attn)
    with stock(PATCH_ID, "DSV41-VLLM-003"):
        wrapped = vh.wrap(vh.grouped_wo_a(attn.wo_a.weight.detach().clone(), attn.groups), rank=8)
        assert type(wrapped) is ColumnParallelLinearWithLoRA
        pw = vh.punica()
        # the stock layer takes a shared-A adapter (2-D) without complaint ...
        w = refs["shared_a"].wo_a
        wrapped.set_lora(0, w.lora_A.detach(), w.lora_B.detach() * w.scaling)
        wrapped.set_mapping(pw)
        vh.set_tokens(pw, [11] * attn_out.shape[0], [11], [11, None])
        out = flashmla.dsv41_o_proj(_attention_stub(wrapped, attn, cache), attn_out, positions)
    # ... and the result is the base model's
    base = _expected(refs, [-1] * attn_out.shape[0], attn_out, positions, cache)
    torch.testing.assert_close(out, base, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(out, _expected(refs, [1] * attn_out.shape[0], attn_out, positions, cache), atol=1e-4)


def test_bad_adapters_fail_loudly(vllm_cpu, adapters):
    refs, _ = adapters
    w = refs["per_group"].wo_a
    with applied(PATCH_ID):
        wrapped = vh.wrap(vh.grouped_wo_a(w.weight.detach().clone(), w.groups), rank=8)
        with pytest.raises(ValueError, match="exceeds max_lora_rank"):
            wrapped.set_lora(0, torch.zeros(2, 16, w.in_per_group), torch.zeros(2, w.rank, 16))
        with pytest.raises(ValueError, match="covers 3 groups"):
            wrapped.set_lora(0, torch.zeros(3, 4, w.in_per_group), torch.zeros(3, w.rank, 4))
        with pytest.raises(RuntimeError, match="o-projection"):
            wrapped(torch.zeros(2, w.in_per_group))


def test_twin_prepends_and_reverts_the_class_table(vllm_cpu):
    from vllm.lora import utils

    with stock(PATCH_ID, "DSV41-VLLM-003"):
        before = tuple(utils._all_lora_classes)
    # DSV41-VLLM-003 prepends its own class too; with both active (the vLLM plugin applies every twin) the order
    # depends on which was applied last, so 003 is held back while 002's place in the table is checked.
    with stock("DSV41-VLLM-003"), applied(PATCH_ID):
        assert getattr(utils._all_lora_classes[0], "grouped_output_projection", False)
        assert utils._all_lora_classes[1:] == before
    with stock(PATCH_ID, "DSV41-VLLM-003"):
        assert tuple(utils._all_lora_classes) == before
