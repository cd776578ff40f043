# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""DeepSeek-V4.1 vision tower (ViT) and 3x3 aligner as megatron-core modules.

The ViT embeds one image's row-major patch grid with a replicated linear (no convolution), runs pre-norm
blocks of bidirectional attention with 2D rotate-half RoPE (rows and columns each get a quarter of the head's
lanes) and a bias-free SwiGLU MLP, and ends in an RMSNorm; every RMSNorm keeps an fp32 weight and computes in
fp32. Attention never crosses images. The aligner folds each 3x3 patch neighbourhood (zero-padded at the right
and bottom edges) into one language-model token: ``linear_fc2(gelu(linear_fc1(cells)))``, megatron-core's
``MultimodalProjector``. Attention and MLP linears are megatron-core's column/row-parallel linears, so tensor
parallelism splits the ViT's heads and MLP and the aligner's hidden width.

Parameter names::

    vision_model.patch_embed.proj                        replicated Linear(3*p*p -> C), bias
    vision_model.decoder.layers.{i}.input_layernorm      fp32 RMSNorm
        .self_attention.linear_qkv                       column-parallel, per head [q_h ; k_h ; v_h], bias
        .self_attention.linear_proj                      row-parallel, bias
        .pre_mlp_layernorm                               fp32 RMSNorm
        .mlp.linear_fc1 / .mlp.linear_fc2                column-parallel [gate_i ; up_i] / row-parallel, no bias
    vision_model.decoder.final_layernorm                 fp32 RMSNorm
    vision_projection.encoder.linear_fc1 / linear_fc2    column- / row-parallel, bias (exact GELU between)
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal


