"""Per-policy slots of one Megatron rank: many policies' adapters trained by one resident model and optimizer.

The rank's model holds the base once and LoRA modules at the group's maximum rank; its optimizer holds one set
of Adam moments for them. A slot is one policy's copy of everything that differs between policies, kept in host
memory (pinned when the model is on a GPU): the adapter values (the fp32 main values), Adam's two moments and
step count, the gradients accumulated since its last `optim_step`, and the policy's LoRA scaling alpha / rank.
`activate` copies a slot onto the live tensors (nothing when the policy is already live) and sets every adapter
module's scaling; `commit` copies what a call changed back, so the slot always holds the policy's last
acknowledged state and a failed call is undone by activating it again. Device memory is one policy's, however
many slots there are; every copy is counted (bytes, seconds) for the server's metrics.

Nothing here imports Megatron or veRL: the live tensors are found through duck-typed attributes (`main_grad`
of Megatron's DDP, the optimizer's `chained_optimizers` / `float16_groups`, an adapter module's `alpha` and
`dim` or `rank`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Slot:
    """One policy's state on this rank (flat fp32 host tensors, parameters in the rank's order)."""

    value: torch.Tensor
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    step: int = 0
    scale: float = 1.0  # the policy's alpha / rank

    def nbytes(self) -> int:
        """Host bytes of the slot."""
        return sum(t.numel() * t.element_size() for t in (self.value, self.exp_avg, self.exp_avg_sq, self.grad)
                   if t is not None)

    def as_state(self) -> dict:
        """The slot as plain tensors (what the driver keeps to restore the policy after a restart)."""
        return {"value": self.value.clone(), "exp_avg": _maybe_clone(self.exp_avg),
                "exp_avg_sq": _maybe_clone(self.exp_avg_sq), "grad": _maybe_clone(self.grad), "step": self.step,
                "scale": self.scale}


@dataclass
class SwapStats:
    """Copies between the slots (host) and the live tensors, in bytes and seconds."""

    swaps: int = 0
    swap_in_bytes: int = 0
    swap_in_s: float = 0.0
    commit_bytes: int = 0
    commit_s: float = 0.0
    per_call: list = field(default_factory=list)

    def as_dict(self) -> dict:
        """Counters as plain numbers."""
        return {"swaps": self.swaps, "swap_in_bytes": self.swap_in_bytes, "swap_in_s": self.swap_in_s,
                "commit_bytes": self.commit_bytes, "commit_s": self.commit_s}


def _maybe_clone(t):
    return None if t is None else t.clone()


def optimizer_entries(optimizer) -> dict[int, tuple[torch.Tensor, torch.optim.Optimizer]]:
    """id(model parameter) -> (the fp32 main parameter the optimizer steps, its torch optimizer), for Megatron's
    FP32Optimizer (the parameter itself) and Float16OptimizerWithFloat16Params (its fp32 copy)."""
    out = {}
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        if hasattr(sub, "float16_groups"):
            for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for p, main in zip(model_group, main_group):
                    out[id(p)] = (main, inner)
            for group in sub.fp32_from_fp32_groups:
                for p in group:
                    out[id(p)] = (p, inner)
        else:
            for group in inner.param_groups:
                for p in group["params"]:
                    out[id(p)] = (p, inner)
    return out


def scaling_modules(model: nn.Module, names: list[str]) -> list[tuple[nn.Module, str]]:
    """(adapter module, its rank attribute) for each distinct adapter owning one of the named parameters: the
    nearest enclosing module with an `alpha` and a `dim` (Megatron-Bridge) or `rank` (grouped) attribute."""
    found: dict[int, tuple[nn.Module, str]] = {}
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = model.get_submodule(".".join(parts[:cut]))
            attr = "dim" if hasattr(module, "dim") and not callable(module.dim) else "rank"
            if hasattr(module, "alpha") and isinstance(getattr(module, attr, None), int):
                found.setdefault(id(module), (module, attr))
                break
        else:
            raise RuntimeError(f"adapter parameter {name}: no enclosing module carries its LoRA scaling (alpha)")
    return list(found.values())


def alpha_for(scale: float, rank: int) -> float:
    """The `alpha` that makes a rank-`rank` module's alpha / rank exactly `scale` (in float arithmetic)."""
    alpha = scale * rank
    for _ in range(8):
        got = alpha / rank
        if got == scale:
            return alpha
        alpha = math.nextafter(alpha, math.inf if got < scale else -math.inf)
    raise ValueError(f"no alpha gives a rank-{rank} LoRA module the scaling {scale!r} exactly")


