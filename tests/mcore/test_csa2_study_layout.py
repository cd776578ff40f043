"""The study's training layout at tiny size on 4 gloo ranks: dynamic batching (THD-packed sequences) with
context parallel 2 and expert parallel 2, uniform full recompute.

World 4 = 2 data-parallel replicas × CP 2; megatron-core forms the expert-parallel groups over the
dp × cp ranks, so each EP group holds both CP halves of one replica and every routed expert sees every
token of the packed batch once. Both replicas take the same batch. The oracle is each sequence run alone
through the single-device reference (`test_csa2_packed_cp.save_packed_oracle`): every rank's per-token loss
equals the solo loss of its real tokens, dense gradients summed over the CP ranks equal the reference
gradients, and each local expert's gradient equals the reference expert's — in fp32 and, to 1e-10 of each
gradient's size, in fp64 (`tests/mcore/float64.py`; why the fp32 bound is looser: test_csa2_packed_cp.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import csa2_support as sup
from tests.mcore.float64 import precision_scope
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore.test_csa2_packed_cp import TOLERANCE, packed_params, save_packed_oracle
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]


def _study_rank(rank: int, world_size: int, precision: str, expected_path: str) -> None:
    with precision_scope(precision):
        _study_checks(rank, world_size, precision, expected_path)


def _study_checks(rank: int, world_size: int, precision: str, expected_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state, name_map

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ids, pos, labels, real_all = expected["ids"], expected["pos"], expected["labels"], expected["real"]
    params = packed_params()
    with parallel.model_parallel(cp=2, ep=2, rank=rank, world_size=world_size, seed=3):
        ref = sup.reference(seed=0)
        ep_rank, ep_size = parallel_state.get_expert_model_parallel_rank(), 2
        model = DSV41ModelProvider(ref.cfg, recompute="full").provide()
        load_reference_state(model, ref.state_dict(), ep_rank=ep_rank, ep_size=ep_size)
        model.train()
        local = model.decoder.cp_positions(ids.shape[1] // 2, params)
        loss = model(ids[:, local], pos[:, local], labels=labels[:, local], packed_seq_params=params)  # [1, S]
        real = real_all[local]
        token_atol, _, grad_rel = TOLERANCE[precision]
        torch.testing.assert_close(loss[0, real], expected["token_loss"][local][real], rtol=0, atol=token_atol)
        (loss[0] * real).sum().backward()

        cp_group = parallel_state.get_context_parallel_group()
        named = dict(model.named_parameters())
        per_rank = ref.cfg.text.n_routed_experts // ep_size
        dense = experts = 0
        for pair in name_map(ref.cfg):
            want = expected["grads"].get(pair.megatron)
            if want is None:
                continue
            name = pair.megatron
            if pair.expert is not None:
                if pair.expert // per_rank != ep_rank:
                    continue
                name = name.replace(f"local_experts.{pair.expert}.", f"local_experts.{pair.expert % per_rank}.")
                got = named[name].grad
                experts += 1
            elif name in named:
                got = named[name].grad.clone()
                dist.all_reduce(got, group=cp_group)
                dense += 1
            else:
                continue
            err, scale = float((got - want).abs().max()), float(want.abs().max())
            assert err <= grad_rel * scale + 1e-30, f"rank {rank} {precision} {name}: |Δgrad| {err:.3g} vs {scale:.3g}"
        assert dense > 20 and experts > 0, f"rank {rank}: compared {dense} dense and {experts} expert gradients"


@pytest.mark.slow
@LAYOUT(cp=2, ep=2, packed=True, recompute="full", check="the study's layout (dynamic batching, CP 2, EP, uniform "
        "full recompute), 4 ranks: per-token loss vs each sequence alone, dense gradients summed over CP and "
        "every local expert's gradient vs the reference (fp32; fp64 to 1e-10)")
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_study_layout_packed_context_and_expert_parallel(precision, tmp_path):
    with sup.single_thread():
        with precision_scope(precision):
            path = save_packed_oracle(tmp_path)
        parallel.spawn_gloo(_study_rank, 4, precision, str(path), timeout=600)