def get_deepseek_v41_vision_config(provider: Any) -> TransformerConfig:
    """The ViT's ``TransformerConfig``: the provider's ``vision_*`` widths, TP size and dtype, no other parallelism."""
    init = init_method_normal(provider.init_method_std)  # every ViT / aligner linear ~ N(0, std), biases 0
    return TransformerConfig(
        num_layers=provider.vision_num_layers,
        hidden_size=provider.vision_hidden_size,
        num_attention_heads=provider.vision_num_attention_heads,
        num_query_groups=provider.vision_num_attention_heads,
        kv_channels=provider.vision_hidden_size // provider.vision_num_attention_heads,
        ffn_hidden_size=provider.vision_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=provider.vision_layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,  # the SwiGLU MLP has no biases; attention linears take bias=True explicitly
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method=init,
        output_layer_init_method=init,
        tensor_model_parallel_size=provider.tensor_model_parallel_size,
        params_dtype=provider.params_dtype,
        bf16=provider.bf16,
        fp16=provider.fp16,
        use_cpu_initialization=provider.use_cpu_initialization,
        perform_initialization=provider.perform_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def get_deepseek_v41_vision_projection_config(vision_config: TransformerConfig, language_hidden_size: int):
    """The aligner's config: hidden and FFN width of the language model, exact GELU, biases."""
    return dataclasses.replace(
        vision_config,
        hidden_size=language_hidden_size,
        ffn_hidden_size=language_hidden_size,
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
    )


def rope2d_angles(n_h: int, n_w: int, head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Angles [n_h*n_w, head_dim/2] in fp32: per patch (row-major), [row * inv_freq, col * inv_freq]."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4, got {head_dim}")
    rope_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    rows = torch.arange(n_h, dtype=torch.float32, device=device).repeat_interleave(n_w)  # [N]
    cols = torch.arange(n_w, dtype=torch.float32, device=device).repeat(n_h)  # [N]
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [N, rope_dim]


def apply_rope2d(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the whole head in fp32: x [N, H, hd], angles [N, hd/2] -> [N, H, hd]."""
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # [N, 1, hd/2]
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def merge_neighbourhoods(features: torch.Tensor, grid_hw: Tuple[int, int], ratio: int) -> torch.Tensor:
    """features [n_h*n_w, C] -> cells [H'*W', C*r*r], lane c*r*r + kh*r + kw, zero-padded right and bottom."""
    n_h, n_w = (int(g) for g in grid_hw)
    hidden = features.shape[-1]
    if features.ndim != 2 or features.shape[0] != n_h * n_w:
        raise ValueError(f"vision features must be [{n_h * n_w}, C] for grid {(n_h, n_w)}, got {list(features.shape)}")
    grid = features.reshape(n_h, n_w, hidden).permute(2, 0, 1)  # [C, n_h, n_w]
    grid = F.pad(grid, (0, -n_w % ratio, 0, -n_h % ratio))
    cells = F.unfold(grid.unsqueeze(0), kernel_size=ratio, stride=ratio)  # [1, C*r*r, H'*W']
    return cells.squeeze(0).transpose(0, 1)


def split_images(pixel_values: torch.Tensor, image_grid_hw: Any) -> List[Tuple[torch.Tensor, Tuple[int, int]]]:
    """pixel_values [sum n_h*n_w, 3*p*p] (images concatenated) + image_grid_hw [n_images, 2] -> per-image pairs."""
    grids = image_grid_hw.tolist() if torch.is_tensor(image_grid_hw) else [list(g) for g in image_grid_hw]
    sizes = [int(h) * int(w) for h, w in grids]
    if pixel_values.ndim != 2 or pixel_values.shape[0] != sum(sizes):
        raise ValueError(
            f"pixel_values must be [{sum(sizes)}, 3*p*p] for image_grid_hw {grids}, got {list(pixel_values.shape)}"
        )
    return [(p, (int(h), int(w))) for p, (h, w) in zip(pixel_values.split(sizes), grids)]


class DeepSeekV41VisionRMSNorm(torch.nn.Module):
    """``weight * x * rsqrt(mean(x^2) + eps)`` in fp32, cast back; the weight stays fp32 through dtype casts."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # Float16Module / .bfloat16() cast every parameter; the release computes ViT norms with fp32 weights, so a
        # cast puts back the fp32 values it had (not their rounded copy).
        before = self.weight.data
        module = super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            kept = before if before.dtype == torch.float32 else self.weight.data
            self.weight.data = kept.to(device=self.weight.device, dtype=torch.float32)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


@dataclass
class DeepSeekV41VisionSelfAttentionSubmodules:
    """The fused qkv and output linears of the ViT attention."""

    linear_qkv: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


class DeepSeekV41VisionSelfAttention(MegatronModule):
    """Bidirectional attention over one image's patches, 2D RoPE on q and k, this rank's heads."""

    def __init__(self, config: TransformerConfig, submodules: DeepSeekV41VisionSelfAttentionSubmodules) -> None:
        super().__init__(config=config)
        self.head_dim = config.kv_channels
        self.local_heads = divide(config.num_attention_heads, config.tensor_model_parallel_size)
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            3 * config.hidden_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=True,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="vision_qkv",
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            config.hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="vision_proj",
        )

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [N, C], angles [N, hd/2] -> [N, C]."""
        n = x.shape[0]
        qkv, _ = self.linear_qkv(x)
        q, k, v = qkv.view(n, self.local_heads, 3, self.head_dim).unbind(2)  # [N, h, hd] each
        q, k = apply_rope2d(q, angles), apply_rope2d(k, angles)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))  # [h, N, hd]
        out, _ = self.linear_proj(out.transpose(0, 1).reshape(n, -1))
        return out


@dataclass
class DeepSeekV41VisionLayerSubmodules:
    """Norms, attention and MLP of one ViT block."""

    input_layernorm: Union[ModuleSpec, type] = None
    self_attention: Union[ModuleSpec, type] = None
    pre_mlp_layernorm: Union[ModuleSpec, type] = None
    mlp: Union[ModuleSpec, type] = None


class DeepSeekV41VisionTransformerLayer(MegatronModule):
    """Pre-norm ViT block: x += attn(norm(x)); x += mlp(norm(x))."""

    def __init__(self, config: TransformerConfig, submodules: DeepSeekV41VisionLayerSubmodules) -> None:
        super().__init__(config=config)
        eps = config.layernorm_epsilon
        self.input_layernorm = build_module(submodules.input_layernorm, config, config.hidden_size, eps=eps)
        self.self_attention = build_module(submodules.self_attention, config=config)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, config.hidden_size, eps=eps)
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """x [N, C] -> [N, C]."""
        x = x + self.self_attention(self.input_layernorm(x), angles)
        out, bias = self.mlp(self.pre_mlp_layernorm(x))
        return x + (out if bias is None else out + bias)


def get_deepseek_v41_vision_layer_spec() -> ModuleSpec:
    """ViT block with megatron-core's local column/row-parallel linears."""
    return ModuleSpec(
        module=DeepSeekV41VisionTransformerLayer,
        submodules=DeepSeekV41VisionLayerSubmodules(
            input_layernorm=DeepSeekV41VisionRMSNorm,
            self_attention=ModuleSpec(
                module=DeepSeekV41VisionSelfAttention,
                submodules=DeepSeekV41VisionSelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, linear_proj=RowParallelLinear
                ),
            ),
            pre_mlp_layernorm=DeepSeekV41VisionRMSNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
        ),
    )


