"""`ImagePromptDataset`: veRL's `RLHFDataset` with V4.1 image extraction (`data.custom_cls`, veRL's extension point).

Why: `RLHFDataset._process_multi_modal_info` hands every image to `qwen_vl_utils.process_vision_info`, which
resizes it Qwen's way (multiples of 2·patch, Qwen's pixel bounds) before the processor sees it, so the pixels
would no longer be the ones the reference model preprocesses. Here each image part is decoded to RGB and passed
on untouched; the V4.1 processor (`dsv4flash.hf.processing`) does the model's own resize/pad. Everything else
(rows, `_build_messages`, filtering) is veRL's.
"""

from __future__ import annotations

from typing import Any

from verl.utils.dataset.rl_dataset import RLHFDataset

__all__ = ["ImagePromptDataset", "message_images"]


def message_images(messages: list[dict]) -> list[Any]:
    """RGB PIL images of the `{"type": "image", ...}` parts of `messages`, in order (PIL, bytes or a path)."""
    from dsv4flash.model.image import load_rgb

    images = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "image":
                continue
            for key in ("image", "bytes", "path"):
                if part.get(key) is not None:
                    images.append(load_rgb(part[key]))
                    break
            else:
                raise ValueError(f"image part has none of 'image', 'bytes', 'path': keys {sorted(part)}")
    return images


class ImagePromptDataset(RLHFDataset):
    """`RLHFDataset` whose images reach the processor as decoded, never resized (no `qwen_vl_utils`)."""

    @classmethod
    def _process_multi_modal_info(cls, messages: list[dict], image_patch_size, config) -> tuple:
        if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "video"
                                                          for p in m["content"]) for m in messages):
            raise ValueError("ImagePromptDataset: video parts are not supported (images only)")
        images = message_images(messages)
        return (images or None), None, cls._extract_audio_info(messages)
