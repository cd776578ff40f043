"""One optimisation step of each algorithm on the local engine: pretrain, SFT, DPO, GRPO.

A step draws its batch from the task mixture by step index (so a resumed run repeats it exactly), runs
the forward(s), and applies one or more optimizer updates; it returns flat float metrics.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from dsv4flash.engine.losses import (dpo_loss, group_advantages, policy_loss, rollout_correction, sequence_logprob,
                                     sft_loss, token_logprobs)
from dsv4flash.engine.sampling import generate
from dsv4flash.tasks.dataset import Batch, Encoder, TaskMixture

_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepContext:
    """What every algorithm step needs."""

    model: nn.Module
    train_forward: Callable  # (ids, types, images) -> logits, with autograd where it trains
    infer_forward: Callable  # same logits, for sampling / old log-probs (called under no_grad)
    encoder: Encoder
    mixture: TaskMixture
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    clip_grad: float
    batch_size: int  # training sequences per step (GRPO: prompts × group_size; DPO: 2 × pairs)
    max_new_tokens: int
    seed: int
    ref_model: nn.Module | None = None  # frozen base copy (DPO reference)


def step_seed(seed: int, step: int, what: str) -> int:
    """A 63-bit seed for (run seed, step, purpose), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{step}/{what}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def apply_update(ctx: StepContext, loss: torch.Tensor) -> float:
    """Backward, clip, step, zero grads -> the pre-clip grad norm."""
    loss.backward()
    if ctx.clip_grad > 0:
        norm = torch.nn.utils.clip_grad_norm_(ctx.params, ctx.clip_grad)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ctx.params if p.grad is not None]))
    ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return float(norm)


