"""The study's layout on 4 gloo ranks: THD-packed sequences (dynamic batching) under CP = 2 *and* PP = 2.

Each pipeline stage (6 of the tiny model's 12 layers) is split over 2 context-parallel ranks with
megatron-core's per-document zigzag; the stages exchange the CSA2 payload of their CP shard through
megatron-core's 1F1B schedule. The oracle is each sequence run alone through the single-device reference
(`test_csa2_packed_cp.save_packed_oracle`): the last stage's per-token LM loss equals the solo loss of
every real token, and every parameter gradient averaged over the CP ranks (megatron-core's schedule scales
the loss by the CP size, its DDP averages over dp × cp) equals the reference gradient.
"""

from __future__ import annotations

import pytest
import torch

from dsv4flash.integrations.mcore.csa2.weights import global_name
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore.test_csa2_packed_cp import packed_params, save_packed_oracle
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]




def _pp_cp_rank(rank: int, world_size: int, recompute: str, expected_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    ids, pos, labels, real_all = expected["ids"], expected["pos"], expected["labels"], expected["real"]
    params = packed_params()
    with parallel.model_parallel(pp=2, cp=2, rank=rank, world_size=world_size, seed=3):
        ref = sup.reference(seed=0)
        model = DSV41ModelProvider(ref.cfg, recompute=recompute, overrides=dict(
            pipeline_dtype=torch.float32, variable_seq_lengths=True)).provide()
        load_reference_state(model, ref.state_dict())
        model.train()
        local = model.decoder.cp_positions(ids.shape[1] // 2, params)
        seen = []

        def forward_step(data_iterator, chunk):
            next(data_iterator)
            output = chunk(ids[:, local], pos[:, local], labels=labels[:, local], packed_seq_params=params)

            def loss_func(per_token_loss):
                seen.append(per_token_loss.detach())
                loss = (per_token_loss[0] * real_all[local]).sum()
                return loss, {"loss": loss.detach()}

            return output, loss_func

        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
            seq_length=ids.shape[1] // 2, micro_batch_size=1, forward_only=False)
        real = real_all[local]
        if parallel_state.is_pipeline_last_stage():
            torch.testing.assert_close(seen[0][0, real], expected["token_loss"][local][real], rtol=0, atol=2e-5)
        else:
            assert not seen
        cp_group = parallel_state.get_context_parallel_group()
        checked = 0
        for name, param in model.named_parameters():
            want = expected["grads"].get(global_name(name, model))
            if want is None:
                continue
            # megatron-core's schedule scales the loss by the CP size and its DDP averages over dp × cp.
            got = param.grad.clone()
            dist.all_reduce(got, group=cp_group)
            got /= cp_group.size()
            err, scale = float((got - want).abs().max()), float(want.abs().max())
            # As in test_csa2_packed_cp (CP reorders fp32 sums; an FP8 window-KV code can flip).
            assert err <= 5e-3 * scale + 1e-7, f"rank {rank} {name}: |Δgrad| {err:.3g} vs {scale:.3g}"
            checked += 1
        assert checked > 20, f"rank {rank}: only {checked} gradients compared"


@pytest.mark.slow
@LAYOUT(pp=2, cp=2, packed=True, recompute="full", check="4 ranks: THD-packed, per-document zigzag CP inside each "
        "of 2 pipeline stages: per-token loss vs each sequence alone, gradients summed over CP vs the reference")
def test_packed_sequences_under_context_and_pipeline_parallelism(tmp_path):
    with sup.single_thread():
        path = save_packed_oracle(tmp_path)
        parallel.spawn_gloo(_pp_cp_rank, 4, "full", str(path), timeout=600)
