"""THD-packed sequences under context parallelism (2 gloo ranks, zigzag per document and contiguous).

The oracle is each sequence run *alone* through the single-device reference: every rank's per-token LM
loss must equal the reference loss of that token in its solo run, the loss summed over ranks must equal
the sum of the solo losses, and the parameter gradients summed over the CP ranks (megatron-core's DDP over
dp×cp) must equal the gradients of the summed solo losses. The packing has documents shorter than the
halo (window − 1 = 7 tokens), so per-document zigzag chunks of 1–9 tokens take their halo from several
earlier chunks on both ranks; every compression group has exactly one owner, no group or top-k ever reads a
padding slot, and no gradient reaches a padding embedding.

Each layout runs twice: in fp64 (`tests/mcore/float64.py`: the same code with every fp32 op promoted) the
gradients must match to 1e-10 of each tensor's size — any halo, owner, padding, RoPE or compression error
would be O(1) there. In fp32 they match to ~5e-4 of the size at worst, and only because of rounding:
the mHC `base`/`scale` gradients are sums over tokens of terms ~100× larger than the sum, so fp32 summation
order (shorter softmax rows, [s_local] matmuls) shows up amplified, and those few-ulp differences flip the odd
FP8/FP4 fake-quant code. docs/megatron.md §5 records the measurement.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.mcore import csa2_support as sup
from tests.mcore.float64 import precision_scope
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]

LENGTHS = (23, 33, 1, 12)  # odd lengths leave partial ratio-2 groups; 1 token is a document shorter than a chunk
PADS = (1, 3, 3, 4)  # slots 24, 36, 4, 16: each a multiple of 2·cp = 4 (per-document zigzag)
# Per precision: (per-token loss atol, summed loss rtol, gradient tolerance relative to each tensor's max |g|).
TOLERANCE = {"fp64": (1e-12, 1e-13, 1e-10), "fp32": (2e-5, 1e-6, 5e-3)}


def _packed_cp_rank(rank: int, world_size: int, layout_name: str, recompute: str, precision: str,
                    expected_path: str) -> None:
    """One CP rank of the packed batch: loss, gradients, ownership and padding checks against the oracle."""
    with precision_scope(precision):
        _packed_cp_checks(rank, world_size, layout_name, recompute, precision, expected_path)


def _packed_cp_checks(rank, world_size, layout_name, recompute, precision, expected_path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    expected = torch.load(expected_path)
    ids, pos, labels, real_all = expected["ids"], expected["pos"], expected["labels"], expected["real"]
    params = packed_params()
    ref = sup.reference(seed=0)
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        model = sup.megatron_from(ref, recompute=recompute, overrides={"cp_layout": layout_name})
        local = model.decoder.cp_positions(ids.shape[1] // world_size, params)
        emb = model.embedding(ids[:, local], pos[:, local])  # [S_local, 1, D]
        emb.retain_grad()
        loss = model(ids[:, local], pos[:, local], decoder_input=emb, labels=labels[:, local],
                     packed_seq_params=params)  # [1, S_local]
        real = real_all[local]
        token_atol, loss_rtol, grad_rel = TOLERANCE[precision]
        torch.testing.assert_close(loss[0, real], expected["token_loss"][local][real], rtol=0, atol=token_atol)
        total = (loss[0] * real).sum()
        total.backward()
        summed = total.detach().clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, expected["loss"], rtol=loss_rtol, atol=0)
        assert emb.grad[~real].abs().max() == 0, f"rank {rank}: a padding embedding received a gradient"

        params_by_name = dict(model.named_parameters())
        for name, want in expected["grads"].items():
            got = params_by_name[name].grad.clone()
            dist.all_reduce(got, group=parallel_state.get_context_parallel_group())
            err, scale = float((got - want).abs().max()), float(want.abs().max())
            assert err <= grad_rel * scale + 1e-30, f"rank {rank} {precision} {name}: |Δgrad| {err:.3g} vs {scale:.3g}"

        layout = model.decoder.build_tokens(emb.detach(), packed_seq_params=params).layout
        received = torch.tensor([layout.halo_tokens])
        dist.all_reduce(received)
        assert int(received) > 0, "no token crossed ranks: the packing did not exercise the halo"
        for ratio in sorted({p.ratio for p in ref.cfg.backbone_plan if p.ratio}):
            table = layout.groups(ratio)
            owned = torch.zeros(table.num_entries, dtype=torch.long)
            owned[table.owner_entry[0][table.owner_valid[0]]] = 1
            dist.all_reduce(owned)
            assert owned.tolist() == [1] * sum(n // ratio for n in LENGTHS), f"ratio {ratio}: owners {owned.tolist()}"
            members = layout.ext_seq[0][table.members[0][table.owner_valid[0]]]  # [N, ratio]
            assert bool((members >= 0).all()), f"ratio {ratio}: a padding slot entered a compression group"
            assert bool((members == members[:, :1]).all()), f"ratio {ratio}: a group mixes two sequences"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize("layout_name, recompute", [
    pytest.param("zigzag", "none", id="zigzag", marks=LAYOUT(
        cp=2, packed=True, check="per-document zigzag vs each sequence alone: per-token loss, summed loss, "
        "gradients (fp32; fp64 to 1e-10); one owner per KV block; padding never in a group or a gradient")),
    pytest.param("contiguous", "full", id="contiguous", marks=LAYOUT(
        cp=2, packed=True, recompute="full", check="packed row split contiguously: same")),
])
def test_packed_context_parallel_equals_each_sequence_alone(layout_name, recompute, precision, tmp_path):
    with sup.single_thread():
        with precision_scope(precision):
            path = save_packed_oracle(tmp_path)
        parallel.spawn_gloo(_packed_cp_rank, 2, layout_name, recompute, precision, str(path))


def save_packed_oracle(tmp_path):
    """Run each packed sequence alone through the reference; save ids, labels, per-token losses, grads."""
    ref = sup.reference(seed=0)
    gen = torch.Generator().manual_seed(51)
    seqs = [torch.randint(0, sup.VOCAB, (n,), generator=gen) for n in LENGTHS]
    targets = [torch.randint(0, sup.VOCAB, (n,), generator=gen) for n in LENGTHS]
    pad_ids = [torch.randint(0, sup.VOCAB, (8,), generator=gen) for _ in LENGTHS]
    ids, pos, params, starts = sup.pack(seqs, PADS, pad_ids)
    total, token_loss = 0.0, torch.zeros(ids.shape[1])
    labels = torch.zeros_like(ids)
    real = torch.zeros(ids.shape[1], dtype=torch.bool)
    for seq, target, start in zip(seqs, targets, starts):  # the oracle: each sequence alone
        per_token = F.cross_entropy(ref(seq[None])[0], target, reduction="none")
        per_token.sum().backward()
        token_loss[start:start + len(seq)] = per_token.detach()
        labels[0, start:start + len(seq)] = target
        real[start:start + len(seq)] = True
        total = total + float(per_token.detach().sum())
    grads = sup.reference_grads(ref)
    path = tmp_path / "expected.pt"
    torch.save({"ids": ids, "pos": pos, "labels": labels, "real": real, "token_loss": token_loss,
                "loss": torch.tensor(total), "grads": grads}, path)
    return path


def packed_params():
    """The PackedSeqParams of the oracle's packing (global cu_seqlens, as every CP rank receives them)."""
    return sup.pack([torch.zeros(n, dtype=torch.long) for n in LENGTHS], PADS,
                    [torch.zeros(8, dtype=torch.long)] * len(LENGTHS))[2]


