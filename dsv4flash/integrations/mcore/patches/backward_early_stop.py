"""Runtime twin of DSV41-MCORE-002: `pipeline_backward_early_stop` for megatron-core's 1F1B schedule.

Why: with frozen leading pipeline stages (a frozen vision tower + encoder before a LoRA-tuned decoder), stock
0.19.x still sends input gradients from the first trainable stage k down to stage 0, and every frozen stage in
between backpropagates through its layers only to produce them; skipping them on one side deadlocks.

How: `schedules.forward_backward_pipelining_without_interleaving` is wrapped. When the model config has
`pipeline_backward_early_stop` set (an attribute here, a `ModelParallelConfig` field in the format-patch) and
the step trains, it agrees on k with `dsv4flash.integrations.mcore.pipeline.BackwardEarlyStop` (one MIN
all-reduce over the pipeline group), runs the stock schedule with that module's `EarlyStopP2PCommunicator`
(both sides drop the gradient transfers below k) and with the received activation detached on stages <= k,
then restores the stage model. The interleaved schedule refuses the option, as the patched config does.
Everything else (default off, forward-only steps, every trainable gradient) is unchanged. The mechanism is
the one `pipeline.py` already uses through the schedule's public `p2p_communicator` argument; this twin only
adds the config switch that the upstream form has.
"""

from __future__ import annotations

import functools
from typing import Any

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

TOUCHES = (
    "megatron.core.model_parallel_config.ModelParallelConfig",
    "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate",
    "megatron.core.pipeline_parallel.schedules.forward_step",
    "megatron.core.pipeline_parallel.schedules.get_first_trainable_pipeline_stage",
    "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving",
)
OPTION = "pipeline_backward_early_stop"


def _wants_early_stop(model: Any, forward_only: bool) -> bool:
    """Whether this schedule call trains a model whose config asks for the early stop."""
    from megatron.core.utils import get_model_config

    chunk = model[0] if isinstance(model, (list, tuple)) else model
    return not forward_only and bool(getattr(get_model_config(chunk), OPTION, False))


def _early_stop_1f1b(original):
    """The non-interleaved 1F1B schedule, with the backward early stop when the config asks for it."""

    @functools.wraps(original)
    def forward_backward_pipelining_without_interleaving(*, model, forward_only: bool = False,
                                                         p2p_communicator=None, pg_collection=None, **kwargs):
        if not _wants_early_stop(model, forward_only):
            return original(model=model, forward_only=forward_only, p2p_communicator=p2p_communicator,
                            pg_collection=pg_collection, **kwargs)
        if p2p_communicator is not None or pg_collection is not None:
            raise NotImplementedError(f"{OPTION} (runtime twin DSV41-MCORE-002) drives the schedule's default "
                                      "parallel-state communicator; call it without p2p_communicator/pg_collection")
        from megatron.core.utils import get_model_config

        from dsv4flash.integrations.mcore.pipeline import BackwardEarlyStop

        chunk = model[0] if isinstance(model, (list, tuple)) else model
        plan = BackwardEarlyStop.agree(model)
        plan.attach(model)
        try:
            return original(model=model, forward_only=False, **plan.schedule_kwargs(get_model_config(chunk)),
                            **kwargs)
        finally:  # k = 0 keeps every input gradient: attach() removes the detaching wrapper again
            BackwardEarlyStop(0, plan.stage, plan.num_stages, plan.pp_group).attach(model)

    return forward_backward_pipelining_without_interleaving


def _rejects_early_stop(original):
    """The interleaved schedule, refusing the option (the patched ModelParallelConfig refuses it up front)."""

    @functools.wraps(original)
    def forward_backward_pipelining_with_interleaving(*, model, forward_only: bool = False, **kwargs):
        if _wants_early_stop(model, forward_only):
            raise ValueError(f"{OPTION} supports the non-interleaved schedule only "
                             "(virtual_pipeline_model_parallel_size must be None)")
        return original(model=model, forward_only=forward_only, **kwargs)

    return forward_backward_pipelining_with_interleaving


def upstream_has_early_stop() -> bool:
    """Probe: does the installed ModelParallelConfig accept the option and P2PCommunicator carry a stop stage?"""
    import dataclasses

    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules

    fields = {f.name for f in dataclasses.fields(ModelParallelConfig)}
    if OPTION not in fields or not hasattr(schedules, "get_first_trainable_pipeline_stage"):
        return False
    try:
        ModelParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                            pipeline_dtype=None, **{OPTION: True})
    except ValueError as exc:
        return "non-interleaved" in str(exc)
    return False


@mcore_twin(
    patch_id="DSV41-MCORE-002",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_BACKWARD_EARLY_STOP",
    tests=("tests/patches/test_mcore_backward_early_stop.py",),
    upstream_has_it=upstream_has_early_stop,
)
def install(patcher: Patcher) -> None:
    """Wrap both pipelined schedules of megatron-core with the early-stop switch."""
    from megatron.core.pipeline_parallel import schedules

    patcher.replace(schedules, "forward_backward_pipelining_without_interleaving",
                    _early_stop_1f1b(schedules.forward_backward_pipelining_without_interleaving))
    patcher.replace(schedules, "forward_backward_pipelining_with_interleaving",
                    _rejects_early_stop(schedules.forward_backward_pipelining_with_interleaving))
