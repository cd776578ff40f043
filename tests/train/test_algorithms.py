"""SFT and DPO steps on the tiny reference model with decoder-half LoRA: the loss moves the right way."""

import math

import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.engine.algorithms import DPO, SFT, StepContext
from dsv4flash.engine.evaluate import evaluate
from dsv4flash.lora import LoraConfig, apply_lora, forward_with_early_stop, param_groups
from dsv4flash.model.transformer import Transformer
from dsv4flash.tasks import Encoder, TaskMixture, TaskTokenizer, build_task
from dsv4flash.train.schema import DPOAlgo, SFTAlgo

CFG = load_config("tiny")


def _ctx(lr: float, with_ref: bool = False) -> StepContext:
    model = Transformer(CFG, seed=0)
    ref = None
    if with_ref:
        import copy

        ref = copy.deepcopy(model).eval().requires_grad_(False)
    handle = apply_lora(model, LoraConfig(preset="decoder_half", rank=8))
    opt = torch.optim.AdamW(param_groups(model, handle, lr))
    params = [p for g in opt.param_groups for p in g["params"]]
    mix = TaskMixture({"arithmetic": build_task("arithmetic"), "geometry": build_task("geometry")},
                      {"arithmetic": 1.0, "geometry": 1.0}, seed=0, val_size=16)
    return StepContext(model=model, train_forward=lambda *a: forward_with_early_stop(model, *a), infer_forward=model,
                       encoder=Encoder(TaskTokenizer(CFG), CFG), mixture=mix, optimizer=opt, params=params,
                       clip_grad=1.0, batch_size=8, max_new_tokens=4, seed=0, ref_model=ref)


def test_sft_steps_lower_validation_loss():
    ctx = _ctx(lr=3e-3)
    before = evaluate(ctx.model, ctx.encoder, ctx.mixture, decode=False)["val_loss"]
    sft = SFT(ctx, SFTAlgo())
    losses = [sft.step(s)["loss"] for s in range(8)]
    after = evaluate(ctx.model, ctx.encoder, ctx.mixture, decode=False)["val_loss"]
    assert before == pytest.approx(math.log(CFG.text.vocab_size), rel=0.05)  # near-uniform untrained model
    assert after < before - 0.3, (before, after, losses)
    assert losses[-1] < losses[0]
    # only adapters moved: the frozen base weights received no gradient
    assert all(p.grad is None for n, p in ctx.model.named_parameters() if not p.requires_grad)


def test_dpo_steps_raise_the_preference_margin():
    ctx = _ctx(lr=5e-3, with_ref=True)
    dpo = DPO(ctx, DPOAlgo(beta=0.5))
    first = dpo.step(0)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)  # B = 0: policy equals the reference
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-4)
    later = [dpo.step(0) for _ in range(4)]  # the same pairs again: the margin must grow
    assert later[-1]["loss"] < math.log(2) - 0.05 and later[-1]["reward_margin"] > 0.1, later
    assert later[-1]["reward_accuracy"] >= 0.75
    with pytest.raises(ValueError, match="reference model"):
        DPO(_ctx(1e-3), DPOAlgo())
