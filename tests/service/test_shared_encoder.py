"""Shared-encoder multi-adapter logits are bit-equal to separate runs; ineligible adapters are refused."""

import pytest
import torch

from dsv4flash.lora import LoraConfig
from dsv4flash.service.compute.shared_encoder import multi_adapter_logits, sharing_refusal


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


def _decoder_placements():
    from dsv4flash.lora import PRESETS

    router = list(PRESETS["decoder_half"].include) + ["layers.*.ffn.gate"]
    return [LoraConfig(preset="decoder_half", rank=2), LoraConfig(preset="decoder_half", rank=4, seed=1),
            LoraConfig(preset="decoder_half", rank=2, include=router, seed=2),
            LoraConfig(preset="decoder_half", rank=2, wo_a_lora="shared_a", expert_lora="shared_outer", seed=3)]


def test_batched_decoders_match_separate_runs_to_rounding(resident):
    """exact=False: same-placement adapters share one fully batched decoder pass; logits equal separate runs to
    fp32 rounding (not bit for bit: GEMM kernels by M, scalar tails of transcendental ops)."""
    placements = _decoder_placements()
    adapters = [(pc, _adapter(resident, pc, 10 * j + k)) for j, pc in enumerate(placements) for k in range(3)]
    adapters.append((placements[1], _adapter(resident, placements[1], 99)))
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    batched = multi_adapter_logits(resident, ids, adapters, exact=False)
    separate = multi_adapter_logits(resident, ids, adapters, share=False)
    per_adapter = multi_adapter_logits(resident, ids, adapters, batched=False)
    assert sorted(batched.batched) == list(range(len(adapters))) and per_adapter.batched == []
    assert batched.compressor_reuses == 2 + 3 + 2 + 2  # each placement's batch compresses the source KV once
    for i, (a, b, c) in enumerate(zip(batched.logits, separate.logits, per_adapter.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"adapter {i} ({adapters[i][0].preset})")
        assert torch.equal(c, b)
    assert len({tuple(x.flatten()[:8].tolist()) for x in batched.logits}) == len(adapters)  # all different


@pytest.mark.parametrize("n, batch, seq", [(2, 1, 1), (8, 1, 3), (4, 1, 5), (3, 2, 17), (8, 2, 24), (2, 3, 40)])
def test_batched_exact_decoders_bit_equal_to_separate_runs(resident, n, batch, seq):
    """The default batched decoder (batch-dependent ops per adapter chunk) is bit-equal to separate runs, for
    every decoder placement (router LoRA, shared-A wo_a, shared-outer experts), 1-row chunks (where the
    GEMM kernel differs from a larger M), odd lengths that end inside a ratio-2 compression group, and more
    routed experts than tokens."""
    placements = _decoder_placements()
    adapters = [(pc, _adapter(resident, pc, 100 * j + k)) for j, pc in enumerate(placements) for k in range(n)]
    ids = torch.randint(3, 400, (batch, seq), generator=torch.Generator().manual_seed(seq))
    exact = multi_adapter_logits(resident, ids, adapters)
    separate = multi_adapter_logits(resident, ids, adapters, share=False)
    assert sorted(exact.batched) == list(range(len(adapters)))
    for i, (a, b) in enumerate(zip(exact.logits, separate.logits)):
        assert torch.equal(a, b), f"adapter {i} ({adapters[i][0].preset}, placement {i // n})"
    assert len({tuple(x.flatten()[:8].tolist()) for x in exact.logits}) == len(adapters)  # all different


def test_batched_routed_experts_split_rows_by_chunk(resident):
    """Few tokens over many experts: an expert's rows come unevenly from the chunks and still get their adapter."""
    pc = LoraConfig(preset="decoder_half", rank=2)
    adapters = [(pc, _adapter(resident, pc, s)) for s in range(4)]
    ids = torch.randint(3, 400, (1, 5), generator=torch.Generator().manual_seed(2))
    batched = multi_adapter_logits(resident, ids, adapters, exact=False)
    separate = multi_adapter_logits(resident, ids, adapters, share=False)
    for a, b in zip(batched.logits, separate.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_adapter_batch_rejects_bad_rows_and_mismatched_adapters(resident):
    """Rows that do not split into the batch's chunks, and an adapter missing a factor, are named errors."""
    from dsv4flash.lora.adapter_batch import AdapterBatch

    pc = LoraConfig(preset="decoder_half", rank=2)
    slots = resident.adapter_slots(pc)
    good = _adapter(resident, pc, 0)
    batch = AdapterBatch(slots, [good, good, good])
    assert batch.bounds(6) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="7 rows do not split"):
        batch.bounds(7)
    with batch.rows([1, 0, 4]):
        assert batch.bounds(5) == [(0, 1), (1, 1), (1, 5)]
        with pytest.raises(ValueError, match="cover 5 rows, the input has 6"):
            batch.bounds(6)
    missing = dict(good)
    key = sorted(missing)[0]
    del missing[key]
    with pytest.raises(KeyError, match="adapter 1 of the batch lacks"):
        AdapterBatch(slots, [good, missing])


def test_shared_prefill_sampling_equals_each_clients_own_sample(resident, tmp_path):
    """sample_shared: same tokens and log-probs as client.sample for every client; the prefill is shared only by
    decoder-only, KV-frozen adapters (a full_linear adapter and the bare base run their own, with reasons)."""
    import dsv4flash.service as tinker
    from dsv4flash.service import types

    service = tinker.ServiceClient(root=tmp_path, resident=resident)
    clients = []
    for i, preset in enumerate(["decoder_half", "decoder_half", "full_linear", "decoder_half"]):
        tc = service.create_lora_training_client(rank=2, preset=preset, seed=i)
        datum = types.Datum(model_input=types.ModelInput.from_ints([0, 5 + i, 6, 7]),
                            loss_fn_inputs={"target_tokens": [5 + i, 6, 7, 8], "weights": [1.0] * 4})
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
        clients.append(tc.save_weights_and_get_sampling_client())
    clients.append(service.create_sampling_client(base_model="tiny"))
    prompt = types.ModelInput.from_ints([0, 11, 12, 13, 14, 15])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    shared = tinker.sample_shared(clients, prompt, 3, params)
    alone = [c.sample(prompt, 3, params).result() for c in clients]
    assert shared.shared == [0, 1, 3]
    assert "not decoder-only" in shared.refused[2] and "bare base" in shared.refused[4]
    for got, want in zip(shared.result(), alone):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]
    assert len({tuple(r.sequences[0].logprobs) for r in alone}) == len(clients)  # the adapters really differ
    with pytest.raises(ValueError, match="empty prompt"):
        tinker.sample_shared(clients, types.ModelInput.from_ints([]), 1, params)


