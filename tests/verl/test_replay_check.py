"""The in-run replay check on veRL's own `RouterReplay`: a forward replay with a mask counts the replayed rows
whose experts differ from the router's native choice; recording, unmasked replays and backward replays count
nothing."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.upstream


def _topk(scores, topk, num_groups=None, group_topk=None):
    probs, idx = scores.topk(topk, dim=-1)
    return probs, idx


def test_forward_replays_count_rows_that_differ_from_native():
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    from dsv4flash.integrations.verl import replay_check

    replay_check.install()
    replay_check._take()
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.0], [0.1, 0.9, 0.0, 0.5], [0.0, 0.1, 0.9, 0.5]])
    native = _topk(scores, 2)[1]  # rows: {0, 2}, {1, 3}, {2, 3}
    target = torch.tensor([[2, 0], [0, 1], [0, 1]])  # row 0 same set, rows 1 and 2 differ
    replay = RouterReplay()
    replay.set_router_replay_action(RouterReplayAction.RECORD)
    replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert replay_check._take() == (0, 0)
    replay.set_target_indices(target, torch.tensor([True, True, False]))  # row 2 routes natively
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, used = replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert torch.equal(used[2], native[2]) and torch.equal(used[:2], target[:2])  # veRL's replay, unchanged
    assert replay_check._take() == (1, 2)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert replay_check._take() == (0, 0)
