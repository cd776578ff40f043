"""Expert parallelism (2 gloo ranks) with the modality router and frozen text/image selection biases.

The reference gets distinct random text (`ffn.gate.bias`) and image (`ffn.gate.bias_vl`) biases, so routing
depends on both; each row carries an image span (its embeddings come in through `decoder_input`, as from
the vision tower, and take no Engram delta). Logits and gradients must equal the single-device reference
(routed-expert gradients: twice the reference, both ranks run the same micro-batch). The biases are buffers,
never trained, and megatron-core's own bias update (`finalize_model_grads._update_router_expert_bias`, run
with a non-zero `moe_router_bias_update_rate`) leaves both unchanged because the router is frozen.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]

SEQ = 32
SPAN = slice(6, 18)  # image-span positions of every row


def _biased_reference():
    ref = sup.reference(seed=0)
    gen = torch.Generator().manual_seed(91)
    with torch.no_grad():
        for block in ref.layers:
            gate = block.ffn.gate
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=gen) * 0.3)
            if gate.bias_vl is not None:
                gate.bias_vl.copy_(torch.randn(gate.bias_vl.shape, generator=gen) * 0.3)
    return ref


def _batch():
    ids = sup.token_ids(2, SEQ, seed=92)
    types = torch.full_like(ids, -1)
    types[:, SPAN] = 0
    image = torch.randn(2, SPAN.stop - SPAN.start, 64, generator=torch.Generator().manual_seed(93)) * 0.02
    return ids, types, image


def _reference_logits(ref, ids, types, image):
    """The reference run with image embeddings placed in the spans (what the vision tower would feed)."""
    from dsv4flash.model.block import TokenContext
    from dsv4flash.model.state import CSA2State

    h = ref.embed(ids).clone()
    h[:, SPAN] = image.to(h.dtype)
    hc = ref.cfg.text.hc_mult
    streams = h.unsqueeze(2).expand(*h.shape[:2], hc, h.shape[-1]).contiguous()
    pre_mix = torch.zeros(*h.shape[:2], hc)
    pre_mix[..., 0] = 1.0
    rows = tuple(ref.engram_hasher(ids, types)) if ref.engram_hasher is not None else ()
    streams, pre_mix, _ = ref.run_layers(streams, pre_mix, CSA2State(), TokenContext(types >= 0, rows))
    return ref.logits(streams, pre_mix)


def _ep_modality_rank(rank: int, world_size: int, expected_path: str) -> None:
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ref = _biased_reference()
    ids, types, image = _batch()
    with parallel.model_parallel(ep=world_size, rank=rank, world_size=world_size, seed=1234):
        model = DSV41ModelProvider(ref.cfg, overrides=dict(moe_router_bias_update_rate=1e-3)).provide()
        load_reference_state(model, ref.state_dict(), ep_rank=rank, ep_size=world_size)
        model.train()
        routers = [layer.mlp.router for layer in model.decoder.layers]
        assert all(r.frozen_expert_bias for r in routers)
        names = {n for n, _ in model.named_parameters()}
        assert not any("expert_bias" in n for n in names), "a selection bias is a trainable parameter"
        biases = [(r.expert_bias.clone(), r.image_balance.expert_bias.clone()) for r in routers]
        assert any(not torch.equal(t, i) for t, i in biases), "text and image biases should differ"

        emb = model.embedding(ids, None).clone()  # [s, b, D]
        emb[SPAN] = image.transpose(0, 1)
        out = model(ids, decoder_input=emb, token_types=types)
        torch.testing.assert_close(out, expected["logits"], rtol=0, atol=2e-5)
        (out * expected["weights"]).sum().backward()
        sup.assert_ep_grads(ref, model, expected["grads"], rank, world_size)

        counted = sum(int(r.image_balance.local_tokens_per_expert.sum()) for r in routers)
        assert counted > 0, "no image token reached the image counter"
        _update_router_expert_bias([model], model.config)  # megatron-core's finalize step
        for router, (text, img) in zip(routers, biases):
            assert torch.equal(router.expert_bias, text) and torch.equal(router.image_balance.expert_bias, img)


@LAYOUT(ep=2, check="modality router, image spans via decoder_input, distinct frozen text/image biases: logits, "
        "every gradient; megatron-core's bias update leaves both biases unchanged")
def test_expert_parallel_with_image_spans_and_frozen_biases(tmp_path):
    with sup.single_thread():
        ref = _biased_reference()
        ids, types, image = _batch()
        weights = sup.probe((2, SEQ, sup.VOCAB), seed=94)
        logits = _reference_logits(ref, ids, types, image)
        with torch.no_grad():  # the image bias really decides routes here: text biases on image spans differ
            text_only = _biased_reference()
            for block in text_only.layers:
                if block.ffn.gate.bias_vl is not None:
                    block.ffn.gate.bias_vl.copy_(block.ffn.gate.bias)
            assert not torch.allclose(_reference_logits(text_only, ids, types, image), logits, atol=1e-4)
        (logits * weights).sum().backward()
        path = tmp_path / "expected.pt"
        torch.save({"weights": weights, "logits": logits.detach(), "grads": sup.reference_grads(ref)}, path)
        parallel.spawn_gloo(_ep_modality_rank, 2, str(path))
