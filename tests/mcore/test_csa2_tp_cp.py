"""Tensor parallel 2 × context parallel 2 in training (4 gloo ranks, full recompute).

Each CP pair of a TP rank holds the zigzag spans of the sequence; within a CP rank the two TP ranks split
heads, sink and output groups and run the MoE sequence-parallel over the CP shard. The oracle is the
single-device reference on the whole sequence: every rank's gathered logits equal the reference at its
positions, and every gradient summed over the CP ranks (the router's also over the TP ranks) equals the
rank's shard of the reference gradient — in fp32 and, to 1e-10 of each gradient's size, in fp64
(`tests/mcore/float64.py`; the fp32 bound: test_csa2_packed_cp.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.float64 import precision_scope
from tests.mcore.test_csa2_cp import TOLERANCE
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]


def _tp_cp_rank(rank: int, world_size: int, precision: str, expected_path: str) -> None:
    with precision_scope(precision):
        _tp_cp_checks(rank, world_size, precision, expected_path)


def _tp_cp_checks(rank: int, world_size: int, precision: str, expected_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state, name_map
    from dsv4flash.integrations.mcore.csa2.weights import shard

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ref = sup.reference(seed=0)
    with parallel.model_parallel(tp=2, cp=2, rank=rank, world_size=world_size, seed=1234):
        tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), 2
        cp_rank = parallel_state.get_context_parallel_rank()
        model = DSV41ModelProvider(ref.cfg, parallel_output=False, recompute="full").provide()
        load_reference_state(model, ref.state_dict(), tp_rank=tp_rank, tp_size=tp)
        model.train()
        ids = expected["ids"]
        positions = model.decoder.cp_positions(ids.shape[1] // 2)
        out = model(ids[:, positions])
        logits_atol, grad_rel = TOLERANCE[precision]
        torch.testing.assert_close(out, expected["logits"][:, positions], rtol=0, atol=logits_atol)
        (out * expected["weights"][:, positions]).sum().backward()
        params = dict(model.named_parameters())
        checked = 0
        for pair in name_map(ref.cfg):
            full = expected["grads"].get(pair.megatron)
            if pair.megatron not in params or full is None:
                continue
            if pair.layout == "glu":
                half = full.shape[0] // 2
                want = torch.cat([shard(full[:half], "rows", tp_rank, tp), shard(full[half:], "rows", tp_rank, tp)])
            else:
                want = shard(full, pair.layout, tp_rank, tp)
            got = params[pair.megatron].grad.clone()
            dist.all_reduce(got, group=parallel_state.get_context_parallel_group())
            if getattr(params[pair.megatron], "sequence_parallel", False):  # router: local tokens only
                dist.all_reduce(got, group=parallel_state.get_tensor_model_parallel_group())
            err, scale = float((got - want).abs().max()), float(want.abs().max())
            assert err <= grad_rel * scale + 1e-30, \
                f"rank {rank} {precision} {pair.megatron}: |Δgrad| {err:.3g} vs {scale:.3g}"
            checked += 1
        assert checked > 50, f"rank {rank}: only {checked} gradients compared"


@pytest.mark.slow
@LAYOUT(tp=2, cp=2, recompute="full", check="4 ranks, training: logits at each rank's zigzag positions, every "
        "gradient shard summed over CP (router also over TP) (fp32; fp64 to 1e-10)")
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_tensor_and_context_parallel_training_equals_single_device(precision, tmp_path):
    with sup.single_thread():
        path = tmp_path / "expected.pt"
        with precision_scope(precision):
            sup.save_reference_expectation(path, ids_seed=75, probe_seed=76)
        parallel.spawn_gloo(_tp_cp_rank, 4, precision, str(path), timeout=600)