def test_shared_prefill_caches_share_encoder_kv_and_decode_bit_equal(resident):
    from dsv4flash.model.cache import storage_bytes

    dec = LoraConfig(preset="decoder_half", rank=2)
    full = LoraConfig(preset="full_linear", rank=2)
    adapters = [(dec, _adapter(resident, dec, s)) for s in (1, 2, 3)] + [(full, _adapter(resident, full, 4))]
    ids = torch.randint(3, 400, (1, 21), generator=torch.Generator().manual_seed(1))
    shared = multi_adapter_logits(resident, ids, adapters, caches=True)
    separate = multi_adapter_logits(resident, ids, adapters, share=False, caches=True)
    assert shared.shared == [0, 1, 2] and shared.batched == [0, 1, 2]  # one batched decoder pass records 3 caches
    for a, b in zip(shared.caches, separate.caches):
        assert a.length == b.length and all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    start = resident.cfg.decoder_start
    c0, c1, c2 = shared.caches[:3]
    for layer in range(len(c0.window)):  # the encoder half's window KV is one tensor; decoder layers' are each own
        assert (c0.window[layer] is c1.window[layer] is c2.window[layer]) == (layer < start)
    for layer in c0.sources:  # every kv-source segment (encoder sources and the CED source) is shared
        assert c0.sources[layer] is c1.sources[layer] is c2.sources[layer]
    own = sum(c1.window[l].nbytes for l in range(start, len(c1.window))) + c1.ngram_ids.nbytes + c1.ngram_types.nbytes
    assert storage_bytes(c0, c1, c2) - storage_bytes(c0, c1) == own < storage_bytes(separate.caches[2])
    tokens = torch.tensor([[7], [8], [9], [10]])
    for i, (pc, tensors) in enumerate(adapters):
        assert torch.equal(shared.logits[i], separate.logits[i])
        a, b = shared.caches[i], separate.caches[i]
        with resident.bind(pc, tensors) as model, torch.no_grad():
            for t in tokens:
                la, a = model.decode(a, t)
                lb, b = model.decode(b, t)
                assert torch.equal(la, lb)
    with pytest.raises(ValueError, match="caches=True needs exact=True"):
        multi_adapter_logits(resident, ids, adapters, caches=True, exact=False)


