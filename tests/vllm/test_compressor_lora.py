"""DSV41-VLLM-003: compressor `wkv`/`wgate` LoRA reaches the fp32 `kv_score` (real vLLM 0.33 classes on CPU)."""

from __future__ import annotations

import types

import pytest
import torch

from dsv4flash.lora import LoraConfig, apply_lora
from tests.vllm import _vllm_helpers as vh
from tests.vllm._twins import applied, stock

PATCH_ID = "DSV41-VLLM-003"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
TARGETS = ["layers.*.attn.compressor.wkv", "layers.*.attn.compressor.wgate"]


@pytest.fixture(scope="module")
def compressors():
    """Two reference adapters on the tiny model's compressors: layer 2 (ratio 2) and layer 6 (ratio 1, no gate)."""
    from dsv4flash.model.transformer import Transformer

    models = []
    for seed in (31, 32):
        model = Transformer("tiny", seed=0)
        apply_lora(model, LoraConfig(preset="custom", include=TARGETS, rank=4, alpha=8.0, seed=seed))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        models.append(model)
    return models


def _mm_with_out_dtype(original):
    """CPU stand-in for CUDA's `torch.mm(a, b, out_dtype=float32)` (the compressor's raw score GEMM)."""
    def mm(a, b, *args, out_dtype=None, **kwargs):
        if out_dtype is None:
            return original(a, b, *args, **kwargs)
        return original(a.to(out_dtype), b.to(out_dtype))
    return mm


def _attention_stub(projection):
    """What `_run_parallel_input_projections` reads: a compressor, no indexer, no aux streams."""
    return types.SimpleNamespace(compressor=types.SimpleNamespace(fused_wkv_wgate=projection), indexer=None,
                                 aux_stream_list=None, ln_events=[None, None, None],
                                 _fused_wqa_wkv_gemm=lambda h: h)


def _score(models, layer, slots, x):
    """Reference fp32 score per token: [wkv(x) ‖ wgate(x)] of its adapter's LoRA'd compressor (base for -1)."""
    rows = []
    with torch.no_grad():
        for t, s in enumerate(slots):
            comp = models[max(s, 0)].layers[layer].attn.compressor
            mods = [comp.wkv] + ([comp.wgate] if comp.wgate is not None else [])
            xt = x[t:t + 1].float()
            parts = [m(xt) if s >= 0 else xt @ m.weight.float().t() for m in mods]
            rows.append(torch.cat(parts, dim=-1)[0])
    return torch.stack(rows)


def _wrapped(models, layer):
    comp = models[0].layers[layer].attn.compressor
    weights = [comp.wkv.weight.detach()] + ([comp.wgate.weight.detach()] if comp.wgate is not None else [])
    wrapped = vh.wrap(vh.compressor_projection(weights, f"model.layers.{layer}.attn.compressor"), ["wkv", "wgate"])
    for slot, model in enumerate(models):
        c = model.layers[layer].attn.compressor
        gate = c.wgate if c.wgate is not None else None
        a = [c.wkv.lora_A.detach(), gate.lora_A.detach() if gate is not None else None]
        b = [c.wkv.lora_B.detach() * c.wkv.scaling, gate.lora_B.detach() * gate.scaling if gate is not None else None]
        wrapped.set_lora(slot, a, b)
    return wrapped


@pytest.mark.parametrize("layer", [2, 6])
def test_kv_score_call_site_applies_compressor_lora(patch_form, vllm_cpu, compressors, monkeypatch, layer):
    """Two adapters in one batch: `_run_parallel_input_projections` returns each token's LoRA'd fp32 score."""
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    wrapped = _wrapped(compressors, layer)
    assert getattr(wrapped, "compressor_projection", False), type(wrapped).__name__
    pw = vh.punica()
    wrapped.set_mapping(pw)
    slots = [0, 1, -1, 1, 0, -1, 1]
    ids = {-1: 0, 0: 41, 1: 42}
    vh.set_tokens(pw, [ids[s] for s in slots], [41, 42, 0], [41, 42])
    x = torch.randn(len(slots), compressors[0].cfg.text.hidden_size, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(torch, "mm", _mm_with_out_dtype(torch.mm))
    _, kv_score, _ = DeepseekV4Attention._run_parallel_input_projections(_attention_stub(wrapped), x)
    assert kv_score.dtype == torch.float32
    torch.testing.assert_close(kv_score, _score(compressors, layer, slots, x), rtol=1e-5, atol=1e-5)
    patch_form.record("kv_score", kv_score, atol=1e-5)


def test_ratio_one_compressor_has_no_gate(patch_form, vllm_cpu, compressors):
    """The gate-less ratio-1 compressor takes a wkv-only adapter and refuses a wgate LoRA by name."""
    comp = compressors[0].layers[6].attn.compressor
    wrapped = vh.wrap(vh.compressor_projection([comp.wkv.weight.detach()], "model.layers.6.attn.compressor"),
                      ["wkv", "wgate"])
    wrapped.set_lora(0, [comp.wkv.lora_A.detach(), None], [comp.wkv.lora_B.detach(), None])
    with pytest.raises(ValueError, match="wgate") as err:
        wrapped.set_lora(1, [comp.wkv.lora_A.detach(), comp.wkv.lora_A.detach()],
                         [comp.wkv.lora_B.detach(), comp.wkv.lora_B.detach()])
    patch_form.record("slices", len(wrapped.lora_b_stacked))
    patch_form.record("names_layer", "compressor" in str(err.value))


def test_stock_vllm_silently_drops_compressor_lora(vllm_cpu, compressors, monkeypatch):
    """docs/upstream.md §3.2 on real 0.33 code: the stock merged-column wrapper loads it, the raw GEMM ignores it."""
    from vllm.lora.layers import MergedColumnParallelLinearWithLoRA
    from vllm.models.deepseek_v41.attention import DeepseekV4Attention

    monkeypatch.setattr(torch, "mm", _mm_with_out_dtype(torch.mm))
    x = torch.randn(5, compressors[0].cfg.text.hidden_size)
    with stock(PATCH_ID):
        wrapped = _wrapped(compressors, 2)
        assert type(wrapped) is MergedColumnParallelLinearWithLoRA
        pw = vh.punica()
        wrapped.set_mapping(pw)
        vh.set_tokens(pw, [41] * 5, [41], [41, 42])
        _, kv_score, _ = DeepseekV4Attention._run_parallel_input_projections(_attention_stub(wrapped), x)
    torch.testing.assert_close(kv_score, _score(compressors, 2, [-1] * 5, x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(kv_score, _score(compressors, 2, [0] * 5, x), atol=1e-4)


def test_module_call_keeps_the_delta(vllm_cpu, compressors):
    """Called as a module (not V4.1's path, but other code may), the wrapper still adds its delta."""
    with applied(PATCH_ID):
        wrapped = _wrapped(compressors, 2)
        pw = vh.punica()
        wrapped.set_mapping(pw)
        vh.set_tokens(pw, [42] * 3, [42], [41, 42])
        x = torch.randn(3, compressors[0].cfg.text.hidden_size)
        torch.testing.assert_close(wrapped(x), _score(compressors, 2, [1] * 3, x), rtol=1e-5, atol=1e-5)