def test_per_document_zigzag_split_and_multi_rank_halo():
    """Per-document zigzag (TE's thd_get_partitioned_indices order) and halos longer than a chunk."""
    from dsv4flash.integrations.mcore import require_stack_modules

    require_stack_modules()  # the stack's upstream-form modules (twins on a stock release)
    from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import (
        _halo_plan,
        cp_spans,
        span_positions,
    )

    bounds = [0, 8, 12]  # documents of 8 and 4 slots: chunks of 2 and 1 tokens
    spans = cp_spans(2, bounds, "zigzag")
    assert span_positions(spans[0]).tolist() == [0, 1, 6, 7, 8, 11]
    assert span_positions(spans[1]).tolist() == [2, 3, 4, 5, 9, 10]
    slot_seq = torch.tensor([0] * 8 + [1] * 4)
    plan = _halo_plan(spans, 0, 3, slot_seq)
    # Rank 0's span at 6 needs 3, 4, 5 (rank 1); its span at 11 needs 9, 10 (rank 1), never document 0's slots.
    assert plan.ext_positions.tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert plan.ext_index.numel() - plan.local_slots.numel() == 5
    with pytest.raises(ValueError, match="sequence 1 has 2 slots"):
        cp_spans(2, [0, 8, 10], "zigzag")
    with pytest.raises(ValueError, match="do not split into 2 equal"):
        cp_spans(2, [0, 9], "contiguous")