def test_multi_adapter_decode_shares_the_encoder_step_bit_equal(resident):
    """Decode steps of N adapters from one shared prefill: the encoder half runs once per distinct
    continuation, every adapter's logits and cache equal its own `model.decode` bit for bit."""
    from dsv4flash.service.compute.shared_encoder import multi_adapter_decode

    dec = LoraConfig(preset="decoder_half", rank=2)
    full = LoraConfig(preset="full_linear", rank=2)
    adapters = [(dec, _adapter(resident, dec, s)) for s in (1, 2, 3)] + [(full, _adapter(resident, full, 4))]
    prompt = torch.randint(3, 400, (2, 13), generator=torch.Generator().manual_seed(2))
    shared = multi_adapter_logits(resident, prompt, adapters, caches=True).caches
    own = list(shared)  # each adapter decoding alone from the same prompt caches
    start = resident.cfg.decoder_start
    # 9 steps (past ratio-2 group and window boundaries); adapter 2 diverges at step 4, then a 2-token chunk
    steps = [torch.tensor([7 + s, 30 + s]) for s in range(9)] + [torch.tensor([[5, 6], [8, 9]])]
    for s, tokens in enumerate(steps):
        ids = [tokens, tokens, tokens + (s >= 4), tokens]
        step = multi_adapter_decode(resident, shared, ids, adapters, batched=s % 2 == 0)
        assert step.encoder_passes == (1 if s < 4 else 2) and list(step.refused) == [3]
        # even steps: the decoder halves of one encoder group run as one bit-exact batch (from their own caches)
        assert step.batched == ([] if s % 2 else [0, 1, 2] if s < 4 else [0, 1])
        for i, (pc, tensors) in enumerate(adapters):
            with resident.bind(pc, tensors) as model, torch.no_grad():
                want, own[i] = model.decode(own[i], ids[i])
            assert torch.equal(step.logits[i], want), (s, i)
            a, b = step.caches[i], own[i]
            assert a.length == b.length and all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors())), (s, i)
        assert step.caches[0].sources[start].prompt_kv is step.caches[1].sources[start].prompt_kv  # still shared
        shared = step.caches
        for layer in range(start):  # adapters 0 and 1 keep one set of encoder records; 2 has its own after step 4
            assert shared[0].window[layer] is shared[1].window[layer]
            assert (shared[0].window[layer] is shared[2].window[layer]) == (s < 4)
    assert not torch.equal(step.logits[0], step.logits[1])  # the adapters really differ
    with pytest.raises(ValueError, match="3 caches for 4 adapters"):
        multi_adapter_decode(resident, shared[:3], steps[0], adapters)
