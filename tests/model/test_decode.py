"""Incremental decode with the CSA2 cache equals the full forward at every position (fp32, ≤ 1e-6).

The fake-quant points (FP8 window KV, FP4 compressed KV and index q/k) round onto coarse grids, so an
fp32 last-ulp difference between two GEMM shapes (a decode step multiplies 1 row, the full forward S rows)
occasionally lands a value on the other side of a rounding boundary and moves later logits by ~1e-4. The
full forward does the same to itself when only the batch size changes (`test_real_quantizers_...` shows
it). The exact-parity tests therefore run with the quantizers as the identity (`continuous`), which leaves
every cache path (window, compressed segments, open groups, top-k, candidate pool, Engram look-back) in
place and makes the model continuous; the real quantizers are checked separately.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4flash.lora import LoraConfig, apply_lora
from dsv4flash.lora.layers import is_lora_module
from dsv4flash.model.image import prepare_vl_inputs

TOL = 1e-6


@pytest.fixture
def continuous(monkeypatch):
    """The three fake-quant points as the identity (see the module docstring)."""
    import dsv4flash.model.attention as attention
    import dsv4flash.model.indexer as indexer

    for module, name in ((attention, "fake_quant_window_kv"), (attention, "fake_quant_compressed_kv"),
                         (indexer, "fake_quant_index")):
        monkeypatch.setattr(module, name, lambda x: x)


def _incremental(model, ids, types, images, prefill_len, chunks):
    """Prefill ids[:, :prefill_len], then extend chunk by chunk (sizes from `chunks`) -> logits [B,S,V], cache."""
    with torch.no_grad():
        logits, cache = model.prefill(ids[:, :prefill_len], types[:, :prefill_len], images)
        out, pos = [logits], prefill_len
        for size in chunks:
            step = ids[:, pos:pos + size]
            if size == 1:
                lg, cache = model.decode(cache, step[:, 0])
                lg = lg[:, None]
            else:
                lg, cache = model.decode(cache, step, types[:, pos:pos + size])
            out.append(lg)
            pos += size
    return torch.cat(out, dim=1), cache


def _chunks(rng, n):
    sizes = []
    while n:
        sizes.append(min(n, int(rng.choice([1, 1, 1, 2, 3]))))
        n -= sizes[-1]
    return sizes


def _check_cache(model, cache, length):
    text = model.cfg.text
    assert cache.length == length
    for plan, window in zip(model.cfg.backbone_plan, cache.window):
        assert window.shape[1] == min(length, text.sliding_window - 1), plan.layer_id
    for layer, seg in cache.sources.items():
        ratio = model.cfg.backbone_plan[layer].ratio
        assert seg.groups == length // ratio and seg.pending.shape[1] == length % ratio, layer
    assert sorted(cache.sources) == sorted(text.kv_source_layer_ids)


@pytest.mark.parametrize("seed", range(8))
def test_decode_matches_full_forward_across_group_boundaries(tiny_model, one_thread, continuous, seed):
    rng = np.random.default_rng(seed)
    model = tiny_model.eval()
    length = int(rng.integers(10, 40))  # past the window (8), many ratio-2 groups and candidate blocks
    prefill_len = int(rng.integers(1, length))
    ids = torch.as_tensor(rng.integers(3, model.cfg.text.vocab_size, size=(2, length)))
    types = torch.full_like(ids, -1)
    with torch.no_grad():
        full = model(ids)
    inc, cache = _incremental(model, ids, types, None, prefill_len, _chunks(rng, length - prefill_len))
    assert (inc - full).abs().max() <= TOL
    _check_cache(model, cache, length)


def test_real_quantizers_agree_up_to_rare_rounding_flips(tiny_model, one_thread):
    # With the real quantizers most positions agree to fp32 rounding; a flipped rounding decision moves a
    # stretch of later logits by ~1e-4, exactly as the full forward moves when only its batch size changes.
    model = tiny_model.eval()
    agree = total = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        ids = torch.as_tensor(rng.integers(3, model.cfg.text.vocab_size, size=(2, 33)))
        with torch.no_grad():
            full = model(ids)
        inc, _ = _incremental(model, ids, torch.full_like(ids, -1), None, 9, _chunks(rng, 24))
        diff = (inc - full).abs().amax(-1)  # [B,S]
        assert diff.max() < 1e-3
        agree, total = agree + int((diff <= TOL).sum()), total + diff.numel()
    assert agree >= 0.9 * total


def test_prefill_is_the_full_forward_bit_for_bit(tiny_model):
    ids = torch.randint(3, 500, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(tiny_model.prefill(ids)[0], tiny_model(ids))


def test_decode_after_an_image_prompt(tiny_model, tiny_cfg, one_thread, continuous):
    image = np.random.default_rng(0).integers(0, 256, size=(42, 84, 3), dtype=np.uint8)
    prompt = torch.tensor([5, 6, 7, tiny_cfg.image_token_id, 8])
    ids, types, images = prepare_vl_inputs(prompt, [image], tiny_cfg, dtype=torch.float32)
    ids = torch.cat([ids, torch.tensor([9, 10, 11, 12, 13, 14, 15, 16, 17])])[None]  # decoded text after the span
    types = torch.cat([types, torch.full((9,), -1)])[None]
    model = tiny_model.eval()
    with torch.no_grad():
        full = model(ids, types, images)
    for prefill_len in (9, 10):  # the span ends at 8: the first decoded tokens' n-grams look back into it
        inc, cache = _incremental(model, ids, types, images, prefill_len, [1] * (ids.shape[1] - prefill_len))
        assert (inc - full).abs().max() <= TOL
        _check_cache(model, cache, ids.shape[1])


@pytest.mark.parametrize("preset", ["full_linear", "decoder_half"])
def test_decode_with_lora_adapters(tiny_model, one_thread, continuous, preset):
    model = tiny_model.eval()
    apply_lora(model, LoraConfig(preset=preset, rank=4))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if is_lora_module(module) and hasattr(module, "lora_B"):
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.05)
    ids = torch.randint(3, 500, (2, 26), generator=gen)
    with torch.no_grad():
        full = model(ids)
        base_delta = (full - model.prefill(ids)[0]).abs().max()
    inc, _ = _incremental(model, ids, torch.full_like(ids, -1), None, 7, [1] * 19)
    assert base_delta == 0
    assert (inc - full).abs().max() <= TOL


def test_select_fans_one_prefill_out_to_diverging_rows(tiny_model, one_thread, continuous):
    model = tiny_model.eval()
    prompt = torch.randint(3, 500, (1, 11), generator=torch.Generator().manual_seed(4))
    tails = torch.tensor([[20, 21, 22], [30, 31, 32], [20, 21, 40]])
    with torch.no_grad():
        _, cache = model.prefill(prompt)
        fanned = cache.select([0, 0, 0])
        for t in range(tails.shape[1]):
            logits, fanned = model.decode(fanned, tails[:, t])
        full = model(torch.cat([prompt.expand(3, -1), tails], dim=1))[:, -1]
        again, _ = model.decode(cache.select([0]), tails[:1, 0])  # the prompt's cache is left untouched
        assert (again - model(torch.cat([prompt, tails[:1, :1]], 1))[:, -1]).abs().max() <= TOL
    assert (logits - full).abs().max() <= TOL


def test_decode_rejects_a_batch_that_does_not_match_the_cache(tiny_model):
    with torch.no_grad():
        _, cache = tiny_model.prefill(torch.tensor([[5, 6, 7]]))
        with pytest.raises(ValueError, match=r"input_ids must be \[B=1"):
            tiny_model.decode(cache, torch.tensor([8, 9]))
