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

"""Model provider for DeepSeek-V4.1 on megatron-core's CSA2 attention and mHC layers.

The provider is a ``GPTModelProvider`` whose config is megatron-core's ``CSA2TransformerConfig``: every
layer is a ``HyperConnectionTransformerLayer`` with ``CSA2SelfAttention`` and a MoE MLP, built from
``get_csa2_decoder_block_spec``; the layers in ``engram_layer_ids`` add their Engram lookup to the streams first
(``deepseek_v41_engram``). With ``vision_num_layers > 0`` ``provide()`` returns a ``DeepSeekV41VLModel`` (that
GPTModel as ``language_model``, plus the ViT and the 3x3 aligner of ``deepseek_v41_vision``).
``csa2_layer_pattern_from_hf`` turns the V4.1 per-layer fields
(``compress_ratios``, ``kv_source_layer_ids``, ``index_source_layer_ids``, ``candidate_source_layer_id``)
into megatron-core's layer pattern.
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.csa2_layer_specs import get_csa2_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.experimental_attention_variant.csa2 import CSA2TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron.bridge.models.deepseek_v41.deepseek_v41_engram import attach_engram, with_engram_layers
from megatron.bridge.models.deepseek_v41.deepseek_v41_vl_model import DeepSeekV41VLModel
from megatron.bridge.models.gpt_provider import GPTModelProvider


def get_deepseek_v41_decoder_block_spec(config: "DeepSeekV41ModelProvider") -> TransformerBlockSubmodules:
    """The CSA2 / mHC block spec with Engram layers at ``config.engram_layer_ids``."""
    block = get_csa2_decoder_block_spec(config)
    block.layer_specs = with_engram_layers(block.layer_specs, config.engram_layer_ids)
    return block


def csa2_layer_pattern_from_hf(
    compress_ratios: Sequence[int],
    kv_source_layer_ids: Sequence[int],
    index_source_layer_ids: Sequence[int],
    candidate_source_layer_id: Optional[int],
) -> str:
    """One ``csa2_layer_pattern`` character per decoder layer of a V4.1 config.

    Ratio 0 is window-only (S); a kv source compresses keys (F); an index source that is not a kv source
    re-runs the indexer (I); any other compressed layer reuses the top-k below it (R). The candidate
    source compresses keys and builds the candidate pool that later index layers search (C); while no
    later layer reads that pool it is an F layer.
    """
    kv, index = set(kv_source_layer_ids), set(index_source_layer_ids)
    pattern = []
    for layer, ratio in enumerate(compress_ratios):
        if ratio == 0:
            pattern.append("S")
        elif layer in kv:
            pattern.append("F")
        elif layer in index:
            pattern.append("I")
        else:
            pattern.append("R")
    source = candidate_source_layer_id
    if source is not None and any(i > source for i in index - kv):
        if source not in kv:
            raise ValueError(f"candidate_source_layer_id {source} must be a kv source ({sorted(kv)})")
        later_kv = [k for k in kv if k > source]
        if later_kv and any(i > min(later_kv) for i in index - kv):
            # megatron-core's pool ends at the next F layer; V4.1 index layers would keep searching it.
            raise ValueError(
                f"candidate_source_layer_id {source}: index layers after kv source {min(later_kv)} search "
                "its candidate pool, which csa2_layer_pattern cannot express"
            )
        pattern[source] = "C"
    return "".join(pattern)


@dataclass
class DeepSeekV41ModelProvider(CSA2TransformerConfig, GPTModelProvider):
    """DeepSeek-V4.1 text decoder: CSA2 attention and a sqrtsoftplus MoE on mHC residual streams."""

    transformer_layer_spec: Callable = get_deepseek_v41_decoder_block_spec
    position_embedding_type: str = "none"  # RoPE is applied inside CSA2 attention
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    num_query_groups: int = 1
    share_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    moe_router_score_function: str = "sqrtsoftplus"
    moe_router_enable_expert_bias: bool = True
    moe_router_bias_update_rate: float = 0.0  # the released selection biases are kept
    moe_router_dtype: str = "fp32"
    moe_router_load_balancing_type: str = "none"
    moe_aux_loss_coeff: float = 0.0
    moe_token_dispatcher_type: str = "alltoall"
    moe_grouped_gemm: bool = False

    # The fused SwiGLU kernels ignore activation_func_clamp_value (the V4.1 swiglu_limit).
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False
    masked_softmax_fusion: bool = False
    apply_rope_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    persist_layer_norm: bool = False
    cross_entropy_loss_fusion: bool = False

    params_dtype: torch.dtype = torch.bfloat16
    bf16: bool = True

    # Engram (0-based layer ids; one table of engram_num_embeddings[i] rows per layer).
    engram_layer_ids: List[int] = field(default_factory=list)
    engram_num_embeddings: List[int] = field(default_factory=list)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    engram_host_resident_table: bool = True  # megatron-core's HostRowLookupTable; False: an ordinary parameter

    # Vision tower and aligner (0 layers: a text-only model, provide() returns the plain GPTModel).
    vision_num_layers: int = 0
    vision_hidden_size: int = 1024
    vision_num_attention_heads: int = 16
    vision_ffn_hidden_size: int = 4096
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_layernorm_epsilon: float = 1e-6
    vision_downsample_ratio: int = 3
    freeze_language_model: bool = False
    freeze_vision_model: bool = False
    freeze_vision_projection: bool = False

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> Union[GPTModel, DeepSeekV41VLModel]:
        """The GPTModel, or with a vision tower the ``DeepSeekV41VLModel`` around it."""
        if not self.vision_num_layers:
            return self.provide_language_model(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        model = DeepSeekV41VLModel(self, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if self.freeze_language_model or self.freeze_vision_model or self.freeze_vision_projection:
            model.freeze(self.freeze_language_model, self.freeze_vision_model, self.freeze_vision_projection)
        return model

    def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
        """The GPTModel; with Engram layers, its forward hashes ``input_ids`` (and takes ``token_types``)."""
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(
                f"engram_num_embeddings has {len(self.engram_num_embeddings)} entries, engram_layer_ids "
                f"{len(self.engram_layer_ids)}"
            )
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if self.engram_layer_ids:
            attach_engram(model)
        return model
