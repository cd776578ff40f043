"""Image preprocessing and image spans in the token stream (docs/architecture.md §7).

An image becomes an `n_h × n_w` ViT patch grid and, after the 3×3 aligner, an `H' × W'` token grid that the
LLM sees as the span

    [IMAGE_START] + ([IMAGE] × W' + [IMAGE_NEWLINE]) × H' + [IMAGE_END]

Every span position carries `image_token_id` in `input_ids`; only `token_types` tells them apart (TEXT = -1
everywhere else). Pillow is imported lazily, only by the functions that decode or resize pixels.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from dsv4flash.config import DSV41FlashConfig, VisionConfig

__all__ = [
    "TEXT", "IMAGE_START", "IMAGE", "IMAGE_NEWLINE", "IMAGE_END",
    "ImageInput", "ImagePlan", "PaddedPrompts",
    "num_image_tokens", "llm_grid_hw", "image_token_types", "plan_image_grid", "load_rgb", "preprocess_image",
    "expand_image_placeholders", "compact_image_placeholders", "prepare_vl_inputs", "fill_image_embeddings", "pad_prompts",
    "split_pixel_values",
]

TEXT, IMAGE_START, IMAGE, IMAGE_NEWLINE, IMAGE_END = -1, 0, 1, 2, 3


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: `patches` [n_h*n_w, 3*p*p] (row-major grid, channel-major patch) and its grid."""

    patches: torch.Tensor
    grid_hw: tuple[int, int]

    def __post_init__(self) -> None:
        n_h, n_w = self.grid_hw
        if n_h <= 0 or n_w <= 0 or self.patches.ndim != 2 or self.patches.shape[0] != n_h * n_w:
            raise ValueError(f"ImageInput: patches must be [n_h*n_w={n_h * n_w}, 3*p*p] for grid {self.grid_hw}, "
                             f"got {list(self.patches.shape)}")


