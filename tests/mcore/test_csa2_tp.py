"""Tensor parallelism over 2 gloo ranks in training: heads, sink and output groups split; latent side
replicated; the MoE sequence-parallel (each rank routes half of the tokens; experts and the shared expert
split over the ranks as megatron-core's expert tensor parallelism does).

Each rank loads its shard of the reference weights (`load_reference_state(tp_rank=, tp_size=)`). The
gathered logits must equal the single-device reference, every rank's parameter gradient must equal its shard
of the reference gradient (replicated tensors: the full gradient, identical on both ranks), so the keys that
all heads share have their gradient summed over the ranks. The router weight sees only the rank's tokens, so
its gradient summed over the ranks (what megatron-core's `finalize_model_grads` does for parameters marked
`sequence_parallel`) must equal the reference gradient.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]


def _tp_rank(rank: int, world_size: int, expected_path: str) -> None:
    """One TP rank: sharded weights, full logits, sharded gradients against the reference."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state, name_map
    from dsv4flash.integrations.mcore.csa2.weights import shard

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ref = sup.reference(seed=0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        model = DSV41ModelProvider(ref.cfg, parallel_output=False).provide()
        load_reference_state(model, ref.state_dict(), tp_rank=rank, tp_size=world_size)
        model.train()
        out = model(expected["ids"])
        torch.testing.assert_close(out, expected["logits"], rtol=0, atol=2e-5)
        (out * expected["weights"]).sum().backward()
        params = dict(model.named_parameters())
        checked = 0
        for pair in name_map(ref.cfg):
            full = expected["grads"].get(pair.megatron)
            if pair.megatron not in params or full is None:
                continue
            if pair.layout == "glu":  # [w1; w3], each half split over the ranks
                half = full.shape[0] // 2
                want = torch.cat([shard(full[:half], "rows", rank, world_size),
                                  shard(full[half:], "rows", rank, world_size)])
            else:
                want = shard(full, pair.layout, rank, world_size)
            got = params[pair.megatron].grad
            if getattr(params[pair.megatron], "sequence_parallel", False):  # router: local tokens only
                got = got.clone()
                torch.distributed.all_reduce(got, group=parallel_state.get_tensor_model_parallel_group())
            checked += ".mlp." in pair.megatron
            err, scale = float((got - want).abs().max()), float(want.abs().max())
            assert err <= 5e-4 * scale + 1e-7, f"rank {rank} {pair.megatron}: |Δgrad| {err:.3g} vs {scale:.3g}"
        assert checked, "no MoE gradient was compared"
    finally:
        parallel_state.destroy_model_parallel()


@LAYOUT(tp=2, check="training, sequence-parallel MoE: gathered logits, every gradient shard (router summed "
        "over ranks)")
def test_two_rank_tensor_parallel_equals_single_device(tmp_path):
    with sup.single_thread():
        path = tmp_path / "expected.pt"
        sup.save_reference_expectation(path, ids_seed=71, probe_seed=72)
        parallel.spawn_gloo(_tp_rank, 2, str(path))
