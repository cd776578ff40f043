"""DSV41-MCORE-009: CSA2 attention on THD-packed sequences and under context parallelism (one owner per
compressed key, halo exchange across the CP boundary).

Without the patch (DSV41-MCORE-008 alone) CSA2 refuses `packed_seq_params`. The `patch_form` tests run with
the runtime twins on the installed megatron-core and on a copy of the pinned release with the series applied:
a packed row of three padded documents must give each document exactly what it gets alone (outputs and
parameter gradients), and two gloo context-parallel ranks holding megatron-core's zigzag shards (of plain rows
and, per document, of a packed row) must reproduce the single-rank outputs and, summed over ranks, its
gradients. The twin's files are byte-identical to what the format-patches add.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.mcore_cpu import parallel as mcore_parallel_lib
from tests.patches.test_mcore_hyper_connection import ROOT, added_files

PATCH_ID = "DSV41-MCORE-009"
pytestmark = [pytest.mark.patches, pytest.mark.upstream, pytest.mark.whole_machine]

HIDDEN = 32
LENGTHS, PADDED = [5, 8, 3], [6, 8, 4]  # real and slot lengths of the packed documents


def _block(**kwargs):
    from megatron.core.models.gpt.csa2_layer_specs import get_csa2_decoder_block_spec
    from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = CSA2TransformerConfig(
        num_layers=5, hidden_size=HIDDEN, num_attention_heads=4, kv_channels=16, ffn_hidden_size=64,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.2, params_dtype=torch.float32, use_cpu_initialization=True, hc_mult=2,
        csa2_layer_pattern="SFPIR", csa2_compress_ratios=[0, 2, 0, 0, 0], csa2_q_lora_rank=16, csa2_rope_dim=8,
        csa2_sliding_window=3, csa2_output_groups=2, csa2_output_rank=8, csa2_index_heads=2,
        csa2_index_head_dim=8, csa2_index_topk=2, csa2_candidate_block_size=2, csa2_candidate_topk_blocks=1,
        **kwargs)
    return TransformerBlock(config, get_csa2_decoder_block_spec(config))


def _packed(lengths, padded):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))


def _grads(block):
    return {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}


def test_without_the_patch_csa2_refuses_packed_sequences(mcore_parallel):
    from dsv4flash.patching import twins

    registry = twins.discover()
    twin, base = registry.get(PATCH_ID), registry.get("DSV41-MCORE-008")
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        applied_here = base.apply(mode="auto") == twins.Outcome.APPLIED
        try:
            block = _block()
            with pytest.raises(NotImplementedError, match="packed"):
                block(torch.randn(sum(PADDED), 1, HIDDEN), attention_mask=None,
                      packed_seq_params=_packed(LENGTHS, PADDED))
        finally:
            if applied_here:
                base.revert()


def test_twin_files_are_the_patches_files():
    from dsv4flash.integrations.mcore.patches import UPSTREAM_SOURCES
    from dsv4flash.integrations.mcore.patches.csa2_packing_cp import SOURCE

    from dsv4flash.integrations.mcore.patches.csa2_attention import SHIPPED_AS_OF
    from tests.patches.test_mcore_csa2_compress_pool_yarn import patched_tree

    added = {rel: body for pid in ("DSV41-MCORE-010", "DSV41-MCORE-008", PATCH_ID, SHIPPED_AS_OF)
             for rel, body in added_files(pid).items()}
    # Every shipped file is some patch's new file (no stale or extra copies), byte for byte as the patch adds
    # it or, for a file that DSV41-MCORE-011 edits afterwards, as 011's patched tree leaves it.
    assert {str(p.relative_to(UPSTREAM_SOURCES)) for p in UPSTREAM_SOURCES.rglob("*.py")} == set(added)
    assert SOURCE in added_files(PATCH_ID)
    tree = patched_tree(SHIPPED_AS_OF)
    edited = {rel for rel in tree_files_edited(SHIPPED_AS_OF) if rel in added}
    for rel, body in added.items():
        expected = (tree.root / rel).read_text() if rel in edited else body
        assert expected == (UPSTREAM_SOURCES / rel).read_text(), f"{rel}: the twin's copy differs from the patch"


def tree_files_edited(patch_id: str) -> set[str]:
    """Files a megatron-lm patch modifies (rather than creates)."""
    from dsv4flash.patchseries.series import load_series

    patch = load_series(ROOT / "patches")["megatron-lm"].by_id()[patch_id]
    return set(patch.files) - set(added_files(patch_id))


def test_packed_documents_match_separate_runs(patch_form, mcore_parallel):
    torch.manual_seed(91)
    block = _block()
    starts = [0, 6, 14]
    hidden = torch.randn(sum(PADDED), 1, HIDDEN, requires_grad=True)
    out = block(hidden, attention_mask=None, packed_seq_params=_packed(LENGTHS, PADDED))  # [t, 1, h]
    torch.cat([out[s:s + n] for s, n in zip(starts, LENGTHS)]).square().sum().backward()
    packed_grads = _grads(block)
    block.zero_grad(set_to_none=True)
    for start, n in zip(starts, LENGTHS):
        alone = block(hidden.detach()[start:start + n], attention_mask=None)  # [n, 1, h]
        torch.testing.assert_close(out[start:start + n], alone, atol=1e-5, rtol=1e-5)
        alone.square().sum().backward()
    separate = _grads(block)
    assert packed_grads.keys() == separate.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, separate[name], atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    patch_form.record("output", out.detach(), atol=1e-5, rtol=1e-5)


def _zigzag(t: torch.Tensor, rank: int, cp: int, bounds) -> torch.Tensor:
    """megatron-core's split along dim 0: each [lo, hi) in 2·cp chunks, rank r takes chunks r and 2cp−1−r."""
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        chunks = t[lo:hi].chunk(2 * cp)
        parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(parts)


