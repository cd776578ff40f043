"""Pipeline backward early stop for megatron-core's 1F1B schedule (no patch: the schedule's own extension points).

With a frozen vision tower + encoder and decoder-only LoRA, no stage before some stage k has anything to train,
yet stock 0.19 still ships input gradients from stage k down to stage 0 and every stage in between backprops
through its frozen layers just to produce them. Skipping on one side deadlocks: `send_backward(None)` sends
nothing while the neighbour still posts its receive (docs/upstream.md §1.5).

`BackwardEarlyStop` makes the skip symmetric:

1. **Agreement.** `BackwardEarlyStop.agree(model)` all-reduces (MIN over the pipeline group) the first stage
   that owns a trainable parameter (or a trainable host Engram table), so every stage derives the same k.
2. **Communication.** `EarlyStopP2PCommunicator`, passed to the schedule through its public `p2p_communicator`
   argument, drops every backward transfer across the boundaries below stage k on *both* sides: stages <= k
   never send a gradient upstream, stages < k never post a gradient receive.
3. **Compute.** `attach(model)` makes the stage model see its received activation detached on stages <= k
   (through the model's `set_input_tensor`, the schedule's hand-off point). A frozen stage's output then has no
   grad, so `backward_step` skips it (its stock "no grad, no backward" branch); stage k computes its weight
   gradients but no gradient for its input.

Gradients of every trainable parameter are unchanged (they never depend on the dropped input gradients).
Only the non-interleaved 1F1B schedule is supported (`forward_backward_pipelining_without_interleaving`).
Re-run `agree` (a collective) whenever `requires_grad` changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model

__all__ = ["BackwardEarlyStop", "EarlyStopP2PCommunicator", "P2PStats", "stage_is_trainable"]

_SCHEDULE_GROUPS = ["tp", "cp", "embd", "pos_embd", "pp", "dp_cp", "tp_dp_cp", "dp"]  # what 1F1B reads


def stage_is_trainable(modules: Sequence[torch.nn.Module]) -> bool:
    """Whether any parameter requires grad, or any host Engram table (not a parameter) is trainable."""
    for module in modules:
        if any(p.requires_grad for p in module.parameters()):
            return True
        for sub in module.modules():
            table = getattr(sub, "table", None)
            if getattr(table, "trainable", False):
                return True
    return False


@dataclass
class P2PStats:
    """Traffic of one communicator: tensors and bytes exchanged, and transfers skipped by agreement."""

    grads_sent: int = 0
    grads_received: int = 0
    sends_skipped: int = 0
    receives_skipped: int = 0
    forward_sent: int = 0
    forward_received: int = 0
    grad_bytes_sent: int = 0  # bytes of the gradient tensors this stage sent upstream
    forward_bytes_sent: int = 0


class EarlyStopP2PCommunicator(P2PCommunicator):
    """P2P communicator that omits every gradient transfer below the agreed first trainable stage, both ways."""

    def __init__(self, pp_group: dist.ProcessGroup, config: Any, first_trainable_stage: int) -> None:
        super().__init__(pp_group=pp_group, config=config)
        if self.virtual_pipeline_model_parallel_size is not None:
            raise NotImplementedError("BackwardEarlyStop supports the non-interleaved 1F1B schedule only "
                                      "(virtual_pipeline_model_parallel_size must be None)")
        self.first_trainable_stage = first_trainable_stage
        self.stats = P2PStats()

    def _communicate(self, *, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: Optional[torch.Tensor],
                     recv_prev: bool, recv_next: bool, tensor_shape: Any, wait_on_reqs: bool = True):
        """Stock exchange minus the gradient transfers both neighbours agreed to omit."""
        stage, k = self.current_stage, self.first_trainable_stage
        if tensor_send_prev is not None and stage <= k:  # stage k-1 and below never train: nobody consumes it
            tensor_send_prev = None
            self.stats.sends_skipped += 1
        if recv_next and stage < k:  # the next stage (<= k) sends no gradient: do not wait for one
            recv_next = False
            self.stats.receives_skipped += 1
        self.stats.grads_sent += tensor_send_prev is not None
        self.stats.grads_received += bool(recv_next)
        self.stats.forward_sent += tensor_send_next is not None
        if tensor_send_prev is not None:
            self.stats.grad_bytes_sent += tensor_send_prev.numel() * tensor_send_prev.element_size()
        if tensor_send_next is not None:
            self.stats.forward_bytes_sent += tensor_send_next.numel() * tensor_send_next.element_size()
        self.stats.forward_received += bool(recv_prev)
        if tensor_send_next is None and tensor_send_prev is None and not recv_prev and not recv_next:
            batched = self.config.use_ring_exchange_p2p or self.config.batch_p2p_comm
            return None, None, (None if wait_on_reqs else ([] if batched else {}))
        return super()._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                                    recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                                    wait_on_reqs=wait_on_reqs)


@dataclass
class BackwardEarlyStop:
    """The agreed first trainable stage k of a pipeline and what this stage does about it."""

    first_trainable_stage: int
    stage: int
    num_stages: int
    pp_group: Any = field(repr=False, default=None)

    @classmethod
    def agree(cls, model: Any, pp_group: Any = None) -> "BackwardEarlyStop":
        """Collective over the pipeline group: k = first stage with anything trainable (num_stages if none)."""
        pp_group = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
        chunks = model if isinstance(model, (list, tuple)) else [model]
        if len(chunks) != 1:
            raise NotImplementedError("BackwardEarlyStop supports one model chunk per stage (non-interleaved 1F1B)")
        stage, num_stages = pp_group.rank(), pp_group.size()
        mine = torch.tensor([stage if stage_is_trainable(chunks) else num_stages], dtype=torch.int64,
                            device=_collective_device(pp_group))
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=pp_group)
        return cls(int(mine.item()), stage, num_stages, pp_group)

    @property
    def skips_backward(self) -> bool:
        """This stage runs no backward at all (nothing here or upstream trains)."""
        return self.stage < self.first_trainable_stage

    @property
    def sends_input_grad(self) -> bool:
        """This stage computes and sends the gradient of its input activation."""
        return self.stage > self.first_trainable_stage

    def communicator(self, config: Any) -> EarlyStopP2PCommunicator:
        """The p2p communicator that applies this agreement (pass it to the schedule)."""
        return EarlyStopP2PCommunicator(self.pp_group, config, self.first_trainable_stage)

    def schedule_kwargs(self, config: Any) -> dict[str, Any]:
        """`p2p_communicator` + the matching `pg_collection` for `forward_backward_pipelining_without_interleaving`."""
        return {"p2p_communicator": self.communicator(config),
                "pg_collection": ProcessGroupCollection.use_mpu_process_groups(_SCHEDULE_GROUPS)}

    def attach(self, model: Any) -> None:
        """Detach the received activation on stages <= k, where its gradient is never needed (idempotent)."""
        chunk = model[0] if isinstance(model, (list, tuple)) else model
        owner = get_attr_wrapped_model(chunk, "set_input_tensor", return_model_obj=True)
        current = owner.__dict__.get("set_input_tensor")
        original = getattr(current, "__wrapped__", None) or getattr(owner, "set_input_tensor")
        if self.stage == 0 or self.sends_input_grad:
            if current is not None:
                owner.__dict__.pop("set_input_tensor")  # a previous agreement's wrapper
            return

        @functools.wraps(original)
        def set_input_tensor(input_tensor):
            return original(_detached(input_tensor))

        owner.set_input_tensor = set_input_tensor


def _detached(value: Any) -> Any:
    """The activation(s) as the stage model should see them: same values, no path back to the sender."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _collective_device(group: Any) -> torch.device:
    """CPU for gloo groups, the current CUDA device otherwise (NCCL takes device tensors only)."""
    if dist.get_backend(group) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
