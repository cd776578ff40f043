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

"""Bridge for DeepSeek-V4.1 (``DeepseekV41ForCausalLM``) onto megatron-core's CSA2 attention and mHC layers.

The release checkpoint uses the DeepSeek-V4 serialisation (``embed``, ``layers.N.attn.*``,
``layers.N.ffn.*``, ``layers.N.hc_attn_*`` / ``hc_ffn_*``, ``norm``, ``head``) with a nested HF config
(``text_config``, ``vision_config``). Unlike DeepSeek-V4 there is no ``hc_head_*``: the last layer collapses
its streams with its MLP-site ``pre`` coefficients.

Quantisation: dense weights are FP8 E4M3 over 32x32 blocks with UE8M0 scales (``quantization_config.
weight_block_size``), routed experts MXFP4 (1x32, E8M0); other tensors are BF16 or FP32. Import decodes each
``.weight``/``.scale`` pair with that block size; export re-encodes with the checkpoint's scale geometry
and casts the other tensors back to their stored dtype.

Engram tables (``layers.N.engram.embed``) are FP8 with one E8M0 scale per row and 32 columns; at release size
they hold ~384 M rows, so import reads and decodes them ``ENGRAM_ROWS_PER_READ`` rows at a time
(``StateDict.load_rows``), and export yields them as ``TensorRowChunk``s of ``ENGRAM_ROWS_PER_READ`` rows (each
weight chunk, then its scale chunk), which ``SafeTensorsStateSource.save_generator`` spools to the shard.

Vision: with ``vision_config.num_hidden_layers > 0`` the provider builds a ``DeepSeekV41VLModel``; the text
decoder's parameters then sit under ``language_model.`` and the release's ``vision.*`` (ViT), ``aligner.*`` and
``image_start`` / ``image_newline`` / ``image_end`` tensors map onto ``vision_model.*``, ``vision_projection.*``
and the model's delimiter vectors (BF16 in the release, exported back in their stored dtype). The ViT's fused
``wqkv`` ([q ; k ; v]) becomes megatron-core's per-head [q_h ; k_h ; v_h] and its fused ``w1`` ([gate ; up])
the per-rank [gate_i ; up_i] of a gated ``linear_fc1``.

Covered: the text decoder, every CSA2 layer kind the release uses (window-only S, compressing F, compressing
and pooling C, re-indexing I, reusing R), YaRN on compressed layers, Engram layers, the vision tower and
aligner. Not covered yet: draft (MTP) layers; such configs are refused with an error naming the field.
"""

from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron.bridge.models.conversion import quantization_utils
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import HFWeightTuple, MegatronModelBridge, WeightConversionTask
from megatron.bridge.models.conversion.param_mapping import (
    ColumnParallelMapping,
    ConcatenatedQKVMapping,
    GatedMLPMapping,
    MegatronParamMapping,
    ReplicatedMapping,
    RowParallelMapping,
)
from megatron.bridge.models.conversion.utils import unwrap_model
from megatron.bridge.models.deepseek_v41.deepseek_v41_provider import (
    DeepSeekV41ModelProvider,
    csa2_layer_pattern_from_hf,
)
from megatron.bridge.models.deepseek_v41.deepseek_v41_vl_model import IMAGE_DELIMITERS, DeepSeekV41VLModel
from megatron.bridge.models.hf_pretrained.row_chunks import TensorRowChunk


ENGRAM_ROWS_PER_READ = 1 << 16
ENGRAM_FIELDS = (
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_max_ngram_size",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_pad_token_id",
    "engram_compressed_vocab_size",
)