class ImagePlan(NamedTuple):
    """Resize plan of one image: LLM token grid and the pixel size it is padded to."""

    n_llm_h: int
    n_llm_w: int
    height: int
    width: int


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length: H'·(W'+1) + 2 (one newline per row, start and end)."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid_hw(grid_hw: tuple[int, int], downsample_ratio: int) -> tuple[int, int]:
    """Patch grid (n_h, n_w) -> token grid (ceil(n_h/r), ceil(n_w/r))."""
    n_h, n_w = grid_hw
    return -(-n_h // downsample_ratio), -(-n_w // downsample_ratio)


def image_token_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """token_types [num_image_tokens] of one span: START, (IMAGE×W', NEWLINE)×H', END."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEWLINE]
    return torch.tensor([IMAGE_START] + row * n_llm_h + [IMAGE_END], dtype=torch.int64)


def _vision(cfg: DSV41FlashConfig | VisionConfig) -> VisionConfig:
    return cfg.vision if isinstance(cfg, DSV41FlashConfig) else cfg


def _pixels_to_llm_grid(height: int, width: int, v: VisionConfig) -> tuple[int, int]:
    return llm_grid_hw((height // v.patch_size, width // v.patch_size), v.downsample_ratio)


def _fit_token_budget(height: float, width: float, v: VisionConfig) -> tuple[int, int]:
    """Largest aspect-preserving pixel size (multiples of the patch) whose span fits max_image_tokens."""
    budget, p = v.max_image_tokens, v.patch_size
    cell = p * v.downsample_ratio
    aspect = height / width
    # Solve aspect·W'² + aspect·W' = budget - 2 for the token-grid width W' (H' ≈ aspect·W').
    max_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    if max_w < 1.0:  # extremely tall: one token column, as many rows as fit
        return (budget - 2) // 2 * cell, cell
    if max_h < 1.0:  # extremely wide: one token row
        return cell, (budget - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan_image_grid(width: int, height: int, cfg: DSV41FlashConfig | VisionConfig) -> ImagePlan:
    """Pixel size and token grid for an image of `width`×`height` (REF `plan_image_grid` / `safe_resize`)."""
    v = _vision(cfg)
    p = v.patch_size
    if v.max_wh_ratio is not None and width > height * v.max_wh_ratio:
        width = height * v.max_wh_ratio
    if 0 < width * height < v.min_pixels:
        # Upscale to about min_pixels; int() truncation can land a few pixels under it, as in REF.
        scale = (v.min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_h, n_w = _pixels_to_llm_grid(best_h, best_w, v)
    if num_image_tokens(n_h, n_w) > v.max_image_tokens:
        best_h, best_w = _fit_token_budget(height, width, v)
        n_h, n_w = _pixels_to_llm_grid(best_h, best_w, v)
        if num_image_tokens(n_h, n_w) > v.max_image_tokens:
            raise ValueError(f"image {width}x{height}: cannot fit max_image_tokens={v.max_image_tokens} "
                             f"(got {num_image_tokens(n_h, n_w)} tokens)")
    return ImagePlan(n_h, n_w, best_h, best_w)


def load_rgb(image: Any):
    """A PIL image, a path, encoded bytes, a uint8 numpy array [H,W(,C)] or uint8 tensor [(C,)H,W] -> RGB PIL."""
    import numpy as np
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as src:
            return src.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        import io
        with Image.open(io.BytesIO(image)) as src:
            return src.convert("RGB")
    if isinstance(image, torch.Tensor):
        if image.ndim == 3:  # torchvision convention: channels first
            image = image.permute(1, 2, 0)
        image = image.detach().cpu().numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image array: expected dtype uint8, got {image.dtype}")
        if image.ndim == 3 and image.shape[-1] == 1:
            image = image[..., 0]
        if not (image.ndim == 2 or (image.ndim == 3 and image.shape[-1] in (3, 4))):
            raise ValueError(f"image array: expected [H, W], [H, W, 1|3|4] (numpy) or [1|3|4, H, W] (torch), "
                             f"got shape {list(image.shape)}")
        return Image.fromarray(np.ascontiguousarray(image)).convert("RGB")
    raise TypeError(f"cannot read an image from {type(image).__name__}")


def preprocess_image(image: Any, cfg: DSV41FlashConfig | VisionConfig,
                     dtype: torch.dtype = torch.bfloat16) -> ImageInput:
    """Resize/pad, normalise to [-1, 1] in `dtype` (BF16 as in REF) and cut into row-major patches."""
    import numpy as np
    from PIL import Image, ImageOps

    v = _vision(cfg)
    p = v.patch_size
    rgb = load_rgb(image)
    plan = plan_image_grid(rgb.width, rgb.height, v)
    size = (plan.width, plan.height)
    if v.max_wh_ratio is not None and rgb.width >= v.max_wh_ratio * rgb.height:
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    else:
        # Aspect-preserving fit, centred, gray fill.
        rgb = ImageOps.pad(rgb, size, method=Image.Resampling.BICUBIC, color=(127, 127, 127), centering=(0.5, 0.5))
    pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1) / 255  # [3, H, W]
    pixels = ((pixels - 0.5) / 0.5).to(dtype)
    n_h, n_w = plan.height // p, plan.width // p
    patches = pixels.reshape(3, n_h, p, n_w, p).permute(1, 3, 0, 2, 4)  # [n_h, n_w, 3, p, p]
    return ImageInput(patches.reshape(n_h * n_w, 3 * p * p), (n_h, n_w))


def expand_image_placeholders(input_ids: Any, images: Sequence[ImageInput], cfg: DSV41FlashConfig
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each `image_token_id` placeholder in `input_ids` [S] by its whole span -> (ids [S'], types [S'])."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).cpu()
    if ids.ndim != 1:
        raise ValueError(f"expand_image_placeholders: input_ids must be one prompt [S], got {list(ids.shape)}")
    places = (ids == cfg.image_token_id).nonzero().flatten().tolist()
    if len(places) != len(images):
        raise ValueError(f"prompt has {len(places)} image placeholder tokens (image_token_id={cfg.image_token_id}) "
                         f"but {len(images)} images were given")
    if places and not cfg.vision.enabled:
        raise ValueError("the prompt contains images but the config has no vision tower "
                         "(vision_config.num_hidden_layers == 0)")
    out_ids, out_types, prev = [], [], 0
    for place, img in zip(places, images):
        out_ids.append(ids[prev:place])
        out_types.append(torch.full((place - prev,), TEXT, dtype=torch.int64))
        types = image_token_types(*llm_grid_hw(img.grid_hw, cfg.vision.downsample_ratio))
        out_ids.append(torch.full_like(types, cfg.image_token_id))
        out_types.append(types)
        prev = place + 1
    out_ids.append(ids[prev:])
    out_types.append(torch.full((ids.numel() - prev,), TEXT, dtype=torch.int64))
    return torch.cat(out_ids), torch.cat(out_types)


def compact_image_placeholders(input_ids: Any, images: Sequence[ImageInput], cfg: DSV41FlashConfig) -> list[int]:
    """A prompt in either form -> compact ids (one placeholder per image): expanded spans (what a HF processor,
    hence veRL and vLLM, produce) are folded back; a compact prompt is returned unchanged."""
    ids = [int(t) for t in torch.as_tensor(input_ids, dtype=torch.int64).flatten().tolist()]
    n_image = sum(1 for t in ids if t == cfg.image_token_id)
    spans = [num_image_tokens(*llm_grid_hw(img.grid_hw, cfg.vision.downsample_ratio)) for img in images]
    if n_image == len(images):
        return ids
    if n_image != sum(spans):
        raise ValueError(f"prompt has {n_image} image tokens (image_token_id={cfg.image_token_id}): neither one "
                         f"placeholder per image ({len(images)}) nor the images' expanded spans ({sum(spans)})")
    out, i, image = [], 0, 0
    while i < len(ids):
        if ids[i] == cfg.image_token_id:
            run = spans[image]
            if ids[i:i + run] != [cfg.image_token_id] * run:
                raise ValueError(f"prompt: image {image}'s span at position {i} is shorter than its {run} tokens")
            out.append(cfg.image_token_id)
            i, image = i + run, image + 1
        else:
            out.append(ids[i])
            i += 1
    return out


def split_pixel_values(pixel_values: torch.Tensor, image_grid_hw: Any) -> list[ImageInput]:
    """The processor's `pixel_values` [Σ n_h·n_w, 3·p·p] (images concatenated) + `image_grid_hw` [n_images, 2]
    -> one ImageInput per image, in order."""
    grids = image_grid_hw.tolist() if torch.is_tensor(image_grid_hw) else [list(g) for g in image_grid_hw]
    sizes = [int(h) * int(w) for h, w in grids]
    if pixel_values.ndim != 2 or pixel_values.shape[0] != sum(sizes):
        raise ValueError(f"pixel_values must be [{sum(sizes)}, 3*p*p] for image_grid_hw {grids}, "
                         f"got {list(pixel_values.shape)}")
    return [ImageInput(p, (int(h), int(w))) for p, (h, w) in zip(pixel_values.split(sizes), grids)]


def prepare_vl_inputs(input_ids: Any, images: Sequence[Any], cfg: DSV41FlashConfig,
                      dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, list[ImageInput]]:
    """Preprocess raw images and expand their placeholders -> (ids [S'], token_types [S'], image inputs)."""
    inputs = [img if isinstance(img, ImageInput) else preprocess_image(img, cfg, dtype) for img in images]
    ids, types = expand_image_placeholders(input_ids, inputs, cfg)
    return ids, types, inputs


def _image_spans(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, n_image_tokens) of each span in the flattened token_types, in reading order."""
    starts = (types == IMAGE_START).nonzero().flatten().tolist()
    ends = (types == IMAGE_END).nonzero().flatten().tolist()
    bounds = [b for pair in zip(starts, ends) for b in pair]
    if len(starts) != len(ends) or bounds != sorted(bounds):
        raise ValueError(f"token_types: the {len(starts)} IMAGE_START and {len(ends)} IMAGE_END markers do not "
                         "pair up into disjoint spans")
    is_img = types == IMAGE
    n_img = torch.cumsum(is_img, 0)
    spans = [(s, e, int(n_img[e] - n_img[s])) for s, e in zip(starts, ends)]
    if sum(n for _, _, n in spans) != int(is_img.sum()):
        raise ValueError("token_types: some IMAGE positions lie outside every IMAGE_START..IMAGE_END span")
    return spans


def fill_image_embeddings(h: torch.Tensor, token_types: torch.Tensor, aligner_rows: Sequence[torch.Tensor],
                          image_start: torch.Tensor, image_newline: torch.Tensor, image_end: torch.Tensor
                          ) -> torch.Tensor:
    """Write aligner rows (reading order; spans batch-major) and delimiter vectors into h [S',D] or [B,S',D].

    Out of place, so gradients reach the aligner and the three delimiter parameters.
    """
    if tuple(h.shape[:-1]) != tuple(token_types.shape):
        raise ValueError(f"fill_image_embeddings: h {list(h.shape)} and token_types {list(token_types.shape)} "
                         "disagree on the token dimensions")
    dim = h.shape[-1]
    seqlen = token_types.shape[-1]
    flat_t = token_types.reshape(-1)
    spans = _image_spans(flat_t)
    if len(spans) != len(aligner_rows):
        raise ValueError(f"fill_image_embeddings: token_types hold {len(spans)} image spans but "
                         f"{len(aligner_rows)} aligner outputs were given")
    for i, ((s, e, n), rows) in enumerate(zip(spans, aligner_rows)):
        if s // seqlen != e // seqlen:
            raise ValueError(f"fill_image_embeddings: image span {i} crosses a batch row")
        if rows.ndim != 2 or rows.shape != (n, dim):
            raise ValueError(f"fill_image_embeddings: image span {i} has {n} IMAGE slots of width {dim}, but its "
                             f"aligner output is {list(rows.shape)}")
    out = h.reshape(-1, dim)
    if aligner_rows:
        img_pos = (flat_t == IMAGE).nonzero().flatten()
        out = out.index_put((img_pos,), torch.cat(list(aligner_rows)).to(h.dtype))
    for code, vec in ((IMAGE_START, image_start), (IMAGE_NEWLINE, image_newline), (IMAGE_END, image_end)):
        out = torch.where((flat_t == code).unsqueeze(-1), vec.to(h.dtype), out)
    return out.reshape(h.shape)


class PaddedPrompts(NamedTuple):
    """A right-padded batch: `input_ids`, `token_types` (TEXT on padding) and `valid_mask`, all [B, S]."""

    input_ids: torch.Tensor
    token_types: torch.Tensor
    valid_mask: torch.Tensor


def pad_prompts(prompts: Sequence[tuple[torch.Tensor, torch.Tensor]], pad_token_id: int,
                pad_to_multiple_of: int = 1) -> PaddedPrompts:
    """Right-pad (ids [S_i], token_types [S_i]) pairs to one length; right padding never changes a causal prefix."""
    if not prompts:
        raise ValueError("pad_prompts: no prompts given")
    for i, (ids, types) in enumerate(prompts):
        if ids.ndim != 1 or ids.shape != types.shape:
            raise ValueError(f"pad_prompts: prompt {i} has input_ids {list(ids.shape)} and token_types "
                             f"{list(types.shape)}; expected two equal [S] tensors")
    longest = max(ids.numel() for ids, _ in prompts)
    seqlen = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    bsz = len(prompts)
    input_ids = torch.full((bsz, seqlen), pad_token_id, dtype=torch.int64)
    token_types = torch.full((bsz, seqlen), TEXT, dtype=torch.int64)
    valid = torch.zeros((bsz, seqlen), dtype=torch.bool)
    for b, (ids, types) in enumerate(prompts):
        n = ids.numel()
        input_ids[b, :n], token_types[b, :n], valid[b, :n] = ids, types, True
    return PaddedPrompts(input_ids, token_types, valid)