def _cp_rank(rank: int, world_size: int, form: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv4flash.patching import twins
    from megatron.core import parallel_state

    twin = twins.discover().get(PATCH_ID)
    if form == "runtime":
        assert twin.apply().active, "the runtime twin did not apply in the rank"
    else:
        assert not twin.applied and twin.upstream_has_it(), "the rank does not run the patched copy"
    result = {}
    with mcore_parallel_lib.model_parallel(cp=world_size, rank=rank, world_size=world_size, seed=4):
        cp_group = parallel_state.get_context_parallel_group()
        torch.manual_seed(92)
        reference = _block()
        block = _block(context_parallel_size=world_size)
        block.load_state_dict(reference.state_dict())
        padded = [8, 12, 4]  # each document a multiple of 2·cp slots
        lengths = [7, 12, 3]
        cases = {"rows": (torch.randn(16, 2, HIDDEN), None, [0, 16]),
                 "packed": (torch.randn(sum(padded), 1, HIDDEN), (lengths, padded),
                            [0, *torch.tensor(padded).cumsum(0).tolist()])}
        for name, (hidden, packing, bounds) in cases.items():
            params = _packed(*packing) if packing else None
            reference.zero_grad(set_to_none=True)
            block.zero_grad(set_to_none=True)
            full = reference(hidden, attention_mask=None, packed_seq_params=params)
            weight = torch.linspace(-1.0, 1.0, full.numel()).view_as(full)  # a loss that tells tokens apart
            (full * weight).sum().backward()
            out = block(_zigzag(hidden, rank, world_size, bounds), attention_mask=None, packed_seq_params=params)
            (out * _zigzag(weight, rank, world_size, bounds)).sum().backward()
            torch.testing.assert_close(out, _zigzag(full.detach(), rank, world_size, bounds), atol=1e-5, rtol=1e-5)
            expected, grads = _grads(reference), _grads(block)
            assert expected.keys() == grads.keys()
            for pname, grad in grads.items():
                dist.all_reduce(grad, group=cp_group)  # what DDP's CP-aware gradient reduction sums
                torch.testing.assert_close(grad, expected[pname], atol=1e-5, rtol=1e-5, msg=f"{name}: {pname}")
            result[name] = {"output_sum": float(out.sum()), "grad_sums": {n: float(g.sum()) for n, g in grads.items()}}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_context_parallel_ranks_match_one_rank(patch_form, tmp_path):
    mcore_parallel_lib.spawn_gloo(_cp_rank, 2, patch_form.name, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    patch_form.record("ranks", ranks, atol=1e-4, rtol=1e-4)
