"""DSV41-MCORE-002: `pipeline_backward_early_stop` on megatron-core's real 1F1B schedule, 2 and 3 CPU ranks.

Each gloo rank is one pipeline stage of a local-spec GPTModel (helpers shared with
tests/mcore/test_pipeline_early_stop.py). Stages before k are frozen, stages from k on train some linears.
Every rank runs one step with the option off (stock) and one with it on, through the schedule that
`get_forward_backward_func()` returns, and counts the layers that ran backward and the p2p gradient
transfers. In the `[runtime]` form each rank applies the runtime twin to the stock install; in `[series]`
the ranks import the patched copy of the pinned release. Both must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.mcore.test_pipeline_early_stop import (
    MICROBATCHES,
    MBS,
    SEQ,
    TRAINABLE,
    _batches,
    _forward_step,
    _gpt_stage,
)
from tests.mcore_cpu import models
from tests.mcore_cpu import parallel as mcore_parallel

PATCH_ID = "DSV41-MCORE-002"
pytestmark = [pytest.mark.patches, pytest.mark.upstream, pytest.mark.whole_machine]


def _count_gradient_traffic(rank: int) -> dict[str, int]:
    """Count batched p2p ops by direction: gradients go to rank - 1, activations to rank + 1."""
    import torch.distributed as dist

    counts = {"grads_sent": 0, "grads_received": 0, "acts_sent": 0, "acts_received": 0}
    original = dist.batch_isend_irecv

    def counting(ops):
        for op in ops:
            send = op.op.__name__ == "isend"
            upstream = op.peer == rank - 1
            key = ("grads_sent" if upstream else "acts_sent") if send else (
                "acts_received" if upstream else "grads_received")
            counts[key] += 1
        return original(ops)

    dist.batch_isend_irecv = counting
    return counts


def _step(model, early_stop: bool, counts: dict[str, int], backwards: list[int]):
    """One training step through get_forward_backward_func(); returns losses, grads, traffic, backwards."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad(set_to_none=True)
    model.config.pipeline_backward_early_stop = early_stop
    for key in counts:
        counts[key] = 0
    backwards[0] = 0
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=_batches(7), model=[model], num_microbatches=MICROBATCHES,
        seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [float(x["loss"]) for x in losses], grads, dict(counts), backwards[0]


def _pp_rank(rank: int, world_size: int, first_trainable: int, form: str, out_dir: str) -> None:
    from dsv4flash.patching import twins
    from tests.mcore_cpu import parallel

    twin = twins.discover().get(PATCH_ID)
    if form == "runtime":
        assert twin.apply().active, "the runtime twin did not apply in the rank"
    else:
        assert not twin.applied and twin.upstream_has_it(), "the rank does not run the patched copy"
    with parallel.model_parallel(pp=world_size, rank=rank, world_size=world_size, seed=3):
        model = _gpt_stage(world_size, rank)
        for name, param in model.named_parameters():
            param.requires_grad_(rank >= first_trainable and any(t in name for t in TRAINABLE))
        backwards = models.count_layer_backwards(model)
        counts = _count_gradient_traffic(rank)
        stock_losses, stock_grads, stock_traffic, stock_backwards = _step(model, False, counts, backwards)
        losses, grads, traffic, early_backwards = _step(model, True, counts, backwards)

    assert losses == stock_losses
    assert grads.keys() == stock_grads.keys() and all(torch.equal(grads[n], stock_grads[n]) for n in grads)
    assert bool(grads) == (rank >= first_trainable)
    assert stock_traffic["grads_sent"] == (MICROBATCHES if rank > 0 else 0)
    assert traffic["grads_sent"] == (MICROBATCHES if rank > first_trainable else 0)
    assert traffic["grads_received"] == (MICROBATCHES if first_trainable <= rank < world_size - 1 else 0)
    assert {k: traffic[k] for k in ("acts_sent", "acts_received")} == {
        k: stock_traffic[k] for k in ("acts_sent", "acts_received")}
    if rank < first_trainable:
        assert early_backwards == 0 and stock_backwards == (0 if rank == 0 else len(model.decoder.layers) * MICROBATCHES)
    else:
        assert early_backwards == stock_backwards
    result = {"losses": losses, "traffic": traffic, "stock_traffic": stock_traffic,
              "backwards": [stock_backwards, early_backwards],
              "grad_sums": {n: g.double().sum().item() for n, g in sorted(grads.items())}}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_stock_release_lacks_the_option():
    import dataclasses

    from megatron.core.model_parallel_config import ModelParallelConfig

    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-core {twin.installed_version()} already has {PATCH_ID}")
        assert "pipeline_backward_early_stop" not in {f.name for f in dataclasses.fields(ModelParallelConfig)}


@pytest.mark.slow
@pytest.mark.parametrize("world_size, first_trainable", [(2, 1), (3, 2)])
def test_early_stop_skips_frozen_stages_with_identical_grads(patch_form, tmp_path, world_size, first_trainable):
    mcore_parallel.spawn_gloo(_pp_rank, world_size, first_trainable, patch_form.name, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    patch_form.record("traffic", [r["traffic"] for r in ranks])
    patch_form.record("backwards", [r["backwards"] for r in ranks])
    patch_form.record("losses", ranks[-1]["losses"], atol=1e-6)
    patch_form.record("grad_sums", [r["grad_sums"] for r in ranks], atol=1e-6, rtol=1e-6)


class _Chunk(torch.nn.Module):
    """A model chunk that only carries a config (enough for the schedule to read the option)."""

    def __init__(self, config):
        super().__init__()
        self.config = config


def test_interleaved_schedule_refuses_the_option(patch_form, mcore_parallel):
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=4, hidden_size=32, num_attention_heads=4, pipeline_model_parallel_size=2,
                  virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    try:
        TransformerConfig(**kwargs, pipeline_backward_early_stop=True)
    except ValueError as exc:  # the patched config refuses it when built
        assert patch_form.name == "series"
        message = str(exc)
    except TypeError:  # stock config has no such field: the runtime twin refuses it when the schedule runs
        assert patch_form.name == "runtime"
        config = TransformerConfig(**kwargs)
        config.pipeline_backward_early_stop = True
        with pytest.raises(ValueError) as info:
            schedules.forward_backward_pipelining_with_interleaving(
                forward_step_func=_forward_step, data_iterator=[iter(())] * 2, model=[_Chunk(config)] * 2,
                num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS)
        message = str(info.value)
    else:
        pytest.fail("pipeline_backward_early_stop with a virtual pipeline was accepted")
    assert "non-interleaved" in message
    patch_form.record("message", message)
