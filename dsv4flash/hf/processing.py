"""The V4.1 Hugging Face processor: `DeepseekV41ImageProcessor` and `DeepseekV41Processor` (docs/transformers.md).

Both wrap the reference preprocessing (`dsv4flash.model.image`), so a prompt gives exactly the ids, token types
and patches the reference model and the Megatron ViT (`pixel_values` [Σ n_h·n_w, 3·p·p], `image_grid_hw`
[n_images, 2]) use. `AutoProcessor.from_pretrained(path)` loads it offline from a saved processor, a release
checkpoint or a dsv4flash base directory (whose `tokenizer.json` is the task vocabulary: its HF form is built
in memory). One `<image>` in the text is one image; it becomes the image's whole span.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
from transformers import BatchFeature, PreTrainedTokenizerBase
from transformers.image_processing_utils import BaseImageProcessor
from transformers.processing_utils import ProcessorMixin

from dsv4flash.config import VisionConfig
from dsv4flash.model.image import (compact_image_placeholders, expand_image_placeholders, preprocess_image,
                                   split_pixel_values)

__all__ = ["DeepseekV41ImageProcessor", "DeepseekV41Processor", "PROCESSOR_CHAT_TEMPLATE", "save_processor_files"]

# The task chat template (hf_tokenizer.CHAT_TEMPLATE) for structured content too: an image part is `<image>`.
PROCESSOR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}")
IMAGE_TOKEN = "<image>"
PROCESSOR_FILE = "processor_config.json"


class _SpanConfig(NamedTuple):
    """What `expand_image_placeholders` reads of a model config: the placeholder id and the vision config."""

    image_token_id: int
    vision: VisionConfig


class DeepseekV41ImageProcessor(BaseImageProcessor):
    """Images -> `pixel_values` [Σ n_h·n_w, 3·p·p] (row-major patches, fp32 by default) and `image_grid_hw`."""

    model_input_names = ["pixel_values", "image_grid_hw"]

    def __init__(self, vision_config: dict[str, Any] | None = None, dtype: str = "float32", **kwargs) -> None:
        super().__init__(**kwargs)
        if vision_config is None:
            raise ValueError("DeepseekV41ImageProcessor: vision_config (the model's vision_config) is required")
        self.vision_config = dict(vision_config)
        self.vision = VisionConfig(**self.vision_config)
        if not self.vision.enabled:
            raise ValueError("DeepseekV41ImageProcessor: vision_config.num_hidden_layers is 0 (no vision tower)")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"DeepseekV41ImageProcessor: dtype must be a torch dtype name, got {dtype!r}")
        self.dtype = dtype
        self.patch_size = self.vision.patch_size  # veRL reads `image_processor.patch_size`

    def to_dict(self) -> dict[str, Any]:
        """Serializable state (the derived `vision` dataclass is rebuilt from `vision_config`)."""
        out = super().to_dict()
        out.pop("vision", None)
        return out

    @classmethod
    def from_model_config(cls, path: str | os.PathLike, **kwargs) -> "DeepseekV41ImageProcessor":
        """The image processor of the model whose `config.json` is in `path`."""
        from dataclasses import asdict

        from dsv4flash.config import load_config

        return cls(vision_config=asdict(load_config(Path(path) / "config.json").vision), **kwargs)

    def preprocess(self, images: Any, return_tensors: Any = "pt", **kwargs) -> BatchFeature:
        """One image or a list (PIL, path, bytes, uint8 array, veRL's nested per-sample lists) -> BatchFeature."""
        if kwargs:
            raise ValueError(f"DeepseekV41ImageProcessor: unsupported option(s) {sorted(kwargs)}")
        inputs = [preprocess_image(img, self.vision, getattr(torch, self.dtype)) for img in _flat(images)]
        if not inputs:
            raise ValueError("DeepseekV41ImageProcessor: no images given")
        return BatchFeature({"pixel_values": torch.cat([i.patches for i in inputs]),
                             "image_grid_hw": torch.tensor([i.grid_hw for i in inputs], dtype=torch.int64)},
                            tensor_type=return_tensors)


def _flat(images: Any) -> list[Any]:
    if isinstance(images, (list, tuple)):
        return [leaf for item in images for leaf in _flat(item)]
    return [images]


class DeepseekV41Processor(ProcessorMixin):
    """Task tokenizer + image processor: text with `<image>` placeholders and images -> model inputs."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template: str | None = None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, chat_template=chat_template or PROCESSOR_CHAT_TEMPLATE,
                         **kwargs)
        self.image_token = IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"DeepseekV41Processor: the tokenizer has no {IMAGE_TOKEN} token")

    @property
    def model_input_names(self) -> list[str]:
        """Tokenizer inputs, `token_types` (span codes, -1 = text) and the image processor's inputs."""
        return [*self.tokenizer.model_input_names, "token_types", *self.image_processor.model_input_names]

    def __call__(self, images: Any = None, text: str | Sequence[str] | None = None, return_tensors: Any = "pt",
                 padding: bool | str = False, **kwargs) -> BatchFeature:
        """`text` (one string or a batch) with one `<image>` per image in order; spans expanded in the ids."""
        for ignored in ("videos", "audio"):
            if kwargs.pop(ignored, None) is not None:
                raise ValueError(f"DeepseekV41Processor: {ignored} are not supported (images only)")
        kwargs.pop("add_special_tokens", None)  # the chat template writes bos; the tokenizer adds nothing
        if kwargs:
            raise ValueError(f"DeepseekV41Processor: unsupported option(s) {sorted(kwargs)}")
        if text is None:
            raise ValueError("DeepseekV41Processor: text is required (the prompt with its <image> placeholders)")
        texts = [text] if isinstance(text, str) else list(text)
        pixels = self.image_processor(images, return_tensors="pt") if images is not None else None
        inputs = [] if pixels is None else split_pixel_values(pixels["pixel_values"], pixels["image_grid_hw"])
        span_cfg = _SpanConfig(self.image_token_id, self.image_processor.vision)
        rows, used = [], 0
        for t in texts:
            ids = self.tokenizer(t, add_special_tokens=False)["input_ids"]
            n = sum(1 for i in ids if i == self.image_token_id)
            if used + n > len(inputs):
                raise ValueError(f"DeepseekV41Processor: the text has more {IMAGE_TOKEN} placeholders than the "
                                 f"{len(inputs)} images given")
            rows.append(expand_image_placeholders(ids, inputs[used:used + n], span_cfg))
            used += n
        if used != len(inputs):
            raise ValueError(f"DeepseekV41Processor: {len(inputs)} images given but the text has {used} "
                             f"{IMAGE_TOKEN} placeholders")
        if len(rows) > 1 and len({len(r[0]) for r in rows}) > 1 and not padding:
            raise ValueError("DeepseekV41Processor: prompts of different lengths need padding=True")
        width = max(len(r[0]) for r in rows)
        pad = self.tokenizer.pad_token_id
        data = {"input_ids": [r[0].tolist() + [pad] * (width - len(r[0])) for r in rows],
                "attention_mask": [[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows],
                "token_types": [r[1].tolist() + [-1] * (width - len(r[1])) for r in rows]}
        if pixels is not None:
            data.update(pixels)
        return BatchFeature(data, tensor_type=return_tensors)

    def token_aligned_inputs(self, token_ids: Sequence[int], images: Any = None, videos: Any = None,
                             **kwargs) -> BatchFeature:
        """Model inputs of token ids that already hold the images' expanded spans (a sampled trajectory):
        `token_types` [1, S] aligned with `token_ids` and the pixel inputs, with no decode/re-tokenize round
        trip (decoding drops `<image>` and bos/eos, which the span positions depend on)."""
        if videos is not None:
            raise ValueError("DeepseekV41Processor: videos are not supported (images only)")
        pixels = self.image_processor(images, return_tensors="pt") if images is not None else None
        inputs = [] if pixels is None else split_pixel_values(pixels["pixel_values"], pixels["image_grid_hw"])
        span_cfg = _SpanConfig(self.image_token_id, self.image_processor.vision)
        ids = [int(t) for t in token_ids]
        compact = compact_image_placeholders(ids, inputs, span_cfg)
        expanded, types = expand_image_placeholders(compact, inputs, span_cfg)
        if expanded.tolist() != ids:
            raise ValueError(f"DeepseekV41Processor: the token ids' image spans do not match the {len(inputs)} "
                             "images given (span lengths differ from the images' token grids)")
        data = {"token_types": types[None]}
        if pixels is not None:
            data.update(pixels)
        return BatchFeature(data, tensor_type=kwargs.get("return_tensors", "pt"))

    def routing_replay_rows(self, token_ids: Sequence[int], num_route_rows: int,
                            multi_modal_inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Text-only routing replay of one sample: (row_map [num_route_rows], native_rows [len(token_ids)]).

        The rollout records routes on the compact sequence (one placeholder per image), training runs on the
        expanded one (`token_ids`, the spans as this processor writes them): `row_map` is the training row of
        each recorded route row (−1 = never replayed), `native_rows` the image-span rows, routed with `bias_vl`
        (`dsv4flash.replay.r3_batch_keys` on the `ImageSpanLayout` of `multi_modal_inputs["token_types"]`).
        """
        from dsv4flash.replay import ImageSpanLayout, r3_batch_keys

        types = multi_modal_inputs.get("token_types") if multi_modal_inputs else None
        if types is None:
            if any(int(t) == self.image_token_id for t in token_ids):
                raise ValueError("routing_replay_rows: the sample has image tokens but multi_modal_inputs has no "
                                 "token_types (compute them with token_aligned_inputs)")
            types = torch.full((len(token_ids),), -1, dtype=torch.int64)  # a text-only sample
        types = torch.as_tensor(types).reshape(-1)
        if types.numel() != len(token_ids):
            raise ValueError(f"routing_replay_rows: token_types has {types.numel()} rows but the sample has "
                             f"{len(token_ids)} tokens (prompt + response)")
        keys = r3_batch_keys([ImageSpanLayout.from_token_types(types)], [int(num_route_rows)])
        return keys["r3_row_map"].unbind()[0], keys["r3_native_rows"].unbind()[0]

    def batch_decode(self, *args, **kwargs):
        """The tokenizer's `batch_decode`."""
        return self.tokenizer.batch_decode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        """The tokenizer's `decode`."""
        return self.tokenizer.decode(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs) -> "DeepseekV41Processor":
        """A saved processor, a release checkpoint or a dsv4flash base dir (local; hub kwargs are ignored)."""
        path = Path(pretrained_model_name_or_path)
        saved = path / PROCESSOR_FILE  # transformers 5's save_pretrained: the image processor is one section
        if saved.is_file():
            section = json.loads(saved.read_text()).get("image_processor")
            if not isinstance(section, dict):
                raise ValueError(f"{saved}: expected an 'image_processor' object")
            image_processor = DeepseekV41ImageProcessor(
                **{k: v for k, v in section.items() if k not in ("image_processor_type", "patch_size")})
        elif (path / "config.json").is_file():
            image_processor = DeepseekV41ImageProcessor.from_model_config(path)
        else:
            raise FileNotFoundError(f"{path}: neither {PROCESSOR_FILE} nor config.json (not a V4.1 processor, "
                                    f"checkpoint or base directory)")
        return cls(image_processor=image_processor, tokenizer=_tokenizer_of(path))


def save_processor_files(base_dir: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """Make a HF tokenizer directory (`save_hf_tokenizer`) a processor directory for the model in `base_dir`:
    `processor_config.json` and the model's `config.json` (veRL's `hf_processor` reads both), each atomically."""
    from dsv4flash.atomic_io import write_bytes_atomic

    base, target = Path(base_dir), Path(directory)
    image = DeepseekV41ImageProcessor.from_model_config(base).to_dict()
    image["image_processor_type"] = DeepseekV41ImageProcessor.__name__
    section = {"processor_class": DeepseekV41Processor.__name__, "image_processor": image}
    write_bytes_atomic(target / PROCESSOR_FILE, (json.dumps(section, indent=1, sort_keys=True) + "\n").encode())
    write_bytes_atomic(target / "config.json", (base / "config.json").read_bytes())
    return target


def _tokenizer_of(path: Path) -> PreTrainedTokenizerBase:
    """The HF tokenizer in `path`; for a dsv4flash base (task vocabulary) its HF form, built in memory."""
    from dsv4flash.tasks.tokenizer import TASK_TOKENIZER_KIND

    own = path / "tokenizer.json"
    try:
        kind = json.loads(own.read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind == TASK_TOKENIZER_KIND:
        from dsv4flash.config import load_config
        from dsv4flash.tasks import TaskTokenizer
        from dsv4flash.tasks.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(TaskTokenizer.load(path, load_config(path / "config.json")))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
