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

"""DeepSeek-V4.1 vision-language model: the provider's ``GPTModel`` plus the ViT and the 3x3 aligner.

An image of ``n_h x n_w`` patches becomes ``H' x W'`` aligned rows (``H' = ceil(n_h / 3)``) and, in the prompt,
the span ``[start] + ([image] * W' + [newline]) * H' + [end]``. Every span position carries the image token id
in ``input_ids``; ``token_types`` tells them apart: -1 text, 0 start, 1 image, 2 newline, 3 end. The aligned
rows fill the image positions in reading order (spans in batch-major order) and three learned vectors
(``image_start``, ``image_newline``, ``image_end``) the delimiters. ``token_types`` is passed on to the language
model, which keeps image tokens out of Engram n-grams (and routes them with the image expert bias).

The ViT and aligner live on the first pipeline stage only (with the embedding); later stages receive hidden
states and ignore ``pixel_values``.
"""

from typing import Any, Optional

import torch
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

from megatron.bridge.models.deepseek_v41.deepseek_v41_vision import (
    DeepSeekV41VisionModel,
    DeepSeekV41VisionProjection,
    encode_images,
    get_deepseek_v41_vision_config,
    get_deepseek_v41_vision_layer_spec,
    get_deepseek_v41_vision_projection_config,
    get_deepseek_v41_vision_projection_spec,
    split_images,
)


TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3
IMAGE_DELIMITERS = (("image_start", IMAGE_START), ("image_newline", IMAGE_NEWLINE), ("image_end", IMAGE_END))


def fill_image_embeddings(
    embeddings: torch.Tensor, token_types: torch.Tensor, image_rows: list, delimiters: dict
) -> torch.Tensor:
    """Write aligned rows and delimiter vectors into ``embeddings`` [s, b, h] at ``token_types`` [b, s] (a copy)."""
    s, b, h = embeddings.shape
    if tuple(token_types.shape) != (b, s):
        raise ValueError(f"token_types must be [{b}, {s}] (batch, sequence), got {list(token_types.shape)}")
    flat_types = token_types.reshape(-1)
    starts = int((flat_types == IMAGE_START).sum())
    if starts != len(image_rows):
        raise ValueError(
            f"token_types hold {starts} image spans (IMAGE_START) but {len(image_rows)} images were given"
        )
    image_positions = (flat_types == IMAGE).nonzero().flatten()
    rows = torch.cat(image_rows) if image_rows else embeddings.new_zeros(0, h)
    if rows.shape[0] != image_positions.numel():
        raise ValueError(
            f"token_types hold {image_positions.numel()} image positions but the images give {rows.shape[0]} "
            f"aligned rows ({[r.shape[0] for r in image_rows]})"
        )
    out = embeddings.transpose(0, 1).reshape(b * s, h)  # [b*s, h], batch-major like the spans
    out = out.index_put((image_positions,), rows.to(out.dtype))
    for name, code in IMAGE_DELIMITERS:
        out = torch.where((flat_types == code).unsqueeze(-1), delimiters[name].to(out.dtype), out)
    return out.reshape(b, s, h).transpose(0, 1).contiguous()


