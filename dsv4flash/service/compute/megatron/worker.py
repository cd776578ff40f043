"""The Ray worker of the Megatron trainer group: veRL's `TinkerActorRolloutRefWorker` with per-policy slots.

veRL 0.9.1's Tinker worker gives split training primitives on its Megatron engine (`forward_backward`,
`optimizer_step`, `optimizer_zero_grad`). This subclass keeps them and adds what a multi-tenant service needs:
each rank holds one slot per policy (`slots.SlotStore`) and every call names the policy it is for; the
engine's model (the base once, LoRA modules at the group's maximum rank, built by veRL from the project's
registered Megatron-Bridge bridge) and its optimizer are shared by all of them. The driver
(`group.MegatronGroup`) calls `activate` before a policy's call and `commit_*` after it, so the slot is the
policy's last acknowledged state. Imported only by the driver's Ray calls and inside the workers (it imports
veRL at module level).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.workers.engine_workers_tinker import TinkerActorRolloutRefWorker

from dsv4flash.service.compute.megatron.batch import batch_loss
from dsv4flash.service.compute.megatron.mapping import probe_values
from dsv4flash.service.compute.megatron.slots import SlotStore, scaling_modules


class TrainerFault(RuntimeError):
    """A call a worker refused (non-finite values, a missing slot); the message says which and why."""


class TinkerPolicyWorker(TinkerActorRolloutRefWorker):
    """veRL's Tinker worker (role `actor`) training many policies' adapters on one resident Megatron model."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """Build veRL's Megatron engine (the base through the bridge, LoRA at the shell's rank), then the slots
        -> this rank's adapter parameters [(name, shape)] in slot order."""
        super().init_model()
        self.actor.set_loss_fn(batch_loss)
        engine = self.actor.engine
        params, scalers = [], []
        for index, chunk in enumerate(engine.module):
            named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
            params += [(f"{index}:{n}", p) for n, p in named]
            scalers += scaling_modules(chunk, [n for n, _ in named])
        self.slots = SlotStore(params, scalers, engine.optimizer, pin=torch.cuda.is_available())
        self._initial = self.slots._flat(self.slots.params)  # Megatron-Bridge's own init, restored after probing
        return [(n, tuple(p.shape)) for n, p in params]

    # ---- the adapter map (group.py derives it from these exports) ----
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe_export(self, offsets: list[int], bits: int, digit: int):
        """Fill this rank's adapter with digit `digit` of its probe codes, export it through the bridge and
        return the canonical tensors' codes (sorted keys, shapes, one flat int64 tensor)."""
        from dsv4flash.lora.layouts import from_layout

        values = probe_values(self.slots.numels, offsets[self.rank], bits, digit)
        with torch.no_grad():
            for p, v in zip(self.slots.params, values):
                p.copy_(v.view(p.shape).to(p.dtype))
        engine = self.actor.engine
        exported = {name: t.detach().to("cpu", torch.float64) for name, t in
                    engine.bridge.export_adapter_weights(engine.module, cpu=True, show_progress=False)}
        canonical = from_layout({k.removeprefix("base_model.model."): v for k, v in exported.items()}, "megatron",
                                rank=self._rank_of(exported), source="Megatron adapter export")
        keys = sorted(canonical)
        codes = torch.cat([canonical[k].reshape(-1) for k in keys])
        if not torch.equal(codes, codes.round()) or bool((codes < 0).any()):
            raise TrainerFault("adapter export: an exported value is not a probe digit (the export is not a copy)")
        with torch.no_grad():
            for p, v in zip(self.slots.params, self.slots._pieces(self._initial)):
                p.copy_(v)
        return keys, [tuple(canonical[k].shape) for k in keys], codes.to(torch.int64)

    def _rank_of(self, exported) -> int:
        """The shell's LoRA rank: the rank dimension of any exported A factor."""
        key = next(k for k in exported if k.endswith("lora_A.weight") and ".wo_a." not in k)
        return int(exported[key].shape[-2])

    # ---- slots ----
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def create_policy(self, policy: str, value: torch.Tensor, scale: float) -> None:
        """A new slot on this rank (its flat adapter values) with fresh moments."""
        self.slots.create(policy, value, scale)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def restore_policy(self, policy: str, state: dict) -> None:
        """A slot as the driver last acknowledged it (after a restart, or a checkpoint load)."""
        self.slots.restore(policy, state)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drop_policy(self, policy: str) -> None:
        """Forget a policy."""
        self.slots.drop(policy)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def activate(self, policy: str) -> dict:
        """Swap the policy in -> {bytes, seconds} of the swap (0 when it was live)."""
        t0 = time.perf_counter()
        moved = self.slots.activate(policy)
        return {"bytes": moved, "seconds": time.perf_counter() - t0 if moved else 0.0}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def policy_state(self, policy: str) -> dict:
        """The policy's slot as plain tensors (values, moments, pending gradients, step, scale)."""
        return self.slots.slot(policy).as_state()

    # ---- compute ----
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def policy_forward_backward(self, data):
        """veRL's Tinker forward_backward on the live policy (gradients accumulate until `optim_step`)."""
        return self.actor.forward_backward(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def policy_forward(self, data):
        """Log-probs of the live policy without gradients (veRL's `infer_batch`, no loss)."""
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(data, compute_loss=False)
        return self.actor.infer_batch(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def commit_grads(self, policy: str) -> dict | None:
        """Keep the live gradients as the policy's, or undo the call if any rank's are not finite -> the slot
        (the driver's copy for restarts) on every rank."""
        if not self._all(self.slots.grads_finite()):
            self.slots.activate(policy, force=True)  # back to the gradients before the call
            raise TrainerFault(f"forward_backward: a gradient of policy {policy}'s adapter is not finite; refused, "
                               f"gradients and adapter unchanged")
        self.slots.commit_grads(policy)
        return self.slots.slot(policy).as_state()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def policy_optim_step(self, policy: str, params: dict, clip_grad: float) -> dict:
        """One Adam step of the live policy with the client's hyperparameters (veRL's Tinker `optimizer_step`;
        `clip_grad` 0 = no clipping) -> metrics and the new slot."""
        self.slots.activate(policy)
        engine = self.actor.engine
        for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            sub.config.clip_grad = float(clip_grad)
        metrics = self.actor.optimizer_step(optim_step_params=params)  # zeroes the gradients on exit
        if not self._all(self.slots.values_finite()):
            self.slots.activate(policy, force=True)
            raise TrainerFault(f"optim_step: the update makes policy {policy}'s adapter non-finite; refused, adapter "
                               f"and optimizer state unchanged")
        self.slots.commit_step(policy)
        return {"metrics": metrics, "state": self.slots.slot(policy).as_state()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def memory(self) -> dict:
        """Bytes of the live adapter training tensors, of every slot, and the device's peak allocation."""
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return {"live_bytes": self.slots.live_bytes(), "slot_bytes": self.slots.slot_bytes(),
                "slots": len(self.slots.slots), "device_peak_bytes": int(peak), "swap": self.slots.stats.as_dict()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        """This worker's process id (the fault tests kill one)."""
        import os

        return os.getpid()

    def _all(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank of the group."""
        flag = torch.tensor([0.0 if ok else 1.0], device=self.slots.params[0].device)
        dist.all_reduce(flag)
        return float(flag) == 0.0
