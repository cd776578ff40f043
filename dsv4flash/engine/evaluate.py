"""Validation of the local engine: teacher-forced loss on the reference answers, and greedy-decoded reward."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from dsv4flash.engine.losses import token_logprobs
from dsv4flash.engine.sampling import generate
from dsv4flash.tasks.dataset import Encoder, TaskMixture


@torch.no_grad()
def evaluate(forward: Callable, encoder: Encoder, mixture: TaskMixture, *, batch_size: int = 32,
             decode: bool = True, max_new_tokens: int = 8,
             on_batch: Callable[[int], None] | None = None) -> dict[str, float]:
    """-> val_loss (mean NLL per answer token, eos included) and, with `decode`, val_reward (greedy) per task;
    `on_batch(n)` after each batch of n examples (progress)."""
    nll_sum, n_tokens = 0.0, 0
    rewards: dict[str, list[float]] = defaultdict(list)
    val = mixture.val
    for start in range(0, len(val), batch_size):
        chunk = val[start:start + batch_size]
        batch = encoder.batch([ex for _, ex in chunk])
        logp = token_logprobs(forward(batch.input_ids, batch.token_types, batch.images), batch.input_ids)
        nll_sum += float(-(logp * batch.target_mask).sum())
        n_tokens += int(batch.target_mask.sum())
        if decode:
            prompts = [encoder.prompt(ex) for _, ex in chunk]
            out = generate(forward, prompts, max_new_tokens=max_new_tokens, eos_id=encoder.tok.eos_id,
                           pad_id=encoder.tok.pad_id, temperature=0.0)
            for i, (name, ex) in enumerate(chunk):
                rewards[name].append(mixture.reward(name, ex, encoder.tok.decode(out.response(i))))
        if on_batch is not None:
            on_batch(len(chunk))
    metrics = {"val_loss": nll_sum / max(n_tokens, 1)}
    if decode:
        every = [r for values in rewards.values() for r in values]
        metrics["val_reward"] = sum(every) / max(len(every), 1)
        if len(rewards) > 1:
            for name, values in sorted(rewards.items()):
                metrics[f"val_reward/{name}"] = sum(values) / len(values)
    return metrics
