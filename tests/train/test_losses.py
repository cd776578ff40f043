"""Loss math of the local engine: log-prob alignment, SFT, DPO sign/gradient, GRPO advantages, clipping,
IcePop/TIS masks (cross-checked against veRL's own implementation)."""

import math

import pytest
import torch

from dsv4flash.engine.losses import (aggregate, dpo_loss, group_advantages, policy_loss, rollout_correction, sft_loss,
                                     token_logprobs)


def test_token_logprobs_aligns_next_token():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lp = token_logprobs(logits, ids)
    assert lp.shape == (2, 5) and bool((lp[:, 0] == 0).all())
    ref = torch.log_softmax(logits, -1)
    for b in range(2):
        for t in range(1, 5):
            assert lp[b, t] == pytest.approx(float(ref[b, t - 1, ids[b, t]]), abs=1e-6)
    hot = token_logprobs(logits, ids, temperature=2.0)
    assert hot[0, 1] == pytest.approx(float(torch.log_softmax(logits[0, 0] / 2, -1)[ids[0, 1]]), abs=1e-6)


def test_sft_loss_is_mean_nll_over_mask():
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -4.0, -8.0]])
    mask = torch.tensor([[False, True, True], [False, False, True]])
    assert float(sft_loss(lp, mask)) == pytest.approx((1 + 2 + 8) / 3)


def test_group_advantages_centre_and_scale_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    g0 = torch.tensor([1.0, 0.0, 0.0, 0.0])
    expected = (g0 - g0.mean()) / (g0.std() + 1e-6)
    assert torch.allclose(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))  # all-equal group: no signal
    raw = group_advantages(rewards, 4, norm_by_std=False)
    assert torch.allclose(raw[:4], g0 - 0.25)
    assert float(adv[:4].sum()) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def _ratios_to_logps(ratios):
    rollout = torch.full((1, len(ratios)), -1.0)
    old = rollout + torch.log(torch.tensor([ratios]))
    return old, rollout


def test_icepop_masks_exactly_tokens_outside_band():
    ratios = [0.2, 0.49, 0.5, 0.9, 1.0, 3.0, 5.0, 5.01, 40.0]
    old, rollout = _ratios_to_logps(ratios)
    mask = torch.ones(1, len(ratios), dtype=torch.bool)
    mask[0, 3] = False  # an unscored token never gets weight
    w, stats = rollout_correction(old, rollout, mask, "icepop", 0.5, 5.0)
    inside = [0.5 <= r * (1 + 1e-6) and r <= 5.0 * (1 + 1e-6) for r in ratios]
    for i, r in enumerate(ratios):
        if not mask[0, i]:
            assert w[0, i] == 0
        elif inside[i]:
            assert float(w[0, i]) == pytest.approx(r, rel=1e-5)
        else:
            assert w[0, i] == 0, f"ratio {r} is outside [0.5, 5] and must be masked"
    outside_scored = sum(1 for i, ok in enumerate(inside) if not ok and mask[0, i])
    assert stats["corrected_fraction"] == pytest.approx(outside_scored / int(mask.sum()))


def test_tis_clamps_but_keeps_tokens():
    old, rollout = _ratios_to_logps([0.1, 1.0, 2.0, 7.0])
    mask = torch.ones(1, 4, dtype=torch.bool)
    w, stats = rollout_correction(old, rollout, mask, "tis", tis_cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.1, 1.0, 2.0, 2.0]]), rtol=1e-5)
    assert stats["corrected_fraction"] == pytest.approx(0.25)
    w, _ = rollout_correction(old, rollout, mask, "none")
    assert torch.equal(w, torch.ones(1, 4))
    with pytest.raises(ValueError, match="icepop"):
        rollout_correction(old, rollout, mask, "bogus")


@pytest.mark.upstream
def test_icepop_matches_verl_decoupled_token_icepop():
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    torch.manual_seed(1)
    old = torch.randn(4, 16) * 1.2 - 2
    rollout = old + torch.randn(4, 16)
    mask = torch.rand(4, 16) > 0.2
    ours, _ = rollout_correction(old, rollout, mask, "icepop", 0.5, 5.0)
    out = compute_rollout_correction_weights(log_ratio=old - rollout, response_mask=mask.float(), rollout_is="token",
                                             rollout_is_threshold="0.5_5.0")
    theirs = out[0] if isinstance(out, tuple) else out
    assert torch.allclose(ours, theirs.float() * mask, atol=1e-5)


def test_policy_loss_clips_the_ratio():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5]])).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    loss.backward()
    # positive advantage: ratio 1.5 > 1.2 is clipped (no gradient); 1.0 and 0.5 push up
    assert new.grad[0, 0] == 0 and new.grad[0, 1] < 0 and new.grad[0, 2] < 0
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    new.grad = None
    loss, _ = policy_loss(new, old, torch.tensor([-1.0]), mask, 0.2, 0.2)
    loss.backward()
    # negative advantage: ratio 0.5 < 0.8 is clipped, the others push down
    assert new.grad[0, 2] == 0 and new.grad[0, 0] > 0 and new.grad[0, 1] > 0


def test_policy_loss_weights_zero_out_masked_tokens():
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = policy_loss(new, old, torch.tensor([1.0]), mask, weights=torch.tensor([[1.0, 0.0]]))
    loss.backward()
    assert new.grad[0, 1] == 0 and new.grad[0, 0] < 0


def test_aggregation_modes():
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True], [True, False, False]])
    assert float(aggregate(x, m, "token-mean")) == pytest.approx(7 / 4)
    assert float(aggregate(x, m, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(x, m, "nope")


def test_dpo_loss_sign_and_gradient():
    ref_c, ref_r = torch.tensor([-5.0]), torch.tensor([-5.0])
    pol_c = torch.tensor([-5.0], requires_grad=True)
    pol_r = torch.tensor([-5.0], requires_grad=True)
    loss, stats = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.1)
    assert float(loss.detach()) == pytest.approx(math.log(2))
    loss.backward()
    # descent raises the chosen log-prob and lowers the rejected one, symmetric at the start
    assert pol_c.grad[0] < 0 and pol_r.grad[0] > 0
    assert float(pol_c.grad[0]) == pytest.approx(-float(pol_r.grad[0]))
    better, stats = dpo_loss(torch.tensor([-4.0]), torch.tensor([-6.0]), ref_c, ref_r, beta=0.1)
    assert float(better) < math.log(2) and stats["reward_accuracy"] == 1.0 and stats["reward_margin"] > 0
    worse, stats = dpo_loss(torch.tensor([-6.0]), torch.tensor([-4.0]), ref_c, ref_r, beta=0.1)
    assert float(worse) > math.log(2) and stats["reward_accuracy"] == 0.0
