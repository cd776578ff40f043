"""Fixtures for the LoRA tests: fresh tiny models, token batches, a one-image VL batch, expected targets."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.model.image import ImageInput, expand_image_placeholders
from dsv4flash.model.transformer import Transformer


@pytest.fixture()
def make_model(tiny_cfg):
    """Factory: a fresh tiny fp32 model (same seed, so two calls give identical bases)."""
    def make(dtype=torch.float32):
        return Transformer(tiny_cfg, dtype=dtype, seed=0)
    return make


@pytest.fixture()
def ids():
    """[2, 24] text tokens (S > sliding window and > every compressor ratio)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, 499, (2, 24), generator=gen)


@pytest.fixture()
def vl_batch(tiny_cfg):
    """One prompt with one 3×6-patch image: (ids [1,S], token_types [1,S], images)."""
    gen = torch.Generator().manual_seed(2)
    p = tiny_cfg.vision.patch_size
    image = ImageInput(torch.randn(18, 3 * p * p, generator=gen), (3, 6))
    prompt = torch.cat([torch.randint(3, 499, (6,), generator=gen), torch.tensor([tiny_cfg.image_token_id]),
                        torch.randint(3, 499, (12,), generator=gen)])
    ids, types = expand_image_placeholders(prompt, [image], tiny_cfg)
    return ids[None], types[None], [image]


def lm_linear_modules(cfg, layers=None) -> set[str]:
    """Every linear the study adapts, written out from the layer plan (not from the rule engine)."""
    text = cfg.text
    out = set()
    for plan in cfg.backbone_plan:
        i = plan.layer_id
        if layers is not None and i not in layers:
            continue
        out |= {f"layers.{i}.attn.{n}" for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
        if plan.has_compressor:
            out.add(f"layers.{i}.attn.compressor.wkv")
        if plan.has_wgate:
            out.add(f"layers.{i}.attn.compressor.wgate")
        out |= {f"layers.{i}.ffn.shared_experts.{w}" for w in ("w1", "w2", "w3")}
        out |= {f"layers.{i}.ffn.experts.{e}.{w}" for e in range(text.n_routed_experts) for w in ("w1", "w2", "w3")}
        if plan.has_engram:
            out.add(f"layers.{i}.engram.wkv")
    return out


def vit_modules(cfg) -> set[str]:
    """Every linear of the vision tower and aligner."""
    out = {"vision.patch_embed.proj", "aligner.w1", "aligner.w2"}
    for b in range(cfg.vision.num_hidden_layers):
        out |= {f"vision.blocks.{b}.attn.wqkv", f"vision.blocks.{b}.attn.wo", f"vision.blocks.{b}.mlp.w1",
                f"vision.blocks.{b}.mlp.w2"}
    return out


def randomize_adapters(model, seed=0, std=0.05):
    """Give every LoRA factor (B included) non-zero values so the adapters change the output."""
    from dsv4flash.lora import lora_parameters

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs on one intra-op thread (`one_thread` in tests/conftest.py)."""
