"""Small real megatron-core configs and models that run on CPU under the CUDA redirect."""

from __future__ import annotations

from typing import Any

import torch


def tiny_moe_config(**overrides: Any):
    """An fp32, fusion-free MoE `TransformerConfig` (4 experts, top-2, sqrtsoftplus + expert bias)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_ffn_hidden_size=16,
        moe_router_topk=2,
        moe_router_score_function="sqrtsoftplus",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32",
        add_bias_linear=False,  # SequentialMLP + bias does an in-place add on a view (mlp.py), DeepSeek has none
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_cpu_initialization=True,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def tiny_gpt_moe(config=None, vocab_size: int = 64, max_sequence_length: int = 32):
    """A local-spec (no Transformer Engine) GPTModel with RoPE whose MLPs are `MoELayer`s."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = config if config is not None else tiny_moe_config()
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        position_embedding_type="rope",
    )


def causal_attention_mask(seq_len: int) -> torch.Tensor:
    """Megatron's boolean mask convention, True = masked out: `[1, 1, s, s]` upper triangle."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def gpt_inputs(batch: int, seq_len: int, vocab_size: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, position ids and an explicit causal mask (the default mask is built on "cuda")."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, vocab_size, (batch, seq_len), generator=gen),
        "position_ids": torch.arange(seq_len).expand(batch, seq_len).contiguous(),
        "attention_mask": causal_attention_mask(seq_len),
    }


def count_layer_backwards(model) -> list[int]:
    """A one-item counter: how often a gradient reached a decoder layer's output (over layers and micro-batches)."""
    counts = [0]

    def on_forward(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: counts.__setitem__(0, counts[0] + 1))

    for layer in model.decoder.layers:
        layer.register_forward_hook(on_forward)
    return counts
