"""The fixed-prompt weight-sync check inside a veRL run: after a sync, the rollout scores a FIXED prompt as the
actor does.

veRL's own `training/rollout_probs_diff_max` compares the batch's sampled responses, which change every step
and are scored by the actor before its update. This check holds one prompt fixed for the whole run and,
right after each `checkpoint_manager.update_weights`, asks every rollout replica for the prompt's
log-probs (`prompt_logprobs=0`: raw log-softmax under the adapter the replica serves now; with routing replay
the replica also returns the prompt's routes) and the Megatron actor for its log-probs of the same ids
(veRL's own `_compute_old_log_prob`, temperature 1, the replica's routes replayed under R3). The largest
absolute difference is the metric `weight_sync/fixed_prompt_logprob_diff_max`; with a tolerance set
(`trainer.dsv4flash_sync_check.tolerance`, 1e-5 in the fp32 CPU recipe) a larger one stops the run: a
skipped, partial or wrong sync is caught at the step it happens.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

METRIC = "weight_sync/fixed_prompt_logprob_diff_max"
CONFIG_KEY = "dsv4flash_sync_check"
DEFAULT_PROMPT = "q : 12 + 30 = ? a : 42"


class SyncCheckError(RuntimeError):
    """The rollout's log-probs of the fixed prompt differ from the actor's by more than the tolerance."""


def fixed_prompt_ids(tokenizer, text: str) -> list[int]:
    """The fixed prompt's token ids (no special tokens); at least two, so there is something to score."""
    ids = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    if len(ids) < 2:
        raise ValueError(f"trainer.{CONFIG_KEY}.prompt {text!r} is {len(ids)} token(s); the check scores tokens "
                         "1 … S−1, so it needs at least 2")
    return ids


def scoring_params() -> dict[str, Any]:
    """Sampling params of the scoring request: the prompt's own log-probs, one token sampled with a fixed seed
    (nothing drawn from a server's seed stream), no sampled-token log-probs."""
    return {"prompt_logprobs": 0, "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 0}


def rollout_scores(output, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(ids[i] | ids[:i]) for i = 1 … S−1 as float64 [S−1], routes [S, L, k] or None) of one replica's
    `TokenOutput` for the scoring request."""
    extra = output.extra_fields or {}
    got_ids, logprobs = extra.get("prompt_ids"), extra.get("prompt_logprobs")
    if logprobs is None or got_ids is None:
        raise ValueError("fixed-prompt check: the rollout's TokenOutput has no extra_fields prompt_ids / "
                         "prompt_logprobs (the backend must support sampling_params.prompt_logprobs)")
    scored = [row[0] for row in got_ids[: len(ids) - 1]]
    if scored != list(ids[1:]):
        raise ValueError(f"fixed-prompt check: the rollout scored tokens {scored}, expected {list(ids[1:])}")
    values = torch.tensor([row[0] for row in logprobs[: len(ids) - 1]], dtype=torch.float64)
    routes = None
    if output.routed_experts is not None:
        routes = torch.as_tensor(output.routed_experts)[: len(ids)]
    return values, routes


def actor_batch(ids: Sequence[int], routes: Sequence[torch.Tensor | None], rows: int):
    """A veRL `DataProto` scoring `ids` `rows` times in the layout of a training batch (prompt = the first
    token, response = the rest, no padding); row r replays `routes[r % len(routes)]` when routes are given."""
    from verl import DataProto

    n = len(ids)
    input_ids = torch.tensor([list(ids)] * rows, dtype=torch.long)  # [B, S]
    tensors = {
        "prompts": input_ids[:, :1], "responses": input_ids[:, 1:], "input_ids": input_ids,
        "attention_mask": torch.ones(rows, n, dtype=torch.long),
        "position_ids": torch.arange(n).expand(rows, n).clone(),
        "response_mask": torch.ones(rows, n - 1, dtype=torch.long),
    }
    if routes and routes[0] is not None:
        # [B, S, L, k], the agent loop's int16 layout aligned with input_ids
        tensors["routed_experts"] = torch.stack([routes[r % len(routes)] for r in range(rows)]).to(torch.int16)
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0, "global_token_num": [n] * rows})


def logprob_diff_max(rollout: Sequence[torch.Tensor], actor: torch.Tensor) -> float:
    """max |actor − rollout| over replicas and tokens; actor row r is compared with replica r % len(rollout)."""
    actor = actor.to(torch.float64)
    return max(float((actor[r] - rollout[r % len(rollout)]).abs().max()) for r in range(actor.shape[0]))


def check(diff: float, tolerance: float | None, where: str) -> float:
    """`diff`, or SyncCheckError when it exceeds `tolerance` (None: measure only)."""
    if tolerance is not None and not diff <= tolerance:  # NaN fails too
        raise SyncCheckError(f"{METRIC} = {diff:.3e} {where} exceeds trainer.{CONFIG_KEY}.tolerance {tolerance:g}: "
                             "the rollout does not serve the weights the actor holds")
    return diff


def measure(trainer, ids: Sequence[int]) -> float:
    """The metric for a live `RayPPOTrainer` (after `init_workers`): every replica's server scores `ids`,
    veRL's `_compute_old_log_prob` recomputes them on the actor."""
    import ray

    handles = trainer.llm_server_manager.server_handles
    outputs = ray.get([h.generate.remote(list(ids), scoring_params(), request_id=f"dsv4flash-sync-check-{i}")
                       for i, h in enumerate(handles)])
    scored = [rollout_scores(o, ids) for o in outputs]
    world = trainer.actor_rollout_wg.world_size
    rows = -(-len(scored) // world) * world  # a whole number of rows per data-parallel rank
    old, _ = trainer._compute_old_log_prob(actor_batch(ids, [r for _, r in scored], rows))
    return logprob_diff_max([lp for lp, _ in scored], old.batch["old_log_probs"])


__all__ = ["CONFIG_KEY", "DEFAULT_PROMPT", "METRIC", "SyncCheckError", "actor_batch", "check", "fixed_prompt_ids",
           "logprob_diff_max", "measure", "rollout_scores", "scoring_params"]
