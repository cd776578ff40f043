"""Packed sequences: compression groups, validity masks and RoPE follow each sequence; padding never enters.

Oracle: each sequence run *alone* through the reference model. A THD micro-batch (`packed_seq_params`
with `cu_seqlens_q` and padded slots `cu_seqlens_q_padded`) must give, for every sequence, the logits of
its solo run, and the parameter gradients of Σ_sequences loss(solo run). Padding slots get arbitrary token
ids; the real tokens' logits must not depend on them, and no gradient may reach a padding embedding.
"""

from __future__ import annotations

import pytest
import torch

from dsv4flash.model.quant import fake_quant
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity]

LENGTHS = (23, 33, 1, 12)  # odd lengths leave partial ratio-2 groups; 33 reaches past the candidate pool
PADS = (3, 0, 2, 5)  # padding slots after each sequence (cu_seqlens_q_padded)


@pytest.fixture(scope="module")
def mcore():
    """One single-rank Megatron session for the module."""
    with parallel.model_parallel(seed=1234), sup.single_thread():
        yield


@LAYOUT(packed=True, recompute="full", check="THD batch vs each sequence alone: logits, every gradient; padding "
        "never read")
def test_packed_sequences_equal_each_sequence_alone(mcore):
    # with the fake-quant points off: packing changes the GEMM shapes, so summation orders, and at a code boundary
    # an ulp of that moves a quantized lane by a whole code (docs/testing.md); the points are per-token lane
    # blocks, so they cannot mix sequences, and the packed tests below run with them on
    with fake_quant(False):
        ref = sup.reference(seed=0)
        gen = torch.Generator().manual_seed(21)
        seqs = [torch.randint(0, sup.VOCAB, (n,), generator=gen) for n in LENGTHS]
        probes = [sup.probe((1, n, sup.VOCAB), seed=30 + k) for k, n in enumerate(LENGTHS)]
        expected = []
        for seq, weights in zip(seqs, probes):  # the oracle: Σ over sequences of their solo runs
            logits = ref(seq[None])
            (logits * weights).sum().backward()
            expected.append(logits.detach()[0])

        model = sup.megatron_from(ref, recompute="full")
        pad_ids = [torch.randint(0, sup.VOCAB, (8,), generator=gen) for _ in LENGTHS]
        ids, pos, params, starts = sup.pack(seqs, PADS, pad_ids)
        logits = model(ids, pos, packed_seq_params=params)[0]  # [T, V]
        loss = 0
        for seq, start, want, weights in zip(seqs, starts, expected, probes):
            got = logits[start:start + len(seq)]
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
            loss = loss + (got * weights[0]).sum()
        loss.backward()
        sup.assert_grads_match(ref, model, rel=5e-4)


def test_padding_content_never_reaches_real_tokens(mcore):
    ref = sup.reference(seed=1)
    model = sup.megatron_from(ref)
    gen = torch.Generator().manual_seed(22)
    seqs = [torch.randint(0, sup.VOCAB, (n,), generator=gen) for n in LENGTHS]
    outs, grads = [], []
    for trial in range(2):  # two different fillings of the padding slots
        pad_ids = [torch.randint(0, sup.VOCAB, (8,), generator=gen) for _ in LENGTHS]
        ids, pos, params, starts = sup.pack(seqs, PADS, pad_ids)
        emb = model.embedding(ids, pos).detach().requires_grad_(True)  # [T, 1, D]
        logits = model(ids, pos, decoder_input=emb, packed_seq_params=params)[0]
        real = torch.cat([torch.arange(s, s + len(q)) for s, q in zip(starts, seqs)])
        logits[real].sum().backward()
        outs.append(logits[real].detach())
        pad = torch.ones(ids.shape[1], dtype=torch.bool)
        pad[real] = False
        grads.append(emb.grad[pad])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # exactly: padding is never read
    assert grads[0].abs().max() == 0 and grads[1].abs().max() == 0


def test_right_padded_rows_equal_their_unpadded_runs(mcore):
    ref = sup.reference(seed=2)
    model = sup.megatron_from(ref)
    ids = sup.token_ids(2, 40, seed=23)
    lengths = (40, 27)
    padding_mask = torch.arange(40)[None, :] >= torch.tensor(lengths)[:, None]  # True = padding
    with torch.no_grad():
        logits = model(ids, padding_mask=padding_mask)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(logits[row, :n], ref(ids[row:row + 1, :n])[0], rtol=0, atol=2e-5)


def test_group_table_follows_each_sequence():
    from dsv4flash.integrations.mcore import require_stack_modules

    require_stack_modules()  # the stack's upstream-form modules (twins on a stock release)
    from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import build_csa2_layout

    _, _, params, starts = sup.pack([torch.zeros(n, dtype=torch.long) for n in (5, 4)], (1, 2),
                                [torch.zeros(8, dtype=torch.long)] * 2)
    layout = build_csa2_layout(1, 12, "cpu", 0, packed_seq_params=params)
    assert layout.seq.tolist() == [[0, 0, 0, 0, 0, -1, 1, 1, 1, 1, -1, -1]]
    assert layout.pos[0, :10].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3]
    two = layout.groups(2)  # groups of 2: seq 0 -> (0,1) (2,3); seq 1 -> (6,7) (8,9); token 4 stays alone
    assert two.num_entries == 4
    assert two.members[0, :, -1].tolist() == [1, 3, 7, 9] and two.owner_start[0].tolist() == [0, 2, 0, 2]
    assert two.q_base[0].tolist() == [0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0]
    assert two.q_reach[0].tolist() == [0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 0, 0]
    visible = two.visible()[0]
    assert visible[9].tolist() == [False, False, True, True]  # never another sequence's groups
    one = layout.groups(1)
    assert one.num_entries == 9 and one.members[0, :, -1].tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]


@pytest.mark.parametrize("mask, message", [
    ([[True, False, False, False]], "suffix"),  # left padding
    ([[False, True, False, False]], "suffix"),  # interior padding
])
def test_non_suffix_padding_is_rejected(mask, message):
    from dsv4flash.integrations.mcore import require_stack_modules

    require_stack_modules()  # the stack's upstream-form modules (twins on a stock release)
    from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import build_csa2_layout

    with pytest.raises(ValueError, match=message):
        build_csa2_layout(1, 4, "cpu", 0, padding_mask=torch.tensor(mask))
