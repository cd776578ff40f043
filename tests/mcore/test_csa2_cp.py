"""Context parallelism over 2 gloo ranks: boundary exchange, one owner per KV block, single-rank results.

Each rank holds its spans of the sequence (megatron-core's zigzag split, or contiguous halves), receives
only the halo before each span (window keys, compressor inputs, n-gram ids), compresses only the groups
whose last token it holds, and all ranks assemble the global compressed KV from the owners. The oracle is
the single-device reference run of the whole sequence: every rank's logits must equal the reference logits
at its positions, and the parameter gradients summed over the CP ranks (what megatron-core's DDP does over
the dp×cp group) must equal the reference gradients. S = 36 makes zigzag spans of 9 tokens, so ratio-2
groups straddle rank boundaries.

Each layout also runs in fp64 (`tests/mcore/float64.py`), where logits and gradients must match to 1e-10 of
their size: the fp32 tolerance below covers rounding only (see test_csa2_packed_cp.py and docs/megatron.md §5).
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.float64 import precision_scope
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]

SEQ = 36
# Per precision: (logits atol, gradient tolerance relative to each tensor's max |g|).
TOLERANCE = {"fp64": (1e-12, 1e-10), "fp32": (2e-5, 5e-3)}


def _cp_rank(rank: int, world_size: int, layout_name: str, recompute: str, precision: str,
             expected_path: str) -> None:
    """One CP rank: forward/backward on its spans, compare with the reference, check block ownership."""
    with precision_scope(precision):
        _cp_checks(rank, world_size, layout_name, recompute, precision, expected_path)


def _cp_checks(rank, world_size, layout_name, recompute, precision, expected_path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    expected = torch.load(expected_path)
    ids, weights, logits, grads = expected["ids"], expected["weights"], expected["logits"], expected["grads"]
    ref = sup.reference(seed=0)  # deterministic init: the same weights the parent's oracle ran with
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        model = sup.megatron_from(ref, recompute=recompute, overrides={"cp_layout": layout_name})
        positions = model.decoder.cp_positions(SEQ // world_size)
        out = model(ids[:, positions])
        logits_atol, grad_rel = TOLERANCE[precision]
        torch.testing.assert_close(out, logits[:, positions], rtol=0, atol=logits_atol)
        (out * weights[:, positions]).sum().backward()
        params = dict(model.named_parameters())
        for name, expected in grads.items():
            got = params[name].grad.clone()
            dist.all_reduce(got, group=parallel_state.get_context_parallel_group())
            err, scale = float((got - expected).abs().max()), float(expected.abs().max())
            assert err <= grad_rel * scale + 1e-30, f"rank {rank} {precision} {name}: |Δgrad| {err:.3g} vs {scale:.3g}"

        # Every global compression group has exactly one owner.
        tokens = model.decoder.build_tokens(torch.zeros(SEQ // world_size, 1, 1))
        for ratio in sorted({p.ratio for p in ref.cfg.backbone_plan if p.ratio}):
            table = tokens.layout.groups(ratio)
            owned = torch.zeros(table.num_entries, dtype=torch.long)
            owned[table.owner_entry[0][table.owner_valid[0]]] = 1
            dist.all_reduce(owned)
            assert owned.tolist() == [1] * (SEQ // ratio), f"ratio {ratio}: owners per block {owned.tolist()}"
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize("layout_name, recompute", [
    pytest.param("zigzag", "none", id="zigzag", marks=LAYOUT(
        cp=2, check="zigzag: logits, gradients summed over ranks (fp32; fp64 to 1e-10), one owner per KV block")),
    pytest.param("contiguous", "full", id="contiguous", marks=LAYOUT(cp=2, recompute="full", check="contiguous: same")),
])
def test_two_rank_context_parallel_equals_single_device(layout_name, recompute, precision, tmp_path):
    with sup.single_thread():
        _spawn_against_reference(layout_name, recompute, precision, tmp_path)


def _spawn_against_reference(layout_name, recompute, precision, tmp_path):
    with precision_scope(precision):
        ref = sup.reference(seed=0)
        ids = sup.token_ids(2, SEQ, seed=41)
        weights = sup.probe((2, SEQ, sup.VOCAB), seed=42)
        logits = ref(ids)
        (logits * weights).sum().backward()
        grads = sup.reference_grads(ref)
    path = tmp_path / "expected.pt"  # ranks start from a fork server: hand them plain data and a file
    torch.save({"ids": ids, "weights": weights, "logits": logits.detach(), "grads": grads}, path)
    parallel.spawn_gloo(_cp_rank, 2, layout_name, recompute, precision, str(path))


def test_zigzag_spans_and_halo_sources():
    from dsv4flash.integrations.mcore import require_stack_modules

    require_stack_modules()  # the stack's upstream-form modules (twins on a stock release)
    from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import (
        _halo_plan,
        cp_spans,
        span_positions,
    )

    spans = cp_spans(2, [0, 36], "zigzag")
    assert span_positions(spans[0]).tolist() == list(range(9)) + list(range(27, 36))
    assert span_positions(spans[1]).tolist() == list(range(9, 27))
    # Halo of 3: rank 0's span at 27 reads 24..26 (rank 1); rank 1's span at 9 reads 6..8 (rank 0).
    rows = torch.zeros(36, dtype=torch.long)
    assert _halo_plan(spans, 0, 3, rows).ext_positions.tolist() == list(range(9)) + list(range(24, 36))
    assert _halo_plan(spans, 1, 3, rows).ext_positions.tolist() == list(range(6, 27))
    with pytest.raises(ValueError, match="needs a multiple of 4"):
        cp_spans(2, [0, 34], "zigzag")