class SlotStore:
    """The slots of one rank over its live adapter parameters and optimizer."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], scalers: list[tuple[nn.Module, str]], optimizer, *,
                 pin: bool) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.numels = [p.numel() for p in self.params]
        entries = optimizer_entries(optimizer)
        missing = [n for n, p in params if id(p) not in entries]
        if missing:
            raise RuntimeError(f"adapter parameters the optimizer does not step: {missing[:3]}")
        self.mains = [entries[id(p)][0] for p in self.params]
        self.optimizers = [entries[id(p)][1] for p in self.params]
        self.scalers = scalers
        self.pin = pin
        self.slots: dict[str, Slot] = {}
        self.active: str | None = None
        self.stats = SwapStats()

    # ---- flat views ----
    def numel(self) -> int:
        """Adapter elements on this rank."""
        return sum(self.numels)

    def _flat(self, tensors) -> torch.Tensor:
        out = torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
        return out.pin_memory() if self.pin else out

    def _pieces(self, flat: torch.Tensor):
        start = 0
        for shape, n in zip(self.shapes, self.numels):
            yield flat[start:start + n].view(shape)
            start += n

    def _grads(self) -> list[torch.Tensor]:
        return [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                for p in self.params]

    # ---- slots ----
    def create(self, policy: str, value: torch.Tensor, scale: float) -> None:
        """A new slot: these adapter values (flat, fp32), fresh moments, step 0, no gradients."""
        if value.numel() != self.numel():
            raise ValueError(f"policy {policy}: {value.numel()} adapter values for {self.numel()} on this rank")
        flat = value.to(torch.float32).clone()
        self.slots[policy] = Slot(flat.pin_memory() if self.pin else flat, scale=float(scale))
        if self.active == policy:
            self.active = None  # replaced: copy it in again

    def restore(self, policy: str, state: dict) -> None:
        """A slot from `Slot.as_state` (after the group restarted)."""
        def host(t):
            return None if t is None else (t.pin_memory() if self.pin else t.clone())

        self.slots[policy] = Slot(host(state["value"]), host(state["exp_avg"]), host(state["exp_avg_sq"]),
                                  host(state["grad"]), int(state["step"]), float(state["scale"]))
        if self.active == policy:
            self.active = None

    def drop(self, policy: str) -> None:
        """Forget a policy's slot."""
        self.slots.pop(policy, None)
        if self.active == policy:
            self.active = None

    def slot(self, policy: str) -> Slot:
        """The slot of a policy (KeyError naming it)."""
        try:
            return self.slots[policy]
        except KeyError:
            raise KeyError(f"policy {policy} has no slot on this trainer rank") from None

    # ---- swapping ----
    @torch.no_grad()
    def activate(self, policy: str, *, force: bool = False) -> int:
        """Make `policy` the live adapter (its values, moments, step, gradients and scaling) -> bytes copied."""
        slot = self.slot(policy)
        if self.active == policy and not force:
            return 0
        t0 = time.perf_counter()
        moved = slot.nbytes()
        for i, (value, p, main) in enumerate(zip(self._pieces(slot.value), self.params, self.mains)):
            main.copy_(value, non_blocking=True)
            if main is not p:
                p.copy_(value, non_blocking=True)
            opt = self.optimizers[i]
            if slot.exp_avg is None:
                opt.state.pop(main, None)  # fresh moments: Adam starts them at its next step
        if slot.exp_avg is not None:
            for main, opt, m, v in zip(self.mains, self.optimizers, self._pieces(slot.exp_avg),
                                       self._pieces(slot.exp_avg_sq)):
                st = opt.state.get(main)
                if st and "exp_avg" in st:
                    st["exp_avg"].copy_(m, non_blocking=True)
                    st["exp_avg_sq"].copy_(v, non_blocking=True)
                    st["step"].fill_(float(slot.step))
                else:
                    opt.state[main] = {"step": torch.tensor(float(slot.step)),
                                       "exp_avg": m.to(main.device, copy=True),
                                       "exp_avg_sq": v.to(main.device, copy=True)}
        for grad, (p, live) in zip(self._pieces(slot.grad) if slot.grad is not None else [None] * len(self.params),
                                   zip(self.params, self._grads())):
            if live is None:
                continue
            if grad is None:
                live.zero_()
            else:
                live.copy_(grad, non_blocking=True)
        for module, attr in self.scalers:
            module.alpha = alpha_for(slot.scale, int(getattr(module, attr)))
            if isinstance(getattr(module, "scale", None), float):
                module.scale = module.alpha / int(getattr(module, attr))
        if self.params and self.params[0].is_cuda:
            torch.cuda.synchronize()
        self.active = policy
        self.stats.swaps += 1
        self.stats.swap_in_bytes += moved
        self.stats.swap_in_s += time.perf_counter() - t0
        return moved

    @torch.no_grad()
    def commit_grads(self, policy: str) -> None:
        """After a forward_backward: the live gradients become the slot's."""
        self._require_active(policy)
        t0 = time.perf_counter()
        slot = self.slots[policy]
        slot.grad = self._flat(g if g is not None else torch.zeros(s) for g, s in zip(self._grads(), self.shapes))
        self._count(slot.grad.numel() * 4, t0)

    @torch.no_grad()
    def commit_step(self, policy: str) -> None:
        """After an optimizer step: values, moments and step count become the slot's; no gradients are pending."""
        self._require_active(policy)
        t0 = time.perf_counter()
        slot = self.slots[policy]
        slot.value = self._flat(self.mains)
        states = [opt.state[main] for main, opt in zip(self.mains, self.optimizers)]
        slot.exp_avg = self._flat(st["exp_avg"] for st in states)
        slot.exp_avg_sq = self._flat(st["exp_avg_sq"] for st in states)
        steps = {int(st["step"]) for st in states}
        if len(steps) != 1:
            raise RuntimeError(f"policy {policy}: the adapter's parameters are at different Adam steps {sorted(steps)}")
        slot.step = steps.pop()
        slot.grad = None
        self._count(3 * slot.value.numel() * 4, t0)

    def grads_finite(self) -> bool:
        """Whether every live gradient is finite."""
        return all(g is None or bool(torch.isfinite(g).all()) for g in self._grads())

    def values_finite(self) -> bool:
        """Whether every live adapter value is finite."""
        return all(bool(torch.isfinite(m).all()) for m in self.mains)

    def live_bytes(self) -> int:
        """Bytes of the live training tensors of the adapter: values (and fp32 mains), gradients, Adam moments —
        one policy's, however many slots there are."""
        seen, total = set(), 0
        tensors = list(self.params) + list(self.mains) + [g for g in self._grads() if g is not None]
        for main, opt in zip(self.mains, self.optimizers):
            tensors += [t for t in opt.state.get(main, {}).values() if isinstance(t, torch.Tensor)]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    def slot_bytes(self) -> int:
        """Host bytes of every slot."""
        return sum(s.nbytes() for s in self.slots.values())

    def _require_active(self, policy: str) -> None:
        if self.active != policy:
            raise RuntimeError(f"policy {policy} is not the live adapter ({self.active} is)")

    def _count(self, nbytes: int, t0: float) -> None:
        self.stats.commit_bytes += nbytes
        self.stats.commit_s += time.perf_counter() - t0
