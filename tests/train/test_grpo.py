"""GRPO on the local engine: one step on a toy reward raises the expected reward (exactly computable)."""

import numpy as np
import pytest
import torch
from torch import nn

from dsv4flash.config import load_config
from dsv4flash.engine.algorithms import GRPO, StepContext
from dsv4flash.tasks import Encoder, Example, Task, TaskMixture, TaskTokenizer
from dsv4flash.tasks.base import normalise
from dsv4flash.train.schema import GRPOAlgo, RolloutCorrectionConf

CFG = load_config("tiny")
TOK = TaskTokenizer(CFG)
DIGITS = [TOK.encode(str(d))[0] for d in range(10)]
SEVEN = TOK.encode("7")[0]


class LuckySeven(Task):
    """Reward 1 when the answer is 7, whatever the question."""

    name = "lucky"

    def sample(self, rng):
        a, b = (int(x) for x in rng.integers(0, 10, size=2))
        return Example(prompt=f"q : {a} + {b} = ? a :", answer="7")

    def reward(self, example, response):
        return 1.0 if normalise(response) == "7" else 0.0


class BigramPolicy(nn.Module):
    """logits[b, t] = table[ids[b, t]]: the next token depends on the current one only; digits start uniform."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.full((CFG.text.vocab_size, CFG.text.vocab_size), -30.0)
        table[:, DIGITS] = 0.0
        self.table = nn.Parameter(table)

    def forward(self, ids, types=None, images=None):
        return self.table[ids]


def expected_reward(policy: BigramPolicy) -> float:
    """Exact P(first answer token = 7): every prompt ends with ':'."""
    colon = TOK.encode(":")[0]
    return float(torch.softmax(policy.table[colon].detach(), -1)[SEVEN])


def _grpo(seed: int, mode: str = "icepop", lr: float = 0.5):
    torch.manual_seed(seed)
    policy = BigramPolicy()
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    mix = TaskMixture({"lucky": LuckySeven()}, {"lucky": 1.0}, seed=seed, val_size=0)
    ctx = StepContext(model=policy, train_forward=policy, infer_forward=policy, encoder=Encoder(TOK, CFG),
                      mixture=mix, optimizer=opt, params=list(policy.parameters()), clip_grad=0.0, batch_size=32,
                      max_new_tokens=1, seed=seed)
    algo = GRPO(ctx, GRPOAlgo(group_size=8, rollout_dtype="float32", mini_batches=1,
                              rollout_correction=RolloutCorrectionConf(mode=mode)))
    return policy, algo


def test_grpo_step_raises_expected_reward_fixed_seed():
    policy, algo = _grpo(seed=0)
    before = expected_reward(policy)
    assert before == pytest.approx(0.1, rel=1e-4)
    metrics = algo.step(0)
    after = expected_reward(policy)
    assert 0.0 < metrics["reward"] < 1.0  # the sampled groups held both outcomes
    assert after > before * 1.05, (before, after, metrics)
    assert metrics["rollout_corr/corrected_fraction"] == 0.0  # same policy samples and trains: k = 1


@pytest.mark.parametrize("mode", ["icepop", "tis", "none"])
def test_grpo_improves_over_seeds_and_modes(mode):
    gains = []
    for seed in range(4):
        policy, algo = _grpo(seed, mode)
        before = expected_reward(policy)
        algo.step(0)
        algo.step(1)
        gains.append(expected_reward(policy) - before)
    assert all(g > 0 for g in gains), gains


def test_grpo_batch_must_split_into_groups():
    policy, algo = _grpo(seed=0)
    algo.ctx.batch_size = 12
    with pytest.raises(ValueError, match="multiple of algorithm.group_size"):
        GRPO(algo.ctx, algo.cfg)


def test_grpo_rollout_rows_score_only_generated_tokens():
    policy, algo = _grpo(seed=3)
    batch, rollout_logp, rewards, metrics = algo.rollout(0)
    assert batch.size == 32 and rewards.shape == (32,)
    assert int(batch.target_mask.sum()) == 32  # one generated token each (max_new_tokens=1)
    # rollout log-probs sit exactly on the scored positions and equal the sampler's distribution (uniform digits)
    assert torch.allclose(rollout_logp[batch.target_mask], torch.full((32,), float(np.log(0.1))), atol=1e-4)
    assert bool((rollout_logp[~batch.target_mask] == 0).all())
    sevens = (batch.input_ids[batch.target_mask] == SEVEN).float()
    assert torch.equal(rewards, sevens)


def test_grpo_rollouts_on_the_cached_decoder_equal_full_recompute(one_thread):
    # The reference model decodes with its CSA2 cache; a plain callable around it recomputes every step.
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import build_task

    model = Transformer(CFG, seed=0).eval()
    mix = TaskMixture({"arithmetic": build_task("arithmetic")}, {"arithmetic": 1.0}, seed=0, val_size=0)
    outs = []
    for infer in (model, lambda ids, types, images: model(ids, types, images)):
        ctx = StepContext(model=model, train_forward=model, infer_forward=infer, encoder=Encoder(TOK, CFG),
                          mixture=mix, optimizer=None, params=[], clip_grad=0.0, batch_size=8, max_new_tokens=5,
                          seed=0)
        outs.append(GRPO(ctx, GRPOAlgo(group_size=4, rollout_dtype="float32", temperature=1.0)).rollout(0))
    (b1, lp1, r1, _), (b2, lp2, r2, _) = outs
    assert torch.equal(b1.input_ids, b2.input_ids) and torch.equal(r1, r2)
    assert torch.allclose(lp1, lp2, atol=1e-5)
    assert int(b1.target_mask.sum()) > 8  # several tokens per response were decoded
