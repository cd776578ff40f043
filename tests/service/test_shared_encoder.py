"""Shared-encoder multi-adapter logits are bit-equal to separate runs; ineligible adapters are refused."""

import torch

from dsv4flash.lora import LoraConfig
from dsv4flash.service.shared_encoder import multi_adapter_logits, sharing_refusal


def _adapter(resident, pc, seed):
    tensors = resident.fresh_adapter(pc)
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in tensors.items()}  # B ≠ 0: adapters differ


def test_shared_encoder_bit_equal_and_refusals(resident):
    dec = LoraConfig(preset="decoder_half", rank=2)
    full = LoraConfig(preset="full_linear", rank=2)
    unfrozen = LoraConfig(preset="decoder_half", rank=2, freeze_kv_write=False)
    adapters = [(dec, _adapter(resident, dec, 1)), (dec, _adapter(resident, dec, 2)), (full, _adapter(resident, full, 3)),
                (unfrozen, _adapter(resident, unfrozen, 4)), (dec, _adapter(resident, dec, 5))]
    ids = torch.randint(3, 400, (2, 18), generator=torch.Generator().manual_seed(0))
    shared = multi_adapter_logits(resident, ids, adapters, share=True)
    separate = multi_adapter_logits(resident, ids, adapters, share=False)
    assert shared.shared == [0, 1, 4]
    assert shared.compressor_reuses == 2 and separate.compressor_reuses == 0
    assert "not decoder-only" in shared.refused[2] and "freeze_kv_write=False" in shared.refused[3]
    for a, b in zip(shared.logits, separate.logits):
        assert torch.equal(a, b)
    assert not torch.equal(shared.logits[0], shared.logits[1])  # the adapters really differ
    assert sharing_refusal(resident, dec) is None
