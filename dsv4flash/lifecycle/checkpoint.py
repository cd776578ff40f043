"""Save and resume training through the policy record: `save_checkpoint` / `resume`.

`save_checkpoint` publishes the trainable weights as a revision and the optimizer/scheduler/RNG state
as its trainer-state blob, with the data position, in one atomic publish. `resume` loads the policy
head (or any revision) back into a freshly built model/optimizer/scheduler; the next step is then
bit-identical to the one an uninterrupted run would have taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from dsv4flash.lifecycle.errors import LifecycleError
from dsv4flash.lifecycle.fingerprint import BaseFingerprint
from dsv4flash.lifecycle.packed import PackedMoELoRA
from dsv4flash.lifecycle.revision import AdapterRevision
from dsv4flash.lifecycle.store import AdapterStore
from dsv4flash.lifecycle.trainer_state import capture_trainer_state, load_weights, restore_trainer_state, trainable_state

__all__ = ["save_checkpoint", "resume", "Resumed"]


@dataclass(frozen=True)
class Resumed:
    """Where a resumed run continues: the revision it loaded, its step and data position."""

    revision: str
    step: int
    data_position: dict[str, Any]


def _scheduler_summary(scheduler: Any) -> dict[str, Any]:
    if scheduler is None:
        return {}
    out: dict[str, Any] = {"class": type(scheduler).__name__}
    for key in ("last_epoch", "_step_count"):
        if hasattr(scheduler, key):
            out[key.lstrip("_")] = int(getattr(scheduler, key))
    if hasattr(scheduler, "get_last_lr"):
        out["last_lr"] = [float(x) for x in scheduler.get_last_lr()]
    return out


def _lora_handle(model: torch.nn.Module):
    """The `dsv4flash.lora` handle when *every* trainable parameter is a LoRA factor, else None."""
    try:
        from dsv4flash.lora import get_handle, lora_parameters  # noqa: PLC0415 - optional coupling
    except ImportError:  # pragma: no cover - the lora package ships with dsv4flash
        return None
    handle = get_handle(model)
    if handle is None:
        return None
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return handle if trainable == {id(p) for p in lora_parameters(model).values()} else None


def save_checkpoint(
    store: AdapterStore,
    policy: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    step: int,
    data_position: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor] | None = None,
    tags: Iterable[str] = (),
    parent: str | None = "head",
    scheduler_position: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> AdapterRevision:
    """Publish weights + trainer state as the policy's new head revision (atomic).

    A model adapted with `dsv4flash.lora` is saved as a packed MoE LoRA revision under the canonical
    adapter keys (servable and exportable as-is); any other module as its trainable parameters.
    `parent`, `tags` and `extra` (manifest fields) go to `AdapterStore.publish`; `scheduler_position`
    replaces the summary read from `scheduler` (for a trainer that schedules its learning rate itself).
    """
    blob = capture_trainer_state(optimizer, scheduler, extra={"step": int(step)})
    if weights is not None:
        payload = dict(weights)
    elif (handle := _lora_handle(model)) is not None:
        from dsv4flash.lora import lora_state_dict  # noqa: PLC0415

        payload = PackedMoELoRA.from_packed_tensors(lora_state_dict(model), alpha=float(handle.config.alpha), source=policy)
    else:
        payload = trainable_state(model)
    return store.publish(
        policy,
        payload,
        step=step,
        trainer_state=blob,
        scheduler=dict(scheduler_position) if scheduler_position is not None else _scheduler_summary(scheduler),
        data_position=dict(data_position),
        tags=tags,
        parent=parent,
        extra=extra,
    )


def resume(
    store: AdapterStore,
    policy: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    ref: str | None = None,
    resident_base: BaseFingerprint | None = None,
) -> Resumed | None:
    """Restore model/optimizer/scheduler/RNGs from the policy head (or `ref`); `None` if nothing saved yet."""
    record = store.policy(policy)
    if ref is None and record.head is None:
        return None
    rev = store.resolve(ref or f"{policy}:head")
    loaded = store.load(rev.id, resident_base=resident_base or record.base)
    state, blob = store.trainer_state(policy, rev.id)
    if state is None or blob is None:
        raise LifecycleError(f"revision {rev.id[:12]} of {policy!r} has no trainer state; it was published for serving only")
    if loaded.manifest.format == "packed_moe_lora/1" and _lora_handle(model) is not None:
        from dsv4flash.lora import load_lora_state_dict  # noqa: PLC0415

        load_lora_state_dict(model, loaded.tensors, strict=True, source=f"revision {rev.id[:12]}")
    else:
        load_weights(model, loaded.tensors, source=f"revision {rev.id[:12]}")
    restore_trainer_state(blob, optimizer, scheduler)
    return Resumed(rev.id, int(state.step if state.step is not None else 0), dict(state.data_position))
