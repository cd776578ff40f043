"""Tinker's built-in losses over per-token target log-probs; every loss is a sum over tokens (Tinker semantics)."""

from __future__ import annotations

import numpy as np
import torch

LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"),
               "importance_sampling": ("target_tokens", "logprobs", "advantages"),
               "ppo": ("target_tokens", "logprobs", "advantages"),
               "cispo": ("target_tokens", "logprobs", "advantages"),
               "dro": ("target_tokens", "logprobs", "advantages")}
# Tinker's defaults: ppo clips the ratio to [0.8, 1.2]; cispo's clip is one-sided ([0, 4]); dro's β is 0.05.
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
DRO_BETA = 0.05


def check_inputs(loss_fn: str, index: int, inputs: dict) -> None:
    """Raise naming the datum and key when a loss input is missing."""
    if loss_fn not in LOSS_INPUTS:
        raise ValueError(f"loss_fn must be one of {sorted(LOSS_INPUTS)}, got {loss_fn!r}")
    missing = [k for k in LOSS_INPUTS[loss_fn] if k not in inputs]
    if missing:
        raise KeyError(f"datum {index}: loss_fn {loss_fn!r} needs loss_fn_inputs {list(LOSS_INPUTS[loss_fn])}, "
                       f"missing {missing}")


def check_datum(index: int, datum, vocab_size: int, keys=None) -> None:
    """Raise naming the datum, key and position when tokens, targets or per-token inputs are malformed.

    Every loss input is one value per target token: a 1-D tensor as long as the model input (a 2-D
    `target_tokens` is refused, not flattened), float inputs finite, token ids inside the vocabulary.
    """
    from dsv4flash.service.types import check_token_ids

    tokens = datum.model_input.to_ints()
    check_token_ids(tokens, vocab_size, f"datum {index}: model_input")
    for key in (keys if keys is not None else datum.loss_fn_inputs):
        value = datum.loss_fn_inputs[key].to_numpy()
        if value.ndim != 1 or value.shape[0] != len(tokens):
            raise ValueError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(value.shape)}, expected "
                             f"[{len(tokens)}] (one value per model_input token)")
        if key == "target_tokens":
            check_token_ids(value.tolist(), vocab_size, f"datum {index}: target_tokens")
        elif value.dtype.kind == "f" and not np.isfinite(value).all():
            position = int(np.flatnonzero(~np.isfinite(value))[0])
            raise ValueError(f"datum {index}: loss_fn_inputs[{key!r}] position {position} is {value[position]}, "
                             f"expected a finite number")


def datum_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict | None) -> torch.Tensor:
    """logp [L] (log p of each target) -> scalar loss of one datum."""
    config = config or {}
    if loss_fn == "cross_entropy":
        return -(logp * inputs["weights"].to(logp.dtype)).sum()
    sampler_logp = inputs["logprobs"].to(logp.dtype)
    adv = inputs["advantages"].to(logp.dtype)
    if loss_fn == "dro":  # −Σ (log p·A − β/2·(log p − log q)²)
        beta = float(config.get("beta", DRO_BETA))
        return -(logp * adv - 0.5 * beta * (logp - sampler_logp) ** 2).sum()
    ratio = torch.exp(logp - sampler_logp)  # π_θ / π_sampler per token
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    low, high = CLIP_DEFAULTS[loss_fn]
    low = float(config.get("clip_low_threshold", low))
    high = float(config.get("clip_high_threshold", high))
    if loss_fn == "cispo":  # the clipped ratio is a detached weight on log p: clipped tokens still get gradient
        return -(ratio.clamp(low, high).detach() * adv * logp).sum()
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()