def get_deepseek_v41_vision_projection_spec() -> MLPSubmodules:
    """The aligner's two linears (``MultimodalProjector`` of type ``mlp``)."""
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


class _VisionEncoder(torch.nn.Module):
    """The ViT blocks and the final norm (``decoder.layers``, ``decoder.final_layernorm``)."""

    def __init__(self, config: TransformerConfig, layer_spec: ModuleSpec) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(build_module(layer_spec, config=config) for _ in range(config.num_layers))
        self.final_layernorm = DeepSeekV41VisionRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


class DeepSeekV41VisionModel(MegatronModule):
    """ViT: patch_embed -> decoder.layers -> decoder.final_layernorm over one image's row-major patch grid."""

    def __init__(
        self, config: TransformerConfig, layer_spec: ModuleSpec, patch_size: int, rope_theta: float
    ) -> None:
        super().__init__(config=config)
        self.patch_size, self.rope_theta = patch_size, float(rope_theta)
        self.patch_embed = torch.nn.Module()
        # Replicated: every TP rank embeds the whole image.
        self.patch_embed.proj = torch.nn.Linear(
            3 * patch_size**2, config.hidden_size, bias=True, dtype=config.params_dtype
        )
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.patch_embed.proj.weight)
                self.patch_embed.proj.bias.zero_()
        self.decoder = _VisionEncoder(config, layer_spec)

    def forward(self, patches: torch.Tensor, grid_hw: Tuple[int, int]) -> torch.Tensor:
        """patches [n_h*n_w, 3*p*p] (row-major grid, channel-major patch) -> features [n_h*n_w, C]."""
        n_h, n_w = (int(g) for g in grid_hw)
        in_dim = self.patch_embed.proj.in_features
        if patches.ndim != 2 or tuple(patches.shape) != (n_h * n_w, in_dim):
            raise ValueError(
                f"pixel_values of an image with grid {(n_h, n_w)} must be [{n_h * n_w}, {in_dim}], "
                f"got {list(patches.shape)}"
            )
        x = self.patch_embed.proj(patches.to(self.patch_embed.proj.weight.dtype))  # [N, C]
        angles = rope2d_angles(n_h, n_w, self.config.kv_channels, self.rope_theta, device=x.device)  # [N, hd/2]
        for layer in self.decoder.layers:
            x = layer(x, angles)
        return self.decoder.final_layernorm(x)


class DeepSeekV41VisionProjection(MultimodalProjector):
    """The 3x3 aligner: merge each neighbourhood, then ``linear_fc2(gelu(linear_fc1(cells)))`` (bias both)."""

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, vision_hidden_size: int, ratio: int):
        super().__init__(config, submodules, projector_type="mlp", input_size=vision_hidden_size * ratio**2)
        self.ratio = ratio

    def forward(self, features: torch.Tensor, grid_hw: Tuple[int, int]) -> torch.Tensor:
        """features [n_h*n_w, C] -> language-model rows [H'*W', D] in reading order."""
        cells = merge_neighbourhoods(features, grid_hw, self.ratio)  # [H'W', C*r*r]
        return super().forward(cells.to(self.encoder.linear_fc1.weight.dtype))


def encode_images(
    vision_model: DeepSeekV41VisionModel,
    vision_projection: DeepSeekV41VisionProjection,
    images: Sequence[Tuple[torch.Tensor, Tuple[int, int]]],
) -> List[torch.Tensor]:
    """ViT + aligner per image (attention never crosses images) -> list of [H'*W', D]."""
    return [vision_projection(vision_model(patches, grid), grid) for patches, grid in images]
