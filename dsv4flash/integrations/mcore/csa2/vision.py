"""The V4.1 vision tower and 3×3 aligner as megatron-core modules (`vision_model`, `vision_projection`).

Same math as the reference (`dsv4flash.model.vision`: 2D rotate-half RoPE, bidirectional attention per image,
SwiGLU, fp32 RMSNorms, the 3×3 neighbourhood merge), on megatron-core's parallel linears so the ViT splits its
heads and MLP over tensor-parallel ranks and Megatron-Bridge's mappings (and LoRA) see the modules it knows:

    vision_model.patch_embed.proj                       replicated Linear(3·p·p -> C), bias
    vision_model.decoder.layers.{i}.input_layernorm     fp32 RMSNorm
        .self_attention.linear_qkv                      column-parallel, per head [q_h ; k_h ; v_h], bias
        .self_attention.linear_proj                     row-parallel, bias
        .pre_mlp_layernorm                              fp32 RMSNorm
        .mlp.linear_fc1 / .mlp.linear_fc2               column [gate_i ; up_i] / row-parallel, no bias
    vision_model.decoder.final_layernorm                fp32 RMSNorm
    vision_projection.encoder.linear_fc1 / linear_fc2   column- / row-parallel, bias (GELU between)

Names and layouts are the bridge name table's (`dsv4flash_bridge.mapping`, part "vision"). The ViT has its
own `TransformerConfig` (its widths, the text model's tensor-parallel size and dtype, no other parallelism:
it runs whole on the first pipeline stage).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal

from dsv4flash.integrations.mcore.csa2.modules import KeepFP32
from dsv4flash.model.norm import RMSNorm
from dsv4flash.model.vision import apply_rope2d, merge_neighbourhoods, rope2d_angles

__all__ = ["vision_transformer_config", "DSV41VisionModel", "DSV41VisionProjection", "split_images"]


def vision_transformer_config(config: Any) -> TransformerConfig:
    """The ViT's `TransformerConfig` from the text model's (its V4.1 `vision_config` widths)."""
    v = config.dsv4.vision
    init = init_method_normal(config.dsv4.text.initializer_range)  # REF: every ViT/aligner linear ~ N(0, std)
    return TransformerConfig(
        num_layers=v.num_hidden_layers, hidden_size=v.hidden_size, num_attention_heads=v.num_attention_heads,
        num_query_groups=v.num_attention_heads, kv_channels=v.head_dim, ffn_hidden_size=v.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=v.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=True, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        init_method=init, output_layer_init_method=init,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
        use_cpu_initialization=config.use_cpu_initialization, perform_initialization=config.perform_initialization,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def _column(config: TransformerConfig, n_in: int, n_out: int, bias: bool, name: str) -> ColumnParallelLinear:
    return ColumnParallelLinear(n_in, n_out, config=config, init_method=config.init_method, bias=bias,
                                skip_bias_add=False, gather_output=False, tp_comm_buffer_name=name)


def _row(config: TransformerConfig, n_in: int, n_out: int, bias: bool, name: str) -> RowParallelLinear:
    return RowParallelLinear(n_in, n_out, config=config, init_method=config.output_layer_init_method, bias=bias,
                             skip_bias_add=False, input_is_parallel=True, tp_comm_buffer_name=name)


def _out(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


class VisionSelfAttention(MegatronModule):
    """Bidirectional attention over one image's patches, 2D RoPE on q and k, this rank's heads."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.head_dim = config.kv_channels
        self.local_heads = divide(config.num_attention_heads, config.tensor_model_parallel_size)
        self.linear_qkv = _column(config, config.hidden_size, 3 * config.hidden_size, True, "vision_qkv")
        self.linear_proj = _row(config, config.hidden_size, config.hidden_size, True, "vision_proj")

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [N, C], angles [N, hd/2] -> [N, C]."""
        n = x.shape[0]
        qkv = _out(self.linear_qkv(x)).view(n, self.local_heads, 3, self.head_dim)  # per head [q ; k ; v]
        q, k, v = qkv.unbind(2)  # [N, h, hd] each
        q, k = apply_rope2d(q, angles), apply_rope2d(k, angles)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [h, N, hd]
        return _out(self.linear_proj(o.transpose(0, 1).reshape(n, -1)))


class VisionMLP(MegatronModule):
    """SwiGLU: linear_fc2(silu(gate) · up), linear_fc1 holding this rank's [gate_i ; up_i]."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.linear_fc1 = _column(config, config.hidden_size, 2 * config.ffn_hidden_size, False, "vision_fc1")
        self.linear_fc2 = _row(config, config.ffn_hidden_size, config.hidden_size, False, "vision_fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C] -> [N, C]."""
        gate, up = _out(self.linear_fc1(x)).chunk(2, dim=-1)
        return _out(self.linear_fc2(F.silu(gate) * up))


class VisionLayer(MegatronModule):
    """Pre-norm block: x += attn(norm1(x)); x += mlp(norm2(x))."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        eps = config.layernorm_epsilon
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=torch.float32)  # fp32 as REF
        self.self_attention = VisionSelfAttention(config)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, eps, dtype=torch.float32)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [N, C] -> [N, C]."""
        x = x + self.self_attention(self.input_layernorm(x), angles)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class VisionEncoder(MegatronModule):
    """The ViT blocks and the final norm (`decoder.layers`, `decoder.final_layernorm`)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        self.layers = torch.nn.ModuleList(VisionLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon, dtype=torch.float32)


class DSV41VisionModel(KeepFP32, MegatronModule):
    """ViT: patch_embed -> decoder.layers -> decoder.final_layernorm over one image's row-major patch grid."""

    def __init__(self, config: TransformerConfig, patch_size: int, rope_theta: float) -> None:
        super().__init__(config)
        self.patch_size, self.rope_theta = patch_size, float(rope_theta)
        self.patch_embed = torch.nn.Module()
        self.patch_embed.proj = torch.nn.Linear(3 * patch_size ** 2, config.hidden_size, bias=True,
                                                dtype=config.params_dtype)  # replicated: every rank embeds all
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.patch_embed.proj.weight)
                self.patch_embed.proj.bias.zero_()
        self.decoder = VisionEncoder(config)
        self._fp32_params = tuple(n for n, _ in self.named_parameters() if "layernorm" in n)

    def forward(self, patches: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """patches [n_h*n_w, 3·p·p] (row-major grid, channel-major patch) -> features [n_h*n_w, C]."""
        n_h, n_w = (int(g) for g in grid_hw)
        in_dim = self.patch_embed.proj.in_features
        if patches.ndim != 2 or patches.shape != (n_h * n_w, in_dim):
            raise ValueError(f"DSV41VisionModel: patches must be [{n_h}*{n_w}={n_h * n_w}, {in_dim}] for grid "
                             f"{(n_h, n_w)}, got {list(patches.shape)}")
        x = self.patch_embed.proj(patches.to(self.patch_embed.proj.weight.dtype))  # [N, C]
        angles = rope2d_angles(n_h, n_w, self.config.kv_channels, self.rope_theta, device=x.device)  # [N, hd/2]
        for layer in self.decoder.layers:
            x = layer(x, angles)
        return self.decoder.final_layernorm(x)


class DSV41VisionProjection(MegatronModule):
    """The 3×3 aligner: merge each neighbourhood, then linear_fc2(GELU(linear_fc1(cells))) into the text width."""

    def __init__(self, vision_config: TransformerConfig, text_hidden: int, ratio: int) -> None:
        config = dataclasses.replace(vision_config, hidden_size=text_hidden, ffn_hidden_size=text_hidden)
        super().__init__(config)
        self.ratio, self.vision_hidden = ratio, vision_config.hidden_size
        self.encoder = torch.nn.Module()
        self.encoder.linear_fc1 = _column(config, self.vision_hidden * ratio ** 2, text_hidden, True, "aligner_fc1")
        self.encoder.linear_fc2 = _row(config, text_hidden, text_hidden, True, "aligner_fc2")

    def forward(self, features: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """features [n_h*n_w, C] -> LLM rows [H'*W', D] in reading order."""
        cells = merge_neighbourhoods(features, grid_hw, self.ratio, self.vision_hidden)  # [H'W', C·r²]
        hidden = F.gelu(_out(self.encoder.linear_fc1(cells.to(self.encoder.linear_fc1.weight.dtype))))  # erf GELU
        return _out(self.encoder.linear_fc2(hidden))


def split_images(pixel_values: torch.Tensor, image_grid_hw: Any) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """pixel_values [Σ n_h·n_w, 3·p·p] (images concatenated) + image_grid_hw [n_images, 2] -> per-image pairs."""
    grids: Sequence = image_grid_hw.tolist() if torch.is_tensor(image_grid_hw) else list(image_grid_hw)
    sizes = [int(h) * int(w) for h, w in grids]
    if pixel_values.ndim != 2 or pixel_values.shape[0] != sum(sizes):
        raise ValueError(f"pixel_values must be [{sum(sizes)}, 3*p*p] for image_grid_hw {grids}, "
                         f"got {list(pixel_values.shape)}")
    return [(p, (int(h), int(w))) for p, (h, w) in zip(pixel_values.split(sizes), grids)]
