"""Optimizer parameter groups for the adapters: the language model at `lr`, ViT/aligner at `lr·vit_lr_mult`."""

from __future__ import annotations

from torch import nn

from dsv4flash.lora.apply import LoraHandle, require_handle
from dsv4flash.lora.state import lora_parameters
from dsv4flash.lora.targets import module_group

VISION_GROUPS = ("vit", "aligner")


def param_groups(model: nn.Module, handle: LoraHandle | None, lr: float, **extra) -> list[dict]:
    """torch.optim param groups: `lora` (language model) and, when ViT adapters exist, `lora_vit`.

    Each group is `{"name", "params", "lr", **extra}` (e.g. weight_decay); empty groups are left out.
    """
    handle = handle or require_handle(model, "param_groups")
    lm, vit = [], []
    for key, param in lora_parameters(model).items():
        (vit if module_group(key) in VISION_GROUPS else lm).append(param)
    groups = [{"name": "lora", "params": lm, "lr": lr, **extra}]
    if vit:
        groups.append({"name": "lora_vit", "params": vit, "lr": lr * handle.config.vit_lr_mult, **extra})
    return [g for g in groups if g["params"]]
