"""Pipeline parallel 2 × expert parallel 2 (4 gloo ranks): each stage's MoE layers dispatch over their EP
group while the stages exchange the CSA2 payload through megatron-core's 1F1B schedule.

World 4 = 2 stages × 2 data-parallel replicas; the EP group of a stage is its two replicas, which take the
same batch, so every routed expert sees each token twice (its gradient is twice the reference's, as in
`test_csa2_ep`). The oracle is the single-device reference: the last stage's logits equal the reference
logits, dense gradients equal the reference gradients.
"""

from __future__ import annotations

import pytest
import torch

from dsv4flash.integrations.mcore.csa2.weights import global_name
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]


def _pp_ep_rank(rank: int, world_size: int, expected_path: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ids, weights = expected["ids"], expected["weights"]
    with parallel.model_parallel(pp=2, ep=2, rank=rank, world_size=world_size, seed=3):
        ref = sup.reference(seed=0)
        ep_rank, ep_size = parallel_state.get_expert_model_parallel_rank(), 2
        model = DSV41ModelProvider(ref.cfg, overrides=dict(pipeline_dtype=torch.float32,
                                                           variable_seq_lengths=True)).provide()
        load_reference_state(model, ref.state_dict(), ep_rank=ep_rank, ep_size=ep_size)
        model.train()
        seen = []

        def forward_step(data_iterator, chunk):
            next(data_iterator)
            output = chunk(ids)

            def loss_func(logits):
                seen.append(logits.detach())
                loss = (logits * weights).sum()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=ids.shape[1], micro_batch_size=ids.shape[0], forward_only=False)
        if parallel_state.is_pipeline_last_stage():
            torch.testing.assert_close(seen[0], expected["logits"], rtol=0, atol=2e-5)
        per_rank = ref.cfg.text.n_routed_experts // ep_size
        dense = experts = 0
        for name, param in model.named_parameters():
            full = global_name(name, model)
            if ".local_experts." in full:
                head, _, tail = full.partition(".local_experts.")
                local, _, rest = tail.partition(".")
                want = expected["grads"].get(f"{head}.local_experts.{int(local) + ep_rank * per_rank}.{rest}")
                want = None if want is None else 2 * want  # both replicas' tokens reach the expert
                experts += want is not None
            else:
                want = expected["grads"].get(full)
                dense += want is not None
            if want is None:
                continue
            err, scale = float((param.grad - want).abs().max()), float(want.abs().max())
            assert err <= 5e-4 * scale + 1e-7, f"rank {rank} {full}: |Δgrad| {err:.3g} vs {scale:.3g}"
        assert dense > 20 and experts > 0, f"rank {rank}: compared {dense} dense and {experts} expert gradients"


@pytest.mark.slow
@LAYOUT(pp=2, ep=2, check="4 ranks: last-stage logits, dense gradients and each stage's local expert gradients "
        "vs the reference")
def test_pipeline_and_expert_parallel_equal_single_device(tmp_path):
    with sup.single_thread():
        path = tmp_path / "expected.pt"
        sup.save_reference_expectation(path, ids_seed=77, probe_seed=78)
        parallel.spawn_gloo(_pp_ep_rank, 4, str(path), timeout=600)