class DeepSeekV41VLModel(MegatronModule):
    """``language_model`` (the provider's GPTModel), ``vision_model`` (ViT) and ``vision_projection`` (aligner)."""

    def __init__(self, config: Any, pre_process=None, post_process=None, vp_stage: Optional[int] = None) -> None:
        super().__init__(config=config)
        if config.sequence_parallel and config.scatter_embedding_sequence_parallel:
            raise ValueError(
                "scatter_embedding_sequence_parallel must be False with a vision tower: images are written into "
                "the full sequence, which this model then scatters to the sequence-parallel ranks"
            )
        self.language_model = config.provide_language_model(
            pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        self.pre_process = self.language_model.pre_process
        self.post_process = self.language_model.post_process
        self.vp_stage = vp_stage
        self.share_embeddings_and_output_weights = self.language_model.share_embeddings_and_output_weights
        self.model_type = self.language_model.model_type
        self.vision_model = self.vision_projection = None
        if self.pre_process:
            vision_config = get_deepseek_v41_vision_config(config)
            self.vision_model = DeepSeekV41VisionModel(
                vision_config, get_deepseek_v41_vision_layer_spec(), config.vision_patch_size, config.vision_rope_theta
            )
            self.vision_projection = DeepSeekV41VisionProjection(
                get_deepseek_v41_vision_projection_config(vision_config, config.hidden_size),
                get_deepseek_v41_vision_projection_spec(),
                vision_hidden_size=config.vision_hidden_size,
                ratio=config.vision_downsample_ratio,
            )
            for name, _ in IMAGE_DELIMITERS:
                vector = torch.empty(config.hidden_size, dtype=config.params_dtype)
                if config.perform_initialization:
                    torch.nn.init.normal_(vector, std=config.init_method_std)
                self.register_parameter(name, torch.nn.Parameter(vector))

    @property
    def decoder(self):
        """The language model's decoder (what megatron-core's inference helpers look up)."""
        return self.language_model.decoder

    def shared_embedding_or_output_weight(self):
        """The language model's shared embedding / output weight."""
        return self.language_model.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook: the previous stage's activations go to the language model."""
        self.language_model.set_input_tensor(input_tensor)

    def freeze(self, freeze_language_model: bool, freeze_vision_model: bool, freeze_vision_projection: bool):
        """No gradients for the chosen parts; the image delimiter vectors belong to the projection."""
        modules = []
        if freeze_language_model:
            modules.append(self.language_model)
        if freeze_vision_model and self.vision_model is not None:
            modules.append(self.vision_model)
        if freeze_vision_projection and self.vision_projection is not None:
            modules.append(self.vision_projection)
            for name, _ in IMAGE_DELIMITERS:
                getattr(self, name).requires_grad_(False)
        for module in modules:
            for param in module.parameters():
                param.requires_grad_(False)

    def embed_images(
        self, embeddings: torch.Tensor, token_types: Optional[torch.Tensor], pixel_values: torch.Tensor, image_grid_hw
    ) -> torch.Tensor:
        """ViT + aligner per image, written with the delimiters into the spans: [s, b, h] -> [s, b, h]."""
        if token_types is None:
            raise ValueError("pixel_values need token_types marking the image spans (-1 text, 0..3 span codes)")
        if image_grid_hw is None:
            raise ValueError("pixel_values need image_grid_hw [n_images, 2] (patch rows, patch columns per image)")
        if self.config.context_parallel_size > 1:
            raise ValueError(
                "pixel_values with context_parallel_size > 1 are not supported (a rank holds part of each span); "
                "embed the images first and pass decoder_input"
            )
        rows = encode_images(self.vision_model, self.vision_projection, split_images(pixel_values, image_grid_hw))
        delimiters = {name: getattr(self, name) for name, _ in IMAGE_DELIMITERS}
        return fill_image_embeddings(embeddings, token_types, rows, delimiters)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        labels: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_grid_hw: Optional[torch.Tensor] = None,
        token_types: Optional[torch.Tensor] = None,
        decoder_input: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """GPTModel's forward with images: ``pixel_values`` [sum n_h*n_w, 3*p*p], ``image_grid_hw`` [n, 2],
        ``token_types`` [b, s]. Returns the language model's logits [b, s, V] (or loss with ``labels``)."""
        if self.pre_process and decoder_input is None:
            decoder_input = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
            if pixel_values is not None:
                decoder_input = self.embed_images(decoder_input, token_types, pixel_values, image_grid_hw)
            elif token_types is not None and bool((token_types >= 0).any()):
                raise ValueError("token_types mark image-span positions but no pixel_values were given")
            if self.config.sequence_parallel:
                decoder_input = scatter_to_sequence_parallel_region(decoder_input)
        if token_types is not None:
            kwargs["token_types"] = token_types  # the language model's modality mask and Engram image mask
        return self.language_model(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels, **kwargs
        )