def _field(config: Any, key: str, default: Any = None) -> Any:
    """``key`` of a config given as a PretrainedConfig or a plain dict."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _text_config(hf_config: Any) -> Any:
    return _field(hf_config, "text_config") or hf_config


def _block_size(hf_config: Any) -> int:
    """FP8 block edge of the checkpoint (``quantization_config.weight_block_size``), square blocks only."""
    block = _field(_field(hf_config, "quantization_config") or {}, "weight_block_size") or [32, 32]
    if len(block) != 2 or block[0] != block[1]:
        raise ValueError(f"quantization_config.weight_block_size: expected square blocks, got {block}")
    return int(block[0])


def _use_mxfp4_export(hf_param: str, weight: torch.Tensor, source_scale: torch.Tensor) -> bool:
    """Routed experts are packed MXFP4; every other scaled weight is FP8."""
    if ".ffn.experts." not in hf_param:
        return False
    return quantization_utils.is_mxfp4_e2m1_scale_geometry(weight, source_scale)


def provider_kwargs_from_hf(hf_config: Any) -> Dict[str, Any]:
    """``DeepSeekV41ModelProvider`` fields for a V4.1 HF config (raises on parts this bridge cannot build)."""
    text = _text_config(hf_config)
    if _field(text, "num_nextn_predict_layers", 0):
        raise ValueError("text_config.num_nextn_predict_layers: draft (MTP) layers are not mapped by this bridge")
    if _field(text, "n_shared_experts", 1) != 1:
        raise ValueError("text_config.n_shared_experts: V4.1 has exactly one shared expert")
    if not _field(text, "norm_topk_prob", True) and _field(text, "num_experts_per_tok") > 1:
        raise ValueError("text_config.norm_topk_prob: megatron-core's sqrtsoftplus router normalises the top-k")
    num_layers = _field(text, "num_hidden_layers")
    ratios = [int(r) for r in _field(text, "compress_ratios")][:num_layers]
    pattern = csa2_layer_pattern_from_hf(
        ratios,
        _field(text, "kv_source_layer_ids"),
        _field(text, "index_source_layer_ids"),
        _field(text, "candidate_source_layer_id"),
    )
    kwargs = dict(
        num_layers=num_layers,
        hidden_size=_field(text, "hidden_size"),
        num_attention_heads=_field(text, "num_attention_heads"),
        num_query_groups=_field(text, "num_key_value_heads", 1),
        kv_channels=_field(text, "head_dim"),
        ffn_hidden_size=_field(text, "moe_intermediate_size"),
        layernorm_epsilon=_field(text, "rms_norm_eps"),
        init_method_std=_field(text, "initializer_range", 0.02),
        vocab_size=_field(text, "vocab_size"),
        seq_length=_field(text, "max_position_embeddings"),
        share_embeddings_and_output_weights=bool(_field(text, "tie_word_embeddings", False)),
        activation_func_clamp_value=_field(text, "swiglu_limit"),
        num_moe_experts=_field(text, "n_routed_experts"),
        moe_ffn_hidden_size=_field(text, "moe_intermediate_size"),
        moe_shared_expert_intermediate_size=_field(text, "moe_intermediate_size"),
        moe_router_topk=_field(text, "num_experts_per_tok"),
        moe_router_topk_scaling_factor=_field(text, "routed_scaling_factor"),
        hc_mult=_field(text, "hc_mult"),
        hc_sinkhorn_iters=_field(text, "hc_sinkhorn_iters"),
        hc_eps=_field(text, "hc_eps"),
        csa2_layer_pattern=pattern,
        csa2_compress_ratios=ratios,
        csa2_q_lora_rank=_field(text, "q_lora_rank"),
        csa2_rope_dim=_field(text, "qk_rope_head_dim"),
        csa2_rope_theta=float(_field(text, "rope_theta")),
        csa2_compressed_rope_theta=float(_field(text, "compress_rope_theta")),
        csa2_sliding_window=_field(text, "sliding_window"),
        csa2_output_groups=_field(text, "o_groups"),
        csa2_output_rank=_field(text, "o_lora_rank"),
        csa2_index_heads=_field(text, "index_n_heads"),
        csa2_index_head_dim=_field(text, "index_head_dim"),
        csa2_index_topk=_field(text, "index_topk"),
        csa2_candidate_block_size=_field(text, "candidate_block_size"),
        csa2_candidate_topk_blocks=_field(text, "candidate_topk_blocks"),
    )
    if _field(text, "engram_layer_ids"):
        for name in ENGRAM_FIELDS:
            if _field(text, name) is None:
                raise ValueError(f"text_config.{name}: required with engram_layer_ids")
            kwargs[name] = list(_field(text, name)) if name.endswith(("_ids", "_embeddings")) else _field(text, name)
    kwargs.update(vision_provider_kwargs_from_hf(hf_config))
    rope_scaling = _field(text, "rope_scaling") or {}
    factor = float(_field(rope_scaling, "factor", 1.0) or 1.0)
    if factor != 1.0:  # the release applies YaRN on every compressed layer
        kwargs.update(
            csa2_yarn_factor=factor,
            csa2_yarn_original_max_position_embeddings=_field(rope_scaling, "original_max_position_embeddings"),
            csa2_yarn_beta_fast=float(_field(rope_scaling, "beta_fast", 32)),
            csa2_yarn_beta_slow=float(_field(rope_scaling, "beta_slow", 1)),
        )
    return kwargs


def _has_vision(hf_config: Any) -> bool:
    return bool(_field(_field(hf_config, "vision_config") or {}, "num_hidden_layers", 0))


def vision_provider_kwargs_from_hf(hf_config: Any) -> Dict[str, Any]:
    """``vision_*`` provider fields of the HF ``vision_config`` (none for a text-only checkpoint)."""
    if not _has_vision(hf_config):
        return {}
    vision = _field(hf_config, "vision_config")
    fields = dict(
        vision_num_layers="num_hidden_layers",
        vision_hidden_size="hidden_size",
        vision_num_attention_heads="num_attention_heads",
        vision_ffn_hidden_size="intermediate_size",
        vision_patch_size="patch_size",
        vision_downsample_ratio="downsample_ratio",
    )
    kwargs = {}
    for name, hf_name in fields.items():
        if _field(vision, hf_name) is None:
            raise ValueError(f"vision_config.{hf_name}: required with a vision tower (num_hidden_layers > 0)")
        kwargs[name] = int(_field(vision, hf_name))
    if kwargs["vision_hidden_size"] % (4 * kwargs["vision_num_attention_heads"]):
        raise ValueError(
            f"vision_config.hidden_size {kwargs['vision_hidden_size']}: the head width (hidden_size / "
            f"num_attention_heads {kwargs['vision_num_attention_heads']}) must be divisible by 4 for 2D RoPE"
        )
    kwargs.update(
        vision_rope_theta=float(_field(vision, "rope_theta", 10000.0)),
        vision_layernorm_epsilon=float(_field(vision, "rms_norm_eps", 1e-6)),
        scatter_embedding_sequence_parallel=False,  # the VL model scatters after writing the images
    )
    return kwargs


class FusedGatedMLPMapping(MegatronParamMapping[torch.Tensor]):
    """One HF tensor ``[gate ; up]`` <-> a gated ``linear_fc1`` whose TP rank i holds ``[gate_i ; up_i]``."""

    def __init__(self, megatron_param: str, hf_param: str):
        super().__init__(megatron_param, hf_param)
        self._tp_mapping = ColumnParallelMapping(megatron_param, megatron_param)

    def _per_rank(self, fused: torch.Tensor) -> torch.Tensor:
        gate, up = fused.chunk(2, dim=0)
        return torch.cat([torch.cat(pair) for pair in zip(gate.chunk(self.tp_size), up.chunk(self.tp_size))])

    def _fused(self, per_rank: torch.Tensor) -> torch.Tensor:
        pairs = [shard.chunk(2, dim=0) for shard in per_rank.chunk(self.tp_size, dim=0)]
        return torch.cat([gate for gate, _ in pairs] + [up for _, up in pairs])

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: torch.nn.Module) -> torch.Tensor:
        """Reorder ``[gate ; up]`` into per-rank pairs, then split along dim 0."""
        if self.tp_rank == 0:
            if hf_weights.shape[0] % (2 * self.tp_size):
                raise ValueError(
                    f"{self.hf_param}: {hf_weights.shape[0]} rows do not split into gate and up over "
                    f"{self.tp_size} TP ranks"
                )
            hf_weights = self._per_rank(hf_weights)
        return self._tp_mapping.hf_to_megatron(hf_weights, megatron_module)

    def megatron_to_hf(self, megatron_weights, megatron_module) -> Dict[str, torch.Tensor]:
        """Gather the TP shards and restore ``[gate ; up]``."""
        gathered = self._tp_mapping.megatron_to_hf(megatron_weights, megatron_module)
        if not gathered:
            return {}
        return {str(self.hf_param): self._fused(next(iter(gathered.values())))}

    def resolve(self, captures) -> "FusedGatedMLPMapping":
        """A resolved copy for the captured wildcards."""
        megatron_param, hf_param = self._resolve_names(captures)
        return type(self)(megatron_param, hf_param)


def _vision_mappings() -> List[MegatronParamMapping]:
    """Release ``vision.*`` / ``aligner.*`` / image delimiters <-> ``DeepSeekV41VLModel`` parameters."""
    vit = "vision_model.decoder.layers.*"
    block = "vision.blocks.*"
    mappings = [
        ReplicatedMapping("vision_model.patch_embed.proj.weight", "vision.patch_embed.proj.weight"),
        ReplicatedMapping("vision_model.patch_embed.proj.bias", "vision.patch_embed.proj.bias"),
        ReplicatedMapping(f"{vit}.input_layernorm.weight", f"{block}.norm1.weight"),
        ConcatenatedQKVMapping(f"{vit}.self_attention.linear_qkv.weight", f"{block}.attn.wqkv.weight"),
        ConcatenatedQKVMapping(f"{vit}.self_attention.linear_qkv.bias", f"{block}.attn.wqkv.bias"),
        RowParallelMapping(f"{vit}.self_attention.linear_proj.weight", f"{block}.attn.wo.weight"),
        ReplicatedMapping(f"{vit}.self_attention.linear_proj.bias", f"{block}.attn.wo.bias"),
        ReplicatedMapping(f"{vit}.pre_mlp_layernorm.weight", f"{block}.norm2.weight"),
        FusedGatedMLPMapping(f"{vit}.mlp.linear_fc1.weight", f"{block}.mlp.w1.weight"),
        RowParallelMapping(f"{vit}.mlp.linear_fc2.weight", f"{block}.mlp.w2.weight"),
        ReplicatedMapping("vision_model.decoder.final_layernorm.weight", "vision.norm.weight"),
        ColumnParallelMapping("vision_projection.encoder.linear_fc1.weight", "aligner.w1.weight"),
        ColumnParallelMapping("vision_projection.encoder.linear_fc1.bias", "aligner.w1.bias"),
        RowParallelMapping("vision_projection.encoder.linear_fc2.weight", "aligner.w2.weight"),
        ReplicatedMapping("vision_projection.encoder.linear_fc2.bias", "aligner.w2.bias"),
    ]
    mappings += [ReplicatedMapping(name, name) for name, _ in IMAGE_DELIMITERS]
    return mappings


def _load_engram_table(hf_param: str, hf_state_dict) -> torch.Tensor:
    """An Engram table decoded to fp32, ``ENGRAM_ROWS_PER_READ`` FP8 rows and their scales per read."""
    scale_key = hf_param[: -len(".weight")] + ".scale"
    rows, cols = hf_state_dict.get_shape(hf_param)
    scale_shape = tuple(hf_state_dict.get_shape(scale_key))
    if len(scale_shape) != 2 or scale_shape[0] != rows or cols % scale_shape[1]:
        raise ValueError(f"{scale_key}: expected one scale per row and column tile of {hf_param} "
                         f"[{rows}, {cols}], got {list(scale_shape)}")
    table = torch.empty(rows, cols, dtype=torch.float32)
    for start in range(0, rows, ENGRAM_ROWS_PER_READ):
        stop = min(start + ENGRAM_ROWS_PER_READ, rows)
        table[start:stop] = quantization_utils.dequantize_fp8_e4m3fn_with_scale(
            hf_state_dict.load_rows(hf_param, start, stop),
            hf_state_dict.load_rows(scale_key, start, stop),
            name=hf_param,
            dtype=torch.float32,
        )
    return table


@MegatronModelBridge.register_bridge(
    source="DeepseekV41ForCausalLM",
    target=DeepSeekV41VLModel,
    provider=DeepSeekV41ModelProvider,
    model_type="deepseek_v41",
)
@MegatronModelBridge.register_bridge(
    source="DeepseekV41ForCausalLM",
    target=GPTModel,
    provider=DeepSeekV41ModelProvider,
    model_type="deepseek_v41",
)
class DeepSeekV41Bridge(MegatronModelBridge):
    """Megatron Bridge for DeepSeek-V4.1 release checkpoints (text decoder and vision, see the module docstring)."""

    def provider_bridge(self, hf_pretrained) -> DeepSeekV41ModelProvider:
        """A provider for the checkpoint's config, in the checkpoint's wide dtype (bf16) unless overridden."""
        hf_config = hf_pretrained.config
        dtype = _field(hf_config, "dtype") or _field(hf_config, "torch_dtype") or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return DeepSeekV41ModelProvider(
            **provider_kwargs_from_hf(hf_config),
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
        )

    def maybe_modify_loaded_hf_weight(self, hf_param, hf_state_dict: Mapping[str, torch.Tensor]):
        """Decode FP8 (block size from the config) and MXFP4 ``.weight``/``.scale`` pairs to fp32."""
        is_table = isinstance(hf_param, str) and hf_param.endswith(".engram.embed.weight")
        if is_table and hasattr(hf_state_dict, "load_rows"):  # a plain mapping is decoded whole below
            return _load_engram_table(hf_param, hf_state_dict)
        return quantization_utils.maybe_dequantize_hf_quantized_weight(
            hf_param, hf_state_dict, dtype=torch.float32, block_size=_block_size(self.hf_config)
        )

    def maybe_modify_converted_hf_weight(
        self,
        task: WeightConversionTask,
        converted_weights_dict: Dict[str, torch.Tensor],
        hf_state_dict: Mapping[str, torch.Tensor],
    ) -> Dict[str, torch.Tensor]:
        """Re-encode scaled weights like the source checkpoint; cast the others to their stored dtype."""
        if task.weight_dtype is not None:
            return converted_weights_dict
        result = quantization_utils.requantize_hf_weight_scale_pairs(
            converted_weights_dict,
            hf_state_dict,
            use_mxfp4=_use_mxfp4_export,
            block_size=_block_size(self.hf_config),
        )
        for name, tensor in result.items():
            source = hf_state_dict[name] if name in hf_state_dict else None
            if source is not None and source.dtype != tensor.dtype and source.is_floating_point():
                if tensor.dtype not in (torch.float8_e4m3fn, torch.int8):
                    result[name] = tensor.to(source.dtype)
        return result

    def stream_weights_megatron_to_hf(
        self,
        megatron_model,
        hf_pretrained,
        cpu: bool = True,
        show_progress: bool = True,
        conversion_tasks: Optional[List[Optional[WeightConversionTask]]] = None,
        merge_adapter_weights: bool = True,
        weight_dtype: Optional[torch.dtype] = None,
    ) -> Iterable[Union[HFWeightTuple, tuple]]:
        """The stock export stream; Engram tables follow it as ``(name, TensorRowChunk)`` pairs."""
        if conversion_tasks is None:
            models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
            conversion_tasks = self.build_conversion_tasks(
                hf_pretrained, unwrap_model(models), weight_dtype=weight_dtype
            )
        elif weight_dtype is not None:
            raise ValueError("weight_dtype is not supported with caller-supplied conversion_tasks")
        is_table = lambda t: t is not None and str(t.mapping.hf_param).endswith(".engram.embed.weight")  # noqa: E731
        tables = [task for task in conversion_tasks if is_table(task)]
        yield from super().stream_weights_megatron_to_hf(
            megatron_model,
            hf_pretrained,
            cpu=cpu,
            show_progress=show_progress,
            conversion_tasks=[task for task in conversion_tasks if not is_table(task)],
            merge_adapter_weights=merge_adapter_weights,
        )
        hf_state_dict = hf_pretrained.state if hasattr(hf_pretrained, "state") else {}
        for task in tables:
            yield from self._engram_table_chunks(task, hf_state_dict)

    def _engram_table_chunks(self, task: WeightConversionTask, hf_state_dict) -> Iterable[tuple]:
        """One Engram table re-encoded ``ENGRAM_ROWS_PER_READ`` rows at a time against the source's scale rows."""
        name = task.mapping.hf_param
        scale_key = name[: -len(".weight")] + ".scale"
        table = task.param_weight.detach()
        total = table.shape[0]
        encode = task.weight_dtype is None and scale_key in hf_state_dict
        stored = task.weight_dtype is None and name in hf_state_dict
        stored_dtype = hf_state_dict.load_rows(name, 0, 1).dtype if stored else None  # one row, not the table
        for start in range(0, total, ENGRAM_ROWS_PER_READ):
            stop = min(start + ENGRAM_ROWS_PER_READ, total)
            rows = table[start:stop].float().cpu()
            if encode:  # per-row scales: a chunk's encoding is the whole table's, row for row
                like = hf_state_dict.load_rows(scale_key, start, stop)
                q_rows, scale_rows = quantization_utils.quantize_fp8_e4m3fn_like_scale(rows, like, name=name)
                yield name, TensorRowChunk(q_rows, start, total)
                yield scale_key, TensorRowChunk(scale_rows, start, total)
            else:
                dtype = task.weight_dtype or stored_dtype or table.dtype
                yield name, TensorRowChunk(rows.to(dtype), start, total)

    def mapping_registry(self) -> MegatronMappingRegistry:
        """Release names <-> megatron-core CSA2 / mHC / MoE (and, with vision, ViT / aligner) parameter names."""
        # The registry follows the model the provider builds: with a vision tower, DeepSeekV41VLModel holds the
        # GPTModel as language_model.
        vision = self.hf_config is not None and bool(provider_kwargs_from_hf(self.hf_config).get("vision_num_layers"))
        lm = "language_model." if vision else ""
        layer = f"{lm}decoder.layers.*"
        attn = f"{layer}.self_attention"
        mappings = [
            ColumnParallelMapping(f"{lm}embedding.word_embeddings.weight", "embed.weight"),
            ColumnParallelMapping(f"{lm}output_layer.weight", "head.weight"),
            ReplicatedMapping(f"{lm}decoder.final_layernorm.weight", "norm.weight"),
            ReplicatedMapping(f"{layer}.input_layernorm.weight", "layers.*.attn_norm.weight"),
            ReplicatedMapping(f"{layer}.pre_mlp_layernorm.weight", "layers.*.ffn_norm.weight"),
            # Attention: the latent side is replicated, query heads and output groups are split.
            ReplicatedMapping(f"{attn}.linear_q_down.weight", "layers.*.attn.wq_a.weight"),
            ReplicatedMapping(f"{attn}.q_layernorm.weight", "layers.*.attn.q_norm.weight"),
            ColumnParallelMapping(f"{attn}.linear_q_up.weight", "layers.*.attn.wq_b.weight"),
            ReplicatedMapping(f"{attn}.linear_kv.weight", "layers.*.attn.wkv.weight"),
            ReplicatedMapping(f"{attn}.kv_layernorm.weight", "layers.*.attn.kv_norm.weight"),
            ColumnParallelMapping(f"{attn}.linear_o_group_proj.weight", "layers.*.attn.wo_a.weight"),
            RowParallelMapping(f"{attn}.linear_proj.weight", "layers.*.attn.wo_b.weight"),
            ColumnParallelMapping(f"{attn}.attn_sink", "layers.*.attn.attn_sink"),
            ReplicatedMapping(f"{attn}.compressor.linear_kv.weight", "layers.*.attn.compressor.wkv.weight"),
            ReplicatedMapping(f"{attn}.compressor.linear_gate.weight", "layers.*.attn.compressor.wgate.weight"),
            ReplicatedMapping(f"{attn}.compressor.norm.weight", "layers.*.attn.compressor.norm.weight"),
            ReplicatedMapping(f"{attn}.indexer.linear_q.weight", "layers.*.attn.indexer.wq_b.weight"),
            ReplicatedMapping(f"{attn}.indexer.linear_weights.weight", "layers.*.attn.indexer.weights_proj.weight"),
            ReplicatedMapping(f"{attn}.indexer.linear_k.weight", "layers.*.attn.indexer.wk.weight"),
            ReplicatedMapping(f"{attn}.indexer.k_layernorm.weight", "layers.*.attn.indexer.k_norm.weight"),
            # MoE: router with its selection-only expert bias, routed and shared SwiGLU experts.
            ReplicatedMapping(f"{layer}.mlp.router.weight", "layers.*.ffn.gate.weight"),
            ReplicatedMapping(f"{layer}.mlp.router.expert_bias", "layers.*.ffn.gate.bias"),
            GatedMLPMapping(
                megatron_param=f"{layer}.mlp.experts.local_experts.*.linear_fc1.weight",
                gate="layers.*.ffn.experts.*.w1.weight",
                up="layers.*.ffn.experts.*.w3.weight",
            ),
            RowParallelMapping(
                f"{layer}.mlp.experts.local_experts.*.linear_fc2.weight", "layers.*.ffn.experts.*.w2.weight"
            ),
            GatedMLPMapping(
                megatron_param=f"{layer}.mlp.experts.linear_fc1.weight*",
                gate="layers.*.ffn.experts.*.w1.weight",
                up="layers.*.ffn.experts.*.w3.weight",
            ),
            RowParallelMapping(f"{layer}.mlp.experts.linear_fc2.weight*", "layers.*.ffn.experts.*.w2.weight"),
            GatedMLPMapping(
                megatron_param=f"{layer}.mlp.shared_experts.linear_fc1.weight",
                gate="layers.*.ffn.shared_experts.w1.weight",
                up="layers.*.ffn.shared_experts.w3.weight",
            ),
            RowParallelMapping(
                f"{layer}.mlp.shared_experts.linear_fc2.weight", "layers.*.ffn.shared_experts.w2.weight"
            ),
        ]
        # Engram: table, wkv projection and the gate's q/k weights, replicated.
        for part in ("embed.weight", "wkv.weight", "q_weight", "k_weight"):
            mappings.append(ReplicatedMapping(f"{layer}.engram.{part}", f"layers.*.engram.{part}"))
        # mHC coefficients of the attention and MLP sites (fn, base, scale), replicated.
        for site, hf_site in (("self_attn_hyper_connection", "hc_attn"), ("mlp_hyper_connection", "hc_ffn")):
            for part in ("fn", "base", "scale"):
                mappings.append(ReplicatedMapping(f"{layer}.{site}.{part}", f"layers.*.{hf_site}_{part}"))
        if vision:
            mappings += _vision_mappings()
        return MegatronMappingRegistry(*mappings)
