"""Losses of the local engine: token log-probs, SFT, DPO, and GRPO (group advantages, clipped policy loss,
IcePop / TIS rollout correction). Pure functions over tensors; every mask is [B,S] bool over scored tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
CORRECTION_MODES = ("none", "icepop", "tis")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B,S,V], ids [B,S] -> [B,S]: log p(ids[t] | ids[<t]) at t ≥ 1, 0 at t = 0."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B,S-1,V]
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B,S-1]
    return F.pad(picked, (1, 0))


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """[B,S] per-token losses -> scalar: mean over all tokens, or mean over rows of each row's token mean."""
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    if mode == "seq-mean-token-mean":
        m = mask.to(per_token.dtype)
        per_row = (per_token * m).sum(-1) / m.sum(-1).clamp_min(1.0)
        has = (m.sum(-1) > 0).to(per_token.dtype)
        return (per_row * has).sum() / has.sum().clamp_min(1.0)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def sft_loss(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the scored tokens."""
    return -masked_mean(logp, mask)


def sequence_logprob(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B,S] -> [B]: summed log-prob of each row's scored tokens."""
    return (logp * mask.to(logp.dtype)).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO over sequence log-probs [B] -> (loss, stats: margin, accuracy)."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    with torch.no_grad():
        stats = {"reward_margin": float(margin.mean()), "reward_accuracy": float((margin > 0).float().mean()),
                 "chosen_reward": float(chosen.mean()), "rejected_reward": float(rejected.mean())}
    return loss, stats


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """rewards [N] laid out group by group (N = groups·group_size) -> advantages [N] (GRPO).

    Each reward minus its group mean, divided by the group's (unbiased) std when `norm_by_std`; a group
    whose rewards are all equal gets zero advantage.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(-1, keepdim=True)
    if norm_by_std and group_size > 1:
        centred = centred / (grouped.std(-1, keepdim=True) + eps)
    return centred.reshape(-1)


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, mode: str = "icepop",
                       lower: float = 0.5, upper: float = 5.0, tis_cap: float = 2.0
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights [B,S] for the train/rollout mismatch k = π_train(θ_old) / π_rollout(θ_old).

    icepop: M(k) = k inside [lower, upper], 0 outside (those tokens get no gradient);
    tis: min(k, tis_cap) (truncated IS, keeps every token); none: 1.
    """
    log_k = (old_logp - rollout_logp).detach()
    k = torch.exp(log_k)
    if mode == "icepop":
        inside = (k >= lower) & (k <= upper)
        weights = torch.where(inside, k, torch.zeros_like(k))
        dropped = ~inside & mask
    elif mode == "tis":
        weights = k.clamp(max=tis_cap)
        dropped = (k > tis_cap) & mask  # clamped, not dropped: reported as the "clamped fraction"
    elif mode == "none":
        weights = torch.ones_like(k)
        dropped = torch.zeros_like(mask)
    else:
        raise ValueError(f"rollout correction mode must be one of {CORRECTION_MODES}, got {mode!r}")
    n = mask.sum().clamp_min(1)
    masked_log_k = log_k.masked_fill(~mask, float("-inf"))
    stats = {"corrected_fraction": float(dropped.sum() / n),
             "log_ratio_mean": float(masked_mean(log_k, mask)),
             "log_ratio_max": float(masked_log_k.max()) if bool(mask.any()) else 0.0,
             "log_ratio_abs_max": float((log_k.abs() * mask).max()) if bool(mask.any()) else 0.0}
    return weights * mask, stats


def policy_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, weights: torch.Tensor | None = None,
                agg: str = "token-mean") -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate: max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)), times the correction weights.

    new/old log-probs [B,S]; advantages [B] (one per sequence) or [B,S]; r = exp(new − old).
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(new_logp)
    log_ratio = new_logp - old_logp.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        stats = {"clip_fraction": float(masked_mean((clipped > unclipped).float(), mask)),
                 "approx_kl": float(masked_mean(0.5 * log_ratio.pow(2), mask))}
    return loss, stats
