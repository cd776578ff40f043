"""A synthetic DeepSeek-V4.1 checkpoint vLLM's CUDA kernels accept, and PEFT adapters for it (GPU tests only).

vLLM's V4.1 kernels fix the attention geometry (head_dim 512 with a 64-lane RoPE tail, 64 heads in 8 `wo_a`
groups); everything else is shrunk so that one GPU holds the whole model: narrower residual stream, 16 experts,
smaller Engram tables and ViT. Weights are Gaussian, run through the release codecs by
`dsv4flash_bridge.synthetic.write_release_checkpoint`, so the bytes are real FP8 32×32 / MXFP4 encodings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch


def small_config(hidden: int = 2048, experts: int = 16, engram_rows: int = 1 << 16):
    """Flash's structure and attention geometry with a narrow residual stream and few experts."""
    from dsv4flash.config import DSV41FlashConfig, _derive_engram_layouts, load_config

    data = load_config("flash").to_hf()
    text, vision = data["text_config"], data["vision_config"]
    text.update(hidden_size=hidden, moe_intermediate_size=hidden // 2, n_routed_experts=experts,
                num_experts_per_tok=min(6, experts), dspark_n_routed_experts=max(4, experts // 2),
                engram_vocab_size=max(64, engram_rows // (text["engram_n_heads"] * (text["engram_max_ngram_size"] - 1))))
    scalars = ("engram_vocab_size", "engram_n_heads", "engram_max_ngram_size", "engram_layer_ids",
               "engram_compressed_vocab_size")
    probe = dataclasses.replace(load_config("flash").text, **{k: v for k, v in text.items() if k in scalars})
    text["engram_num_embeddings"] = [layout.num_rows for layout in _derive_engram_layouts(probe)]
    vision.update(num_hidden_layers=4)
    return DSV41FlashConfig.from_hf(data, name=f"vllm-small-{hidden}x{experts}", source="tests/gpu/_small_v41.py")


def checkpoint(cache: Path) -> Path:
    """`$DSV4FLASH_V41_CHECKPOINT`, else a synthetic small checkpoint generated once into `cache`."""
    given = os.environ.get("DSV4FLASH_V41_CHECKPOINT")
    if given:
        return Path(given)
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    cfg = small_config()
    dst = cache / cfg.name
    if not (dst / "config.json").is_file():
        write_release_checkpoint(dst, cfg, shards=8)
    return dst


def write_adapter(dst: Path, model_dir: Path, seed: int, *, shared_a: bool, rank: int = 8, zero: bool = False) -> Path:
    """A PEFT adapter on every layer's `wo_a` (per-group or shared-A) and compressor `wkv`/`wgate`."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    groups, heads, hd = text["o_groups"], text["num_attention_heads"], text["head_dim"]
    in_g, out_g, hidden = heads * hd // groups, text["o_lora_rank"], text["hidden_size"]
    gen = torch.Generator().manual_seed(seed)

    def factor(*shape, scale):
        return torch.zeros(shape) if zero and scale == "B" else torch.randn(*shape, generator=gen) * 0.02

    tensors = {}
    for layer, ratio in enumerate(text["compress_ratios"][: text["num_hidden_layers"]]):
        stem = f"base_model.model.layers.{layer}.attn"
        if shared_a:
            tensors[f"{stem}.wo_a.lora_A.weight"] = factor(rank, in_g, scale="A")
            tensors[f"{stem}.wo_a.lora_B.weight"] = factor(groups * out_g, rank, scale="B")
        else:
            tensors[f"{stem}.wo_a.lora_A.weight"] = factor(groups, rank, in_g, scale="A")
            tensors[f"{stem}.wo_a.lora_B.weight"] = factor(groups, out_g, rank, scale="B")
        if layer in text["kv_source_layer_ids"]:
            for proj in ("wkv", "wgate") if ratio > 1 else ("wkv",):
                tensors[f"{stem}.compressor.{proj}.lora_A.weight"] = factor(rank, hidden, scale="A")
                tensors[f"{stem}.compressor.{proj}.lora_B.weight"] = factor(hd, rank, scale="B")
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["wo_a", "wkv", "wgate"], "base_model_name_or_path": str(model_dir)}))
    return dst
