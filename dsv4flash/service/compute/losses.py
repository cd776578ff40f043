"""Tinker's built-in losses over per-token target log-probs; every loss is a sum over tokens (Tinker semantics)."""

from __future__ import annotations

import numpy as np
import torch

LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"),
               "importance_sampling": ("target_tokens", "logprobs", "advantages"),
               "ppo": ("target_tokens", "logprobs", "advantages"),
               "cispo": ("target_tokens", "logprobs", "advantages"),
               "dro": ("target_tokens", "logprobs", "advantages"),
               "gspo": ("target_tokens", "logprobs", "advantages"),
               # The sampler log-probs come from the stability records named by the datum's provenance.
               "stable_reinforce": ("target_tokens", "advantages")}
OPTIONAL_INPUTS = {"gspo": ("sequence_ratio_mask",)}
# Tinker's defaults: ppo clips the ratio to [0.8, 1.2]; cispo's clip is one-sided ([0, 4]); dro's β is 0.05.
# gspo clips the sequence ratio to GSPO's (1 − 3e-4, 1 + 4e-4); stable_reinforce caps its detached weight at 2.
CLIP_DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (1 - 3e-4, 1 + 4e-4)}
DRO_BETA = 0.05
STABLE_REINFORCE_CAP = 2.0
CONFIG_OPTIONS = {"cross_entropy": (), "importance_sampling": (),
                  "ppo": ("clip_low_threshold", "clip_high_threshold"),
                  "cispo": ("clip_low_threshold", "clip_high_threshold"),
                  "gspo": ("clip_low_threshold", "clip_high_threshold"),
                  "dro": ("beta",), "stable_reinforce": ("clip_high_threshold", "kl_coeff")}


def check_config(loss_fn: str, config: dict | None) -> None:
    """Raise naming the option when `loss_fn_config` holds one the loss does not take, or a non-number."""
    for key, value in (config or {}).items():
        if key not in CONFIG_OPTIONS.get(loss_fn, ()):
            raise ValueError(f"loss_fn_config[{key!r}]: not an option of loss_fn {loss_fn!r} "
                             f"(its options: {list(CONFIG_OPTIONS.get(loss_fn, ()))})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise ValueError(f"loss_fn_config[{key!r}]: expected a finite number, got {value!r}")


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


def check_context(data, context: int) -> None:
    """Raise naming the datum when its model input is longer than the model's `context` (in tokens)."""
    for i, d in enumerate(data):
        n = d.model_input.length
        if n > context:
            raise ValueError(f"data[{i}].model_input: {n} tokens, more than the model's context of {context} tokens")


def datum_loss(loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict | None,
               provenance=None) -> torch.Tensor:
    """logp [L] (log p of each target) -> scalar loss of one datum (`provenance`: stable_reinforce's records)."""
    config = config or {}
    if loss_fn == "cross_entropy":
        return -(logp * inputs["weights"].to(logp.dtype)).sum()
    adv = inputs["advantages"].to(logp.dtype)
    if loss_fn == "stable_reinforce":
        return stable_reinforce(logp, adv, provenance, config)
    sampler_logp = inputs["logprobs"].to(logp.dtype)
    if loss_fn == "dro":  # −Σ (log p·A − β/2·(log p − log q)²)
        beta = float(config.get("beta", DRO_BETA))
        return -(logp * adv - 0.5 * beta * (logp - sampler_logp) ** 2).sum()
    low, high = CLIP_DEFAULTS.get(loss_fn, (0.0, 0.0))
    low = float(config.get("clip_low_threshold", low))
    high = float(config.get("clip_high_threshold", high))
    if loss_fn == "gspo":
        mask = inputs.get("sequence_ratio_mask")
        # Without a mask the ratio runs over the trained tokens (nonzero advantage): Tinker's recipes pad the
        # prompt rows with logprobs 0, which must not enter it (tinker-cookbook's rl.train sends no mask).
        in_ratio = (adv != 0) if mask is None else mask != 0
        if not bool(in_ratio.any()):
            if mask is not None:
                raise ValueError("gspo: sequence_ratio_mask marks no token (the sequence ratio needs at least one)")
            return (0.0 * logp).sum()  # every advantage is 0: nothing to train
        # GSPO-token: every token carries the sequence ratio's value, but the gradient of its own log p.
        log_seq_ratio = (logp.detach() - sampler_logp)[in_ratio].mean()
        ratio = torch.exp(log_seq_ratio + logp - logp.detach())  # [L]
        return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()
    ratio = torch.exp(logp - sampler_logp)  # π_θ / π_sampler per token
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "cispo":  # the clipped ratio is a detached weight on log p: clipped tokens still get gradient
        return -(ratio.clamp(low, high).detach() * adv * logp).sum()
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()


def stable_reinforce(logp: torch.Tensor, adv: torch.Tensor, provenance, config: dict) -> torch.Tensor:
    """−Σ_sampled sg(min(π/μ, C))·A·log π + kl_coeff·Σ_sampled ½(log π − log μ)², μ the recorded sampler.

    Truncated importance-weighted REINFORCE on the sampled tokens only, against the log-probs the sampler
    recorded (never the client's copy), so off-policy or mismatched-numerics data cannot blow the weight up.
    """
    if provenance is None:
        raise ValueError("stable_reinforce needs provenance: Datum.with_provenance naming sequences sampled with "
                         "record_stability_info")
    sampled = provenance.sampled
    off = torch.nonzero((adv != 0) & ~sampled)
    if off.numel():
        raise ValueError(f"stable_reinforce: advantages position {int(off[0])} is nonzero but is not a sampled "
                         f"token (advantages must be 0 outside SampledProvenanceSpan runs)")
    cap = float(config.get("clip_high_threshold", STABLE_REINFORCE_CAP))
    kl_coeff = float(config.get("kl_coeff", 0.0))
    mu = provenance.sampler_logprobs.to(logp.dtype)
    weight = torch.exp(logp.detach() - mu).clamp(max=cap)
    pg = -(weight * adv * logp)[sampled].sum()
    return pg + kl_coeff * 0.5 * ((logp - mu) ** 2)[sampled].sum()
