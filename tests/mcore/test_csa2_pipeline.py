"""The V4.1 stack under pipeline parallelism (2 and 4 gloo stages) with the backward early stop.

Tiny widths with the release's 40-layer plan. Two stages split encoder (layers 0–19) and decoder (20–39):
layer 19 reads the compressed KV of kv source 14 and layer 20 is the next kv source and the candidate
source. Four stages also cut between kv source 8 and its readers 10–13 and between kv source 20 and the
readers 30–39 of its compressed KV: the CSA2 state crosses stages as explicit tensors (the stage payload),
and the kv-source compressor is trained through it. A Megatron-Bridge LoRA adapter is trained on the decoder
half only (its encoder-half factors and every base weight frozen, the embedding — what the frozen ViT feeds —
too), so the stages holding only encoder layers have nothing trainable.

Every rank runs megatron-core's 1F1B schedule twice: the stock protocol (counted) and with
`BackwardEarlyStop`. The oracle is the same model, adapter and micro-batches at PP = 1 through megatron-core's
no-pipelining schedule: losses and adapter gradients must be identical. Frozen stages must run no layer
backward and exchange no gradient with the early stop.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from dsv4flash.integrations.mcore.csa2.weights import global_name
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import models, parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]

SEQ, MICROBATCHES = 24, 4
TARGETS = ["linear_q_down", "linear_kv", "linear_proj", "linear_o_group_proj"]  # linear_kv: window KV and compressor
DECODER_START = 20  # first decoder-half layer of the 40-layer plan


def _model(recompute: str):
    """This rank's stage (or the whole stack at PP = 1) with reference weights and a decoder-half adapter."""
    from tests.mbridge import shim

    shim.install()  # megatron-bridge on this CPU / Python 3.11 machine (tests/mbridge/shim.py)
    from dsv4flash.integrations import mbridge
    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    cfg = sup.tiny_with_flash_plan()
    ref = sup.reference_model(cfg, seed=0)
    model = DSV41ModelProvider(cfg, recompute=recompute, overrides=dict(
        pipeline_dtype=torch.float32, variable_seq_lengths=True)).provide()
    load_reference_state(model, ref.state_dict())
    first = model.decoder.layers[0].layer_number - 1
    decoder = [j for j in range(len(model.decoder.layers)) if first + j >= DECODER_START]
    if decoder:  # the adapter targets only this stage's decoder-half layers (stage-local names)
        targets = [f"*.layers.{j}.*.{t}" for j in decoder for t in TARGETS]
        model = mbridge.DSV41LoRA(target_modules=targets, dim=4, alpha=8)(model, training=True)
    else:  # what PEFT does when no module matches: freeze everything
        model.requires_grad_(False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter." in name:  # the same values at every layout: seeded by the global name
                gen = torch.Generator().manual_seed(zlib.crc32(global_name(name, model).encode()))
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model.train()


def _layer_of(name: str) -> int:
    return int(name.split(".")[2]) if name.startswith("decoder.layers.") else -1


def _batches():
    gen = torch.Generator().manual_seed(17)
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, sup.VOCAB, (1, SEQ + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"])  # every stage gets the ids (layout, Engram)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {global_name(n, model): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pp_rank(rank: int, world_size: int, recompute: str, expected_path: str) -> None:
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from dsv4flash.integrations.mcore.pipeline import BackwardEarlyStop

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    with parallel.model_parallel(pp=world_size, rank=rank, world_size=world_size, seed=3):
        model = _model(recompute)
        backward_count = models.count_layer_backwards(model)
        runs = {}
        for early in (False, True):
            model.zero_grad(set_to_none=True)
            backward_count[0] = 0
            plan = BackwardEarlyStop.agree(model)
            if early:
                plan.attach(model)
                kwargs = plan.schedule_kwargs(model.config)
            else:  # the stock protocol, counted: with k = 0 the communicator omits nothing
                kwargs = BackwardEarlyStop(0, plan.stage, plan.num_stages, plan.pp_group).schedule_kwargs(model.config)
            losses = forward_backward_pipelining_without_interleaving(
                forward_step_func=_forward_step, data_iterator=_batches(), model=[model],
                num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1, forward_only=False, **kwargs)
            runs[early] = (plan, [float(x["loss"]) for x in losses], _adapter_grads(model),
                           kwargs["p2p_communicator"].stats, backward_count[0])

        plan, losses, grads, stats, backwards = runs[True]
        _, stock_losses, stock_grads, stock_stats, stock_backwards = runs[False]
        k = plan.first_trainable_stage
        assert k == world_size // 2, f"first trainable stage {k}"
        if rank == world_size - 1:
            assert losses == stock_losses == expected["losses"]
        else:
            assert losses == stock_losses == []
        mine = {n: g for n, g in expected["grads"].items() if n in grads or n in stock_grads}
        assert sorted(grads) == sorted(stock_grads) == sorted(mine)
        assert bool(grads) == (rank >= k)
        for name, want in mine.items():
            assert torch.equal(grads[name], want), f"stage {rank} {name}: differs from PP = 1"
            assert torch.equal(stock_grads[name], want), f"stage {rank} {name}: stock differs from PP = 1"

        layers = len(model.decoder.layers) * MICROBATCHES
        if rank < k:  # nothing trainable here or upstream: no backward, no gradient traffic
            assert backwards == 0 and stats.grads_sent == stats.grads_received == 0 == stats.grad_bytes_sent
            assert stats.receives_skipped == MICROBATCHES
            # Stock: a frozen stage whose input came from another stage backprops through all its layers.
            assert stock_backwards == (layers if rank > 0 else 0)
        else:
            assert backwards == stock_backwards == layers
            assert stats.grads_sent == (MICROBATCHES if rank > k else 0)
            assert stock_stats.grads_sent == MICROBATCHES
            # Stage k sends nothing upstream: every payload gradient the stock run ships from it is saved.
            assert stats.grad_bytes_sent == (stock_stats.grad_bytes_sent if rank > k else 0)
        if rank > 0:  # stock: one gradient of the whole payload (streams + pre_mix + CSA2 state) per micro-batch
            assert stock_stats.grad_bytes_sent > 0
        assert stats.forward_sent == stock_stats.forward_sent
        assert stats.forward_bytes_sent == stock_stats.forward_bytes_sent


@pytest.mark.slow
@pytest.mark.parametrize("world_size, recompute", [
    pytest.param(2, "full", id="pp2", marks=LAYOUT(pp=2, recompute="full", check="40-layer plan, decoder-half LoRA, "
                                                   "early stop: losses and adapter gradients bit-identical to PP = 1")),
    pytest.param(4, "none", id="pp4", marks=LAYOUT(pp=4, check="same; frozen stage 1 skips its backward and all "
                                                   "gradient traffic below stage 2")),
])
def test_pipeline_stages_equal_one_stage_with_early_stop(world_size, recompute, tmp_path):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with sup.single_thread(), parallel.model_parallel(seed=3):
        model = _model(recompute)
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=_batches(), model=[model],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1, forward_only=False)
        expected = {"losses": [float(x["loss"]) for x in losses], "grads": _adapter_grads(model)}
        assert expected["grads"] and all(_layer_of(n) >= DECODER_START for n in expected["grads"])
    path = tmp_path / "expected.pt"
    torch.save(expected, path)
    with sup.single_thread():
        parallel.spawn_gloo(_pp_rank, world_size, recompute, str(path), timeout=900)


def test_payload_round_trip_keeps_every_part():
    """Encode/decode is exact and differentiable in the float parts, detached in the discrete ones."""
    from dsv4flash.integrations.mcore import require_stack_modules
    from dsv4flash.model.state import CSA2State

    require_stack_modules()
    from megatron.core.transformer.hyper_connection import decode_stage_payload, encode_stage_payload

    gen = torch.Generator().manual_seed(0)
    streams = torch.randn(6, 1, 8, generator=gen).to(torch.bfloat16).requires_grad_(True)
    pre_mix = torch.rand(6, 1, 4, generator=gen, requires_grad=True)
    kv = torch.randn(1, 3, 32, generator=gen, requires_grad=True)
    topk = torch.tensor([[[0, 2, -1]] * 6])
    state = CSA2State(compress_kv=kv, topk=topk, ratio=2, kv_layer=14, topk_layer=14)
    payload = encode_stage_payload((streams, pre_mix, *state.tensors()), state.meta())  # as the block sends it
    assert payload.dtype == torch.float32 and payload.shape[1:] == (1, 1)
    received = payload.detach().requires_grad_(True)
    (got_streams, got_pre, *parts), meta = decode_stage_payload(received, detach=(3,))
    got = CSA2State.from_parts(tuple(parts), meta)
    assert got_streams.dtype == torch.bfloat16 and torch.equal(got_streams, streams)
    assert torch.equal(got_pre, pre_mix) and torch.equal(got.compress_kv, kv)
    assert torch.equal(got.topk, topk) and got.index_k is None and got.candidates is None
    assert got.meta() == state.meta()
    (got.compress_kv.sum() + got_pre.sum()).backward()
    payload.backward(received.grad)
    assert torch.equal(kv.grad, torch.ones_like(kv)) and torch.equal(pre_mix.grad, torch.ones_like(pre_mix))
    with pytest.raises(ValueError, match="header"):
        decode_stage_payload(payload[:4])
