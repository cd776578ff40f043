"""The V4.1 language model assembled from megatron-core pieces: embedding → CSA2 block → fp32 head.

`DSV41MegatronModel.forward(input_ids, position_ids, attention_mask, labels=None, *, token_types,
packed_seq_params, padding_mask)` follows `GPTModel.forward`: logits [b, s, V] without labels, per-token
loss [b, s] with them. Image spans (`token_types >= 0`) pick `bias_vl` in the router and take no Engram
delta. Their embeddings come from the model's own ViT + aligner (`vision_model`, `vision_projection`, first
pipeline stage, frozen by default) given `pixel_values` [Σ n_h·n_w, 3·p·p] and `image_grid_hw` [n_images, 2],
with the `embedding.image_start / image_newline / image_end` delimiter vectors, as the reference fills them;
or pass ready embeddings through `decoder_input` ([s, b, h]). The ViT and aligner are megatron-bridge's
upstream-form modules (`models/deepseek_v41/deepseek_v41_vision.py`, DSV41-MBRIDGE-006: the installed
package, else its twin's files).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.enums import ModelType
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.experimental_attention_variant.csa2_context_parallel import CSA2PartitionedLayout

from dsv4flash.integrations.mcore.csa2.block import CSA2TransformerBlock
from dsv4flash.integrations.mcore.csa2.carry import CSA2Tokens
from dsv4flash.integrations.mcore.csa2.config import with_dtype
from dsv4flash.integrations.mcore.csa2.modules import KeepFP32
from dsv4flash.model.engram import EngramHasher

__all__ = ["DSV41MegatronModel"]


class DSV41MegatronModel(KeepFP32, LanguageModule):
    """Embedding, Engram hashing, `CSA2TransformerBlock` and the fp32 output layer (untied, as the release).

    As a pipeline stage (`pre_process` / `post_process` False) it holds only its layers; the first stage
    owns the embedding, the last the final norm and head, and between stages it exchanges the CSA2
    pipeline payload (streams + cross-layer state). Every stage needs the micro-batch's `input_ids` (the
    token layout and the Engram hashes are computed per stage, as megatron-core's MTP stages do).
    """

    _fp32_params = ("output_layer.weight",)

    def __init__(self, config: Any, block_spec: Any, *, parallel_output: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection: Any = None, vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        text = config.dsv4.text
        self.vocab_size = text.vocab_size
        self.max_sequence_length = text.max_position_embeddings
        self.parallel_output = parallel_output
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules read
        self.share_embeddings_and_output_weights = False
        self.vision_model = self.vision_projection = None
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, self.vocab_size, self.max_sequence_length,
                                                    position_embedding_type="none", tp_group=self.tp_group)
            if config.dsv4.vision.enabled:
                self._build_vision(config)
        self.decoder = CSA2TransformerBlock(config, block_spec, pre_process=pre_process, post_process=post_process,
                                            pg_collection=self.pg_collection, vp_stage=vp_stage)
        stage_engram = any(getattr(layer, "engram", None) is not None for layer in self.decoder.layers)
        self.engram_hasher = EngramHasher(config.dsv4) if text.engram_layer_ids and stage_engram else None
        if post_process:
            # REF keeps the head in fp32 and computes fp32 logits.
            head_config = with_dtype(config, torch.float32)
            self.output_layer = ColumnParallelLinear(text.hidden_size, self.vocab_size, config=head_config,
                                                     init_method=config.init_method, bias=False,
                                                     skip_bias_add=False, gather_output=not parallel_output,
                                                     tp_group=self.tp_group)

    def _build_vision(self, config: Any) -> None:
        from types import SimpleNamespace

        from dsv4flash.integrations.mbridge.patches.deepseek_v41_vision import vision_module

        vit = vision_module()
        from megatron.bridge.models.deepseek_v41.deepseek_v41_bridge import vision_provider_kwargs_from_hf

        text = config.dsv4.text
        # The provider fields the upstream ViT reads: the release `vision_config` translated as the bridge does,
        # the text model's tensor-parallel size, dtype and init.
        fields = SimpleNamespace(**vision_provider_kwargs_from_hf(config.dsv4.to_hf()),
                                 init_method_std=text.initializer_range,
                                 **{k: getattr(config, k) for k in ("tensor_model_parallel_size", "params_dtype",
                                                                    "bf16", "fp16", "use_cpu_initialization",
                                                                    "perform_initialization")})
        vision_config = vit.get_deepseek_v41_vision_config(fields)
        self.vision_model = vit.DeepSeekV41VisionModel(vision_config, vit.get_deepseek_v41_vision_layer_spec(),
                                                       fields.vision_patch_size, fields.vision_rope_theta)
        self.vision_projection = vit.DeepSeekV41VisionProjection(
            vit.get_deepseek_v41_vision_projection_config(vision_config, text.hidden_size),
            vit.get_deepseek_v41_vision_projection_spec(), vision_hidden_size=fields.vision_hidden_size,
            ratio=fields.vision_downsample_ratio)
        for name in ("image_start", "image_newline", "image_end"):  # REF init: N(0, std) like the embedding
            vector = torch.empty(text.hidden_size, dtype=config.params_dtype)
            if config.perform_initialization:
                torch.nn.init.normal_(vector, std=text.initializer_range)
            self.embedding.register_parameter(name, torch.nn.Parameter(vector))

    def freeze(self, freeze_language_model: bool = False, freeze_vision_model: bool = False,
               freeze_vision_projection: bool = False) -> None:
        """Megatron-Bridge's VL `freeze`: no gradients for the language model / ViT / aligner parameters."""
        vision = [m for m, on in ((self.vision_model, freeze_vision_model),
                                  (self.vision_projection, freeze_vision_projection)) if on and m is not None]
        if freeze_language_model:
            vision_ids = {id(p) for m in (self.vision_model, self.vision_projection) if m is not None
                          for p in m.parameters()}
            for param in self.parameters():
                if id(param) not in vision_ids:
                    param.requires_grad_(False)
        for module in vision:
            module.requires_grad_(False)

    def embed_images(self, embeddings: torch.Tensor, token_types: Optional[torch.Tensor],
                     pixel_values: torch.Tensor, image_grid_hw: Any) -> torch.Tensor:
        """ViT + aligner per image, written with the delimiters into the spans: [s, b, h] -> [s, b, h]."""
        from dsv4flash.model.image import fill_image_embeddings

        if self.vision_model is None:
            raise ValueError("DSV41MegatronModel: pixel_values given, but this stage has no vision tower (the "
                             "config has vision_config.num_hidden_layers == 0, or this is not the first stage)")
        if token_types is None:
            raise ValueError("DSV41MegatronModel: pixel_values need token_types marking the image spans")
        if self.config.context_parallel_size > 1:
            raise ValueError("DSV41MegatronModel: pixel_values with context parallelism are not supported (a rank "
                             "holds part of each span); embed the images first and pass decoder_input")
        from megatron.bridge.models.deepseek_v41.deepseek_v41_vision import encode_images, split_images

        rows = encode_images(self.vision_model, self.vision_projection,
                             split_images(pixel_values, image_grid_hw))  # each [H'W', h]
        e = self.embedding
        filled = fill_image_embeddings(embeddings.transpose(0, 1), token_types, rows, e.image_start,
                                       e.image_newline, e.image_end)  # [b, s, h]
        return filled.transpose(0, 1)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Pipeline hook: the previous stage's payload (a list of one tensor from the schedule)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"DSV41MegatronModel expects one input tensor per stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def tokens(self, input_ids: torch.Tensor, embeddings: torch.Tensor, *, token_types: Optional[torch.Tensor] = None,
               packed_seq_params: Any = None, padding_mask: Optional[torch.Tensor] = None) -> CSA2Tokens:
        """Per-micro-batch constants: token layout, image mask and every Engram layer's row ids."""
        image_mask = token_types >= 0 if token_types is not None else None
        if embeddings is None:  # a later pipeline stage: the layout only needs the [s, b] shape
            embeddings = input_ids.transpose(0, 1)
        tokens = self.decoder.build_tokens(embeddings, packed_seq_params=packed_seq_params,
                                           padding_mask=padding_mask, image_mask=image_mask)
        if self.engram_hasher is None:
            return tokens
        layout = tokens.layout
        types = token_types if token_types is not None else torch.full_like(input_ids, -1)
        partitioned = isinstance(layout, CSA2PartitionedLayout)
        if partitioned:  # context parallel: n-grams reach back into the previous rank's tokens
            ids, types, positions = layout.extend_ids(input_ids), layout.extend_ids(types), layout.ext_pos
        else:
            ids, positions = input_ids, (layout.pos if packed_seq_params is not None else None)
        rows = self.engram_hasher(ids, types, position_ids=positions)  # per layer [b, E, cols]
        if partitioned:
            rows = [r[:, layout.local_slots] for r in rows]
        return dataclasses.replace(tokens, engram_rows=tuple(r.transpose(0, 1).contiguous() for r in rows))

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, decoder_input: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, *, token_types: Optional[torch.Tensor] = None,
                packed_seq_params: Any = None, padding_mask: Optional[torch.Tensor] = None,
                pixel_values: Optional[torch.Tensor] = None, image_grid_hw: Any = None,
                **_unused: Any) -> torch.Tensor:
        """input_ids [b, s] -> logits [b, s, V] (fp32), or the per-token LM loss [b, s] when labels are given.

        A stage without post_process returns the pipeline payload for the next stage instead.
        """
        if decoder_input is not None or not self.pre_process:
            embeddings = decoder_input
        else:
            embeddings = self.embedding(input_ids, position_ids)  # [s, b, h]
            if pixel_values is not None:
                embeddings = self.embed_images(embeddings, token_types, pixel_values, image_grid_hw)
            elif self.vision_model is not None and token_types is not None and bool((token_types >= 0).any()):
                raise ValueError("DSV41MegatronModel: token_types mark image spans but neither pixel_values nor "
                                 "decoder_input was given")
        tokens = self.tokens(input_ids, embeddings, token_types=token_types, packed_seq_params=packed_seq_params,
                             padding_mask=padding_mask)
        hidden = self.decoder(embeddings, attention_mask, packed_seq_params=packed_seq_params,
                              padding_mask=padding_mask, csa2_tokens=tokens)  # [s, b, h] (payload mid-pipeline)
        if not self.post_process:
            return hidden
        logits, _ = self.output_layer(hidden.float())  # [s, b, V]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)
