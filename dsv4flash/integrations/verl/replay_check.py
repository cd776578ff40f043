"""In-run check of text-only routing replay: replayed text rows must be the experts the actor itself would pick.

With R3 the actor's routers replay the rollout's experts on the rows `build_r3_replay_mask` selects and route
the rest natively (image spans with `bias_vl`). When the actor's weights are the rollout's (the first forward of
each step's update: the adapter was synced before the rollout), the experts its own router picks on a text row
equal the ones the rollout recorded for that token, exactly, in fp32 — unless the routes were put on the wrong
rows (compact routes next to expanded ids: DSV41-VERL-004/013). So every replayed forward counts, per micro-batch:

* `routing_replay/text_rows_mismatch` — replayed (row, MoE layer) pairs whose replayed expert set differs from
  the router's native choice (0 when the join is right);
* `routing_replay/text_rows_replayed` — replayed (row, MoE layer) pairs;
* `routing_replay/image_rows_native` — rows the batch marks native (`r3_native_rows`: image spans).

They reach veRL's step metrics through the engine's per-micro-batch `metrics` (summed over micro-batches; the
trainer logs the update's as `actor/routing_replay/*`).
This is dsv4flash instrumentation, not a veRL fix: `install()` wraps veRL's `RouterReplay.get_replay_topk`
(where veRL already computes the native experts next to the replayed ones) and the engine's
`postprocess_micro_batch_func`; the counting is `count_mismatches`.
"""

from __future__ import annotations

import threading

import torch

KEYS = ("routing_replay/text_rows_mismatch", "routing_replay/text_rows_replayed", "routing_replay/image_rows_native")
_counts = threading.local()
_installed: list = []


def count_mismatches(replayed: torch.Tensor, native: torch.Tensor, replay_mask: torch.Tensor) -> tuple[int, int]:
    """(mismatching, replayed) rows among `replay_mask` [T]: expert sets of replayed / native ids [T, k] differ."""
    mask = replay_mask.reshape(-1).bool().to(replayed.device)
    same = (replayed.sort(dim=-1).values == native.to(replayed.device).sort(dim=-1).values).all(dim=-1)
    return int((mask & ~same).sum()), int(mask.sum())


def _add(mismatch: int, replayed: int) -> None:
    _counts.mismatch = getattr(_counts, "mismatch", 0) + mismatch
    _counts.replayed = getattr(_counts, "replayed", 0) + replayed


def _take() -> tuple[int, int]:
    out = (getattr(_counts, "mismatch", 0), getattr(_counts, "replayed", 0))
    _counts.mismatch = _counts.replayed = 0
    return out


def install() -> None:
    """Wrap `RouterReplay.get_replay_topk` and `MegatronEngineWithLMHead.postprocess_micro_batch_func` (idempotent)."""
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    if _installed:
        return
    get_replay_topk = RouterReplay.get_replay_topk
    postprocess = MegatronEngineWithLMHead.postprocess_micro_batch_func

    def checked_get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """veRL's replay; a forward replay with a mask also counts replayed rows whose experts differ from native."""
        probs, indices = get_replay_topk(self, scores, topk, num_groups=num_groups, group_topk=group_topk,
                                         default_compute_topk=default_compute_topk)
        mask = self.target_replay_mask
        if (self.router_replay_action == RouterReplayAction.REPLAY_FORWARD and self.target_topk_idx is not None
                and mask is not None):
            with torch.no_grad():
                _, native = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                _add(*count_mismatches(indices, native, mask))
        return probs, indices

    def postprocess_micro_batch_func(self, output, data, *args, **kwargs):
        """veRL's micro-batch output, with the replay check of that micro-batch's forward in its metrics."""
        out = postprocess(self, output, data, *args, **kwargs)  # (loss, [num_tokens,] output dict)
        mismatch, replayed = _take()
        result = out[-1] if isinstance(out, tuple) else out
        native = data.get("r3_native_rows", None) if hasattr(data, "get") else None
        if replayed or native is not None:
            n_native = int((native.values() if native.is_nested else native).sum()) if native is not None else 0
            result.setdefault("metrics", {}).update({
                KEYS[0]: Metric(AggregationType.SUM, mismatch),
                KEYS[1]: Metric(AggregationType.SUM, replayed),
                KEYS[2]: Metric(AggregationType.SUM, n_native),
            })
        return out

    RouterReplay.get_replay_topk = checked_get_replay_topk
    MegatronEngineWithLMHead.postprocess_micro_batch_func = postprocess_micro_batch_func
    _installed.append((RouterReplay, get_replay_topk, MegatronEngineWithLMHead, postprocess))


def install_when_imported() -> None:
    """Install once veRL's Megatron engine is imported (a rollout-only process never imports it)."""
    from dsv4flash.patching.post_import import when_imported

    when_imported("verl.workers.engine.megatron.transformer_impl", install)
