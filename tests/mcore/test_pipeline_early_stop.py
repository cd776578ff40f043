"""Pipeline backward early stop on megatron-core's real 1F1B schedule, 2 and 3 CPU ranks over gloo.

Each rank is one pipeline stage of a local-spec GPTModel. Stages before `k` are frozen (a frozen vision tower +
encoder); stages from `k` on train only some linears (decoder-side LoRA). Both runs use
`forward_backward_pipelining_without_interleaving`; the early-stop run passes our communicator and detaches the
stage input on stages <= k; the reference run counts its traffic through the same communicator class with
k = 0, which omits nothing (the stock protocol). Grads and losses must match exactly, with fewer backward passes
and no gradient traffic below stage k.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore_cpu import models
from tests.mcore_cpu import parallel as mcore_parallel

pytestmark = [pytest.mark.upstream, pytest.mark.whole_machine]

SEQ, MBS, HIDDEN, VOCAB, MICROBATCHES, LAYERS_PER_STAGE = 8, 2, 32, 64, 4, 2
TRAINABLE = ("linear_fc1", "linear_proj")  # the "adapters" of a trainable stage


def _gpt_stage(world_size: int, rank: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=LAYERS_PER_STAGE * world_size, hidden_size=HIDDEN, num_attention_heads=4,
        pipeline_model_parallel_size=world_size, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=False, fp16=False, use_cpu_initialization=True,
        deallocate_pipeline_outputs=True, add_bias_linear=False,
    )
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=rank == 0, post_process=rank == world_size - 1,
                    position_embedding_type="rope")


def _batches(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "position_ids": torch.arange(SEQ).expand(MBS, SEQ), "attention_mask": mask}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _run(model, early_stop: bool, seed: int):
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from dsv4flash.integrations.mcore.pipeline import BackwardEarlyStop

    model.zero_grad(set_to_none=True)
    plan = BackwardEarlyStop.agree(model)
    if early_stop:
        plan.attach(model)
        kwargs = plan.schedule_kwargs(model.config)
    else:
        # Stock protocol, only counted: with k = 0 the communicator never omits anything.
        kwargs = BackwardEarlyStop(0, plan.stage, plan.num_stages, plan.pp_group).schedule_kwargs(model.config)
    losses = forward_backward_pipelining_without_interleaving(
        forward_step_func=_forward_step, data_iterator=_batches(seed), model=[model],
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS, forward_only=False, **kwargs)
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    return plan, [float(x["loss"]) for x in losses], grads, kwargs["p2p_communicator"].stats


def _pp_rank(rank: int, world_size: int, first_trainable: int) -> None:
    from tests.mcore_cpu import parallel

    with parallel.model_parallel(pp=world_size, rank=rank, world_size=world_size, seed=3):
        model = _gpt_stage(world_size, rank)
        for name, param in model.named_parameters():
            param.requires_grad_(rank >= first_trainable and any(t in name for t in TRAINABLE))
        backward_count = models.count_layer_backwards(model)

        _, stock_losses, stock_grads, stock_stats = _run(model, early_stop=False, seed=7)
        stock_backwards, backward_count[0] = backward_count[0], 0
        plan, losses, grads, stats = _run(model, early_stop=True, seed=7)
        early_backwards = backward_count[0]

        assert plan.first_trainable_stage == first_trainable
        assert losses == stock_losses and (len(losses) == MICROBATCHES) == (rank == world_size - 1)
        for name, grad in grads.items():
            want = stock_grads[name]
            if want is None:
                assert grad is None, name
            else:
                assert torch.equal(grad, want), name
        trained = [n for n, g in grads.items() if g is not None]
        assert bool(trained) == (rank >= first_trainable) and all(any(t in n for t in TRAINABLE) for n in trained)

        layers = LAYERS_PER_STAGE * MICROBATCHES
        # Stock: every stage but the first computes and ships its input gradient; every stage but the last
        # waits for one.
        assert stock_stats.grads_sent == (MICROBATCHES if rank > 0 else 0)
        assert stock_stats.grads_received == (MICROBATCHES if rank < world_size - 1 else 0)
        assert stock_stats.sends_skipped == stock_stats.receives_skipped == 0
        if rank < first_trainable:
            assert plan.skips_backward and early_backwards == 0
            # Stock backprops through a frozen middle stage because its received activation requires grad.
            assert stock_backwards == (layers if rank > 0 else 0)
            assert stats.grads_received == 0 and stats.grads_sent == 0
        else:
            assert early_backwards == stock_backwards == layers
            assert stats.grads_sent == (MICROBATCHES if rank > first_trainable else 0)
            assert stats.grads_received == (MICROBATCHES if rank < world_size - 1 else 0)
        # Stage k computes no input gradient at all (nothing to drop); stages below it post no receive for one.
        assert stats.sends_skipped == 0
        assert stats.receives_skipped == (MICROBATCHES if rank < first_trainable else 0)
        assert stats.forward_sent == stock_stats.forward_sent and stats.forward_received == stock_stats.forward_received


@pytest.mark.parametrize("world_size, first_trainable", [(2, 1), (3, 2), (3, 1)])
def test_early_stop_matches_stock_1f1b(world_size, first_trainable):
    mcore_parallel.spawn_gloo(_pp_rank, world_size, first_trainable)


# ---- single rank ----------------------------------------------------------------------------------
@pytest.fixture()
def mp1():
    from tests.mcore_cpu import parallel

    with parallel.model_parallel(seed=3):
        yield


def test_trainable_host_table_counts_as_trainable(tiny_cfg, mp1):
    from dsv4flash.integrations.mcore.engram import PinnedEngram
    from dsv4flash.integrations.mcore.pipeline import BackwardEarlyStop, stage_is_trainable

    frozen = PinnedEngram(tiny_cfg, 0).requires_grad_(False)
    assert not stage_is_trainable([frozen])
    assert BackwardEarlyStop.agree(frozen).first_trainable_stage == 1  # nothing anywhere: k = num_stages
    rows_only = PinnedEngram(tiny_cfg, 0, trainable_table=True).requires_grad_(False)
    assert stage_is_trainable([rows_only]) and BackwardEarlyStop.agree(rows_only).first_trainable_stage == 0


def test_attach_is_idempotent_and_reversible(mp1):
    from dsv4flash.integrations.mcore.pipeline import BackwardEarlyStop

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seen = None

        def set_input_tensor(self, tensor):
            self.seen = tensor

    stage = Stage()
    plan = BackwardEarlyStop(first_trainable_stage=2, stage=1, num_stages=3)
    plan.attach(stage)
    plan.attach(stage)
    received = torch.ones(2, requires_grad=True)
    stage.set_input_tensor([received])
    assert not stage.seen[0].requires_grad and stage.seen[0].data_ptr() == received.data_ptr()
    BackwardEarlyStop(first_trainable_stage=0, stage=1, num_stages=3).attach(stage)  # trainable again
    stage.set_input_tensor([received])
    assert stage.seen[0] is received


def test_interleaved_schedule_is_rejected(mp1):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsv4flash.integrations.mcore.pipeline import EarlyStopP2PCommunicator

    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="non-interleaved"):
        EarlyStopP2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config, 1)
