"""A resumable training run used by test_resume.py (run as a script, killed with SIGKILL mid-run).

Every step draws from all four RNGs (torch dropout, numpy input noise, python `random` loss weight,
the data cursor's permutation) so a resume that forgot any of them diverges. The run logs each step's
loss as a float hex string, checkpoints every `--ckpt-every` steps through the policy record, resumes
from it on start, and writes its final trainable weights to `--final`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np
import torch
from torch import nn

from dsv4flash.lifecycle.catalog import open_catalog
from dsv4flash.lifecycle.checkpoint import resume, save_checkpoint
from dsv4flash.lifecycle.fingerprint import census_rows_from_state_dict, fingerprint_from_parts
from dsv4flash.lifecycle.store import AdapterStore
from dsv4flash.lifecycle.trainer_state import DataCursor, trainable_state

VOCAB, SEQ, N_SAMPLES, BATCH = 512, 16, 48, 2


class MLP(nn.Module):
    """Frozen base + trainable low-rank head, with dropout."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.base = nn.Linear(16, 32)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(32, 16, generator=gen) * 0.3)
            self.base.bias.zero_()
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(4, 32, generator=gen) * 0.1)
        self.lora_b = nn.Parameter(torch.zeros(1, 4))
        self.head = nn.Parameter(torch.randn(1, 32, generator=gen) * 0.1)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.drop(torch.tanh(self.base(x)))  # [B, 32]
        return h @ self.head.T + (h @ self.lora_a.T) @ self.lora_b.T  # [B, 1]


def build(kind: str):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP()
        config = json.dumps({"model": "mlp", "in": 16, "hidden": 32})
    else:
        from dsv4flash.config import load_config
        from dsv4flash.lora import LoraConfig, apply_lora
        from dsv4flash.model.transformer import Transformer

        cfg = load_config("tiny")
        model = Transformer(cfg, seed=0)
        apply_lora(model, LoraConfig(preset="full_linear", rank=2, dropout=0.1, seed=3))
        config = cfg.to_json()
    base = {k: v for k, v in model.state_dict().items() if k not in trainable_state(model)}
    return model, fingerprint_from_parts(config, census_rows_from_state_dict(base))


def step_loss(kind: str, model, idx: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(99)
    if kind == "mlp":
        x_all = torch.randn(N_SAMPLES, 16, generator=gen)
        y_all = torch.randn(N_SAMPLES, 1, generator=gen)
        x = x_all[idx] + torch.from_numpy(np.random.randn(len(idx), 16).astype(np.float32)) * 0.05
        return nn.functional.mse_loss(model(x), y_all[idx]) * (1.0 + 0.1 * random.random())
    tokens = torch.randint(3, VOCAB - 13, (N_SAMPLES, SEQ), generator=gen)[idx]
    mask = torch.from_numpy(np.random.rand(*tokens.shape) < 0.1)
    inputs = torch.where(mask, torch.full_like(tokens, 7), tokens)
    logits = model(inputs)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return loss * (1.0 + 0.01 * random.random())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--model", default="mlp", choices=["mlp", "tiny"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ckpt-every", type=int, default=3)
    ap.add_argument("--log", required=True)
    ap.add_argument("--final", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model, fp = build(args.model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.97 ** s)
    store = AdapterStore(args.root, open_catalog(args.catalog))
    store.create_policy("run", fp)
    resumed = resume(store, "run", model, opt, sched, resident_base=fp)
    if resumed is None:
        random.seed(1)
        np.random.seed(2)
        torch.manual_seed(3)
        cursor, step = DataCursor(N_SAMPLES, seed=4), 0
    else:
        cursor, step = DataCursor.from_position(resumed.data_position), resumed.step
    print(json.dumps({"start": step}), flush=True)
    model.train()
    with open(args.log, "a") as log:
        while step < args.steps:
            loss = step_loss(args.model, model, cursor.take(BATCH))
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            log.write(json.dumps({"step": step, "loss": float(loss.detach()).hex()}) + "\n")
            log.flush()
            print(json.dumps({"step": step}), flush=True)
            if os.environ.get("DSV4FLASH_HOLD_AFTER_STEP") == str(step):
                # The test kills us here; holding makes "killed between checkpoints" independent of load.
                while True:
                    time.sleep(1)
            if step % args.ckpt_every == 0:
                save_checkpoint(store, "run", model, opt, sched, step=step, data_position=cursor.position())
    torch.save({k: v.clone() for k, v in trainable_state(model).items()}, args.final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
