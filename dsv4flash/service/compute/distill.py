"""Reverse-KL distillation onto a training run (MinT's `forward_backward_reverse_kl`).

For each datum, the student (the run's live adapter) reads `student_input` and a frozen reference (a saved
checkpoint on the same resident base) reads `reference_input`; at the last T positions of each (T = the number
of target tokens, i.e. the positions that predict them) the loss is the exact full-vocabulary reverse KL

    KL_t = Σ_v p_s(v) · (log p_s(v) − log p_r(v)),   p = softmax(logits / temperature),

weighted per token and summed (Tinker losses are sums). Gradients flow into the student only and accumulate
until the next `optim_step`, exactly like `forward_backward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4flash.service.calls import CallStopped
from dsv4flash.service.futures import APIFuture
from dsv4flash.service.types import TensorData


@dataclass
class ReverseKLDatum:
    """Student and reference token ids, the target tokens whose positions are scored, per-token weights."""

    student_input: list[int]
    reference_input: list[int]
    target_tokens: list[int]
    weights: list[float]


@dataclass
class ReverseKLOutput:
    """Per-datum weighted per-token KL, and summed metrics."""

    losses: list[TensorData]
    metrics: dict[str, float]


def forward_backward_reverse_kl(training_client, data: list[ReverseKLDatum], reference_path: str,
                                temperature: float = 1.0) -> APIFuture:
    """Queue one reverse-KL forward/backward on `training_client` (in order with its other calls)."""
    if not data:
        raise ValueError("forward_backward_reverse_kl: empty data list")
    if training_client.resource != "base":  # the student's full distribution is read off the resident base here
        raise ValueError("forward_backward_reverse_kl: runs on the local trainer only; this run trains on the Megatron "
                         "trainer group (dsv4flash serve --trainer local for MinT's reverse-KL distillation)")
    if not temperature > 0:
        raise ValueError(f"forward_backward_reverse_kl: temperature must be > 0, got {temperature}")
    context = training_client.service.base.cfg.text.max_position_embeddings
    for i, d in enumerate(data):
        t = len(d.target_tokens)
        if t == 0 or len(d.weights) != t:
            raise ValueError(f"datum {i}: {t} target_tokens and {len(d.weights)} weights (need equal, non-zero)")
        for name in ("student_input", "reference_input"):
            if len(getattr(d, name)) < t:
                raise ValueError(f"datum {i}: {name} has {len(getattr(d, name))} tokens, fewer than the {t} "
                                 f"target positions")
            if len(getattr(d, name)) > context:
                raise ValueError(f"datum {i}: {name} has {len(getattr(d, name))} tokens, more than the model's "
                                 f"context of {context} tokens")
    return training_client.run_ordered(_run, list(data), reference_path, float(temperature))


def _last_logprobs(model, ids: list[int], t: int, temperature: float) -> torch.Tensor:
    from dsv4flash.engine.device import on_device

    logits = on_device(model, model.head.weight.device)(torch.tensor([ids]))[0, -t:]  # [T,V] on the CPU
    return F.log_softmax(logits.float() / temperature, dim=-1)


def _run(tc, data: list[ReverseKLDatum], reference_path: str, temperature: float) -> ReverseKLOutput:
    service = tc.service
    ref_tensors, _, ref_placement = service._read_checkpoint(reference_path, False)
    with service.base.bind(ref_placement, ref_tensors) as ref, torch.no_grad():
        ref_lp = [_last_logprobs(ref, d.reference_input, len(d.target_tokens), temperature) for d in data]  # [T,V]
    losses, total, weight = [], 0.0, 0.0
    # each datum's backward adds into the adapter's gradients: a call stopped after some of them (cancel, deadline)
    # puts the gradients back as they were, so a stopped call changes nothing
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in tc.adapter.items()}
    try:
        with service.base.bind(tc.placement, tc.adapter) as student, torch.enable_grad():
            for d, r in zip(data, ref_lp):
                s = _last_logprobs(student, d.student_input, len(d.target_tokens), temperature)  # [T,V]
                kl = (s.exp() * (s - r)).sum(-1)  # [T]
                w = torch.tensor(d.weights, dtype=kl.dtype)
                loss = (w * kl).sum()
                loss.backward()
                losses.append(TensorData.from_torch((w * kl).detach()))
                total += float(loss.detach())
                weight += float(w.sum())
    except CallStopped:
        for k, p in tc.adapter.items():
            p.grad = grads[k]
        raise
    return ReverseKLOutput(losses, {"loss:sum": total, "reverse_kl:mean": total / weight if weight else 0.0})