def _logp(forward: Callable, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    return token_logprobs(forward(batch.input_ids, batch.token_types, batch.images), batch.input_ids, temperature)


class Pretrain:
    """Next-token loss on every text token of prompt and answer (whole model trains)."""

    score_prompt = True

    def __init__(self, ctx: StepContext, cfg: Any) -> None:
        self.ctx, self.cfg = ctx, cfg

    def step(self, step: int) -> dict[str, float]:
        """One batch, one update."""
        ctx = self.ctx
        batch = ctx.encoder.batch([ex for _, ex in ctx.mixture.train_batch(step, ctx.batch_size)],
                                  score_prompt=self.score_prompt)
        loss = sft_loss(_logp(ctx.train_forward, batch), batch.target_mask)
        # `tokens`: positions of the step's batch (padding included), the engine's tokens/s; not a logged metric
        return {"loss": float(loss.detach()), "grad_norm": apply_update(ctx, loss), "tokens": batch.input_ids.numel()}


class SFT(Pretrain):
    """NLL of the reference answer only."""

    score_prompt = False


class DPO:
    """Sigmoid DPO: chosen = reference answer, rejected = the task's plausible wrong answer."""

    def __init__(self, ctx: StepContext, cfg: Any) -> None:
        if ctx.ref_model is None:
            raise ValueError("DPO needs a reference model (the frozen base)")
        self.ctx, self.cfg = ctx, cfg

    def step(self, step: int) -> dict[str, float]:
        """Chosen and rejected rows in one batch; the reference log-probs come from the frozen base."""
        ctx = self.ctx
        drawn = ctx.mixture.train_batch(step, max(ctx.batch_size // 2, 1))
        rng = ctx.mixture.step_rng(step)
        examples = [ex for _, ex in drawn]
        rejected = [ctx.mixture.tasks[name].wrong_answer(ex, rng) for name, ex in drawn]
        batch = ctx.encoder.batch(examples + examples, answers=[ex.answer for ex in examples] + rejected)
        n = len(examples)
        with torch.no_grad():
            ref = sequence_logprob(_logp(ctx.ref_model, batch), batch.target_mask)
        pol = sequence_logprob(_logp(ctx.train_forward, batch), batch.target_mask)
        loss, stats = dpo_loss(pol[:n], pol[n:], ref[:n], ref[n:], self.cfg.beta)
        return {"loss": float(loss.detach()), **stats, "grad_norm": apply_update(ctx, loss),
                "tokens": batch.input_ids.numel()}


class GRPO:
    """Sample a group per prompt, score with the task verifier, group-normalise, clipped policy updates."""

    def __init__(self, ctx: StepContext, cfg: Any) -> None:
        if cfg.group_size < 2:
            raise ValueError(f"algorithm.group_size must be >= 2 for group-normalised advantages, got {cfg.group_size}")
        if cfg.rollout_dtype not in _DTYPES:
            raise ValueError(f"algorithm.rollout_dtype must be one of {sorted(_DTYPES)}, got {cfg.rollout_dtype!r}")
        if ctx.batch_size % cfg.group_size or ctx.batch_size < cfg.group_size:
            raise ValueError(f"engine.batch_size ({ctx.batch_size} sequences per step) must be a positive multiple of "
                             f"algorithm.group_size ({cfg.group_size}): each prompt is sampled group_size times")
        self.ctx, self.cfg = ctx, cfg
        self.prompts_per_step = ctx.batch_size // cfg.group_size

    def rollout(self, step: int) -> tuple[Batch, torch.Tensor, torch.Tensor, dict[str, float]]:
        """-> (batch of prompt+response rows, rollout log-probs [B,S], rewards [B], metrics)."""
        ctx, cfg = self.ctx, self.cfg
        drawn = ctx.mixture.train_batch(step, self.prompts_per_step)
        prompts = [ctx.encoder.prompt(ex) for _, ex in drawn]
        rows = [p for p in prompts for _ in range(cfg.group_size)]  # group-major: a prompt's samples adjacent
        gen = torch.Generator().manual_seed(step_seed(ctx.seed, step, "rollout"))
        out = generate(ctx.infer_forward, rows, max_new_tokens=ctx.max_new_tokens, eos_id=ctx.encoder.tok.eos_id,
                       pad_id=ctx.encoder.tok.pad_id, temperature=cfg.temperature, generator=gen,
                       autocast_dtype=_DTYPES[cfg.rollout_dtype])
        rewards, responses = [], []
        for i in range(len(rows)):
            name, ex = drawn[i // cfg.group_size]
            resp = out.response(i)
            responses.append(torch.tensor(resp, dtype=torch.int64))
            rewards.append(ctx.mixture.reward(name, ex, ctx.encoder.tok.decode(resp)))
        batch = ctx.encoder.collate([(p_ids, p_types, imgs, r) for (p_ids, p_types, imgs), r in zip(rows, responses)])
        rollout_logp = torch.zeros(batch.input_ids.shape)
        for i, r in enumerate(responses):
            start = int(batch.lengths[i]) - r.numel()
            rollout_logp[i, start:start + r.numel()] = out.logprobs[i, : r.numel()]
        reward_t = torch.tensor(rewards)
        finished = float(sum(int(r.numel() > 0 and r[-1] == ctx.encoder.tok.eos_id) for r in responses)) / len(rows)
        metrics = {"reward": float(reward_t.mean()), "response_length": float(out.mask.sum(-1).float().mean()),
                   "eos_fraction": finished}
        return batch, rollout_logp, reward_t, metrics

    def step(self, step: int) -> dict[str, float]:
        """Rollout, old log-probs (or bypass), correction weights, then ppo_epochs × mini_batches updates."""
        ctx, cfg = self.ctx, self.cfg
        batch, rollout_logp, rewards, metrics = self.rollout(step)
        adv = group_advantages(rewards, cfg.group_size, cfg.norm_adv_by_std)
        mask = batch.target_mask
        corr = cfg.rollout_correction
        if corr.bypass:
            old_logp = rollout_logp
        else:
            with torch.no_grad():
                old_logp = _logp(ctx.infer_forward, batch, cfg.temperature)
        weights, cstats = rollout_correction(old_logp, rollout_logp, mask, corr.mode, corr.lower, corr.upper,
                                             corr.tis_cap)
        metrics.update({f"rollout_corr/{k}": v for k, v in cstats.items()})
        n = batch.size
        bounds = torch.linspace(0, n, cfg.mini_batches + 1).round().long().tolist()
        losses, norms, clipfrac, kl = [], [], [], []
        for _epoch in range(cfg.ppo_epochs):
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                if hi <= lo:
                    continue
                mb = _slice(batch, lo, hi)
                new_logp = _logp(ctx.train_forward, mb, cfg.temperature)
                loss, pstats = policy_loss(new_logp, old_logp[lo:hi], adv[lo:hi], mask[lo:hi], cfg.clip_ratio_low,
                                           cfg.clip_ratio_high, weights[lo:hi], cfg.loss_agg_mode)
                losses.append(float(loss.detach()))
                norms.append(apply_update(ctx, loss))
                clipfrac.append(pstats["clip_fraction"])
                kl.append(pstats["approx_kl"])
        metrics.update({"loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms),
                        "clip_fraction": sum(clipfrac) / len(clipfrac), "approx_kl": sum(kl) / len(kl),
                        "advantage_abs_mean": float(adv.abs().mean()), "tokens": batch.input_ids.numel()})
        return metrics


def _slice(batch: Batch, lo: int, hi: int) -> Batch:
    """Rows [lo, hi) of a batch, with the image inputs that belong to them."""
    from dsv4flash.model.image import IMAGE_START

    spans_per_row = (batch.token_types == IMAGE_START).sum(-1).tolist()
    first = sum(spans_per_row[:lo])
    count = sum(spans_per_row[lo:hi])
    return Batch(batch.input_ids[lo:hi], batch.token_types[lo:hi], batch.images[first:first + count],
                 batch.target_mask[lo:hi], batch.lengths[lo:hi])


ALGORITHMS = {"pretrain": Pretrain, "sft": SFT, "dpo": DPO, "grpo": GRPO}
