"""Fresh-parameter initialisation table (the release ships no init code; this one trains the tiny model).

| parameter                         | init                         |
|-----------------------------------|------------------------------|
| every projection / embedding      | N(0, initializer_range)      |
| output projections (wo_b, w2)     | N(0, initializer_range/√(2L)) (residual branches, GPT-2 style) |
| norm weights                      | 1                            |
| hc_*_fn                           | N(0, initializer_range)      |
| hc_*_base, gate bias / bias_vl    | 0                            |
| hc_*_scale                        | 1                            |
| attn_sink                         | 0                            |
| image delimiters                  | N(0, initializer_range)      |
| Engram q_weight / k_weight        | 1 (only their product matters; they start neutral) |
| Engram table / wkv                | N(0, initializer_range)      |
| vision/aligner biases             | 0                            |
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4flash.config import DSV41FlashConfig

_RESIDUAL_OUTPUTS = ("attn.wo_b.weight", ".w2.weight")


@torch.no_grad()
def init_weights(model: nn.Module, cfg: DSV41FlashConfig, seed: int) -> None:
    """Initialise every parameter of `model` deterministically from `seed` (meta tensors are skipped)."""
    from dsv4flash.model.norm import RMSNorm

    gen = torch.Generator(device="cpu").manual_seed(seed)
    std = cfg.text.initializer_range
    residual_std = std / math.sqrt(2 * cfg.text.num_hidden_layers)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if id(param) in norm_weights or leaf.endswith("_scale") or leaf in ("q_weight", "k_weight"):
            param.fill_(1.0)
        elif leaf.endswith("_base") or leaf in ("bias", "bias_vl", "attn_sink"):
            param.zero_()
        else:
            scale = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else std
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * scale)
