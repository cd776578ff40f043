"""Record and replay expert choices on the reference model's `Gate` — the replay semantics engines must match.

Replaying a row means: take the recorded top-k expert ids instead of the top-k of `scores + bias`, and weight
them with the *current* unbiased scores (normalised, times the route scale), exactly as the gate weights its
own choice. Rows outside the replay mask route natively, with `bias_vl` on image rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from dsv4flash.model.moe import Gate


def _gates(model: nn.Module) -> list[Gate]:
    """Backbone routers in layer order (DSpark draft blocks excluded: they are never replayed)."""
    gates = [m for name, m in model.named_modules() if isinstance(m, Gate) and not name.startswith("mtp.")]
    if not gates:
        raise ValueError("the model has no MoE Gate to record or replay")
    return gates


def gate_weights(gate: Gate, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Route weights of chosen experts `idx` [T, k] from the gate's unbiased scores (fp32) -> [T, k]."""
    weights = gate.scores(x).gather(-1, idx)
    if gate.normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * gate.route_scale


@contextlib.contextmanager
def record_routes(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block every gate appends its chosen ids; yields the list, one [T, k] tensor per MoE layer."""
    records: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda _m, _a, out: records.append(out[1].detach().clone()))
             for g in _gates(model)]
    try:
        yield records
    finally:
        for h in hooks:
            h.remove()


@dataclass
class ReplayTrace:
    """Per MoE layer: the ids each gate used (`used`) and the ids it would have chosen itself (`native`), [T, k]."""

    used: list[torch.Tensor] = field(default_factory=list)
    native: list[torch.Tensor] = field(default_factory=list)


@contextlib.contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor, replay_mask: torch.Tensor) -> Iterator[ReplayTrace]:
    """Inside the block gate l replays `routes[:, l]` ([T, L, k], T = B·S flattened) on rows where `replay_mask` [T].

    Yields a `ReplayTrace`, filled during the forward.
    """
    gates = _gates(model)
    if routes.dim() != 3 or routes.shape[1] != len(gates):
        raise ValueError(f"replay_routes: routes must be [tokens, layers={len(gates)}, topk], got {list(routes.shape)}")
    if replay_mask.shape != routes.shape[:1]:
        raise ValueError(f"replay_routes: replay_mask {list(replay_mask.shape)} must be [tokens={routes.shape[0]}]")
    trace = ReplayTrace()

    def replaying(gate: Gate, layer: int):
        native_forward = gate.forward

        def forward(x: torch.Tensor, image_mask: torch.Tensor | None = None):
            _, native = native_forward(x, image_mask)
            if native.shape != routes[:, layer].shape:
                raise ValueError(f"replay_routes: layer {layer} routed {list(native.shape)} ids, the recording "
                                 f"holds {list(routes[:, layer].shape)}")
            idx = torch.where(replay_mask.unsqueeze(-1).to(native.device), routes[:, layer].to(native), native)
            trace.used.append(idx)
            trace.native.append(native)
            return gate_weights(gate, x, idx), idx
        return forward

    for layer, gate in enumerate(gates):
        gate.forward = replaying(gate, layer)
    try:
        yield trace
    finally:
        for gate in gates:
            del gate.forward
