"""`DeepseekV41ForCausalLM`: the reference model (`dsv4flash.model.transformer.Transformer`) as a transformers model.

One model implementation: the reference model is built and its modules and parameters are adopted as this
module's own children, so `named_parameters()` / `state_dict()` keys are the release names (no `model.`
prefix) and PEFT's adapter keys `base_model.model.<name>` name release tensors; the forward runs the
reference model's own `embed_inputs` / `run_layers` / `logits` on them. `base_model_prefix` is "" because
the model is its own base model (the release checkpoint has no prefix either).

`past_key_values` is the reference model's CSA2 decode cache (`dsv4flash.model.cache.DecodeCache`: window KV
per layer, compressed KV and index keys per kv source, Engram look-back; docs/decode.md). With `use_cache`
the first forward prefills and returns it, and `generate()` then runs one cached decode step per token
(beam search reorders it with `DecodeCache.select`). A padded batch (an `attention_mask` with zeros) cannot
share one cache (its rows sit at different positions): it runs the full forward per step, with a one-time
warning.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from dsv4flash.hf.configuration import DeepseekV41Config
from dsv4flash.model.cache import DecodeCache
from dsv4flash.model.image import TEXT, split_pixel_values
from dsv4flash.model.transformer import Transformer

__all__ = ["DeepseekV41PreTrainedModel", "DeepseekV41ForCausalLM"]

log = logging.getLogger("dsv4flash.hf")

# Hub keyword arguments that AutoModel passes along; they do not apply to a local directory.
_HUB_KWARGS = {"cache_dir", "force_download", "local_files_only", "proxies", "revision", "token", "trust_remote_code",
               "_commit_hash", "_from_auto", "_from_pipeline", "code_revision", "adapter_kwargs", "use_safetensors",
               "attn_implementation", "low_cpu_mem_usage", "resume_download", "user_agent"}


class DeepseekV41PreTrainedModel(PreTrainedModel):
    """transformers plumbing shared by the V4.1 model classes."""

    config_class = DeepseekV41Config
    base_model_prefix = ""  # the model is its own base model: parameter names are the release names
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block", "DSparkBlock", "VisionTower", "Aligner"]

    def _init_weights(self, module: nn.Module) -> None:
        """No-op: the reference model initialises itself (`dsv4flash.model.init`, seeded)."""

    def _check_and_adjust_attn_implementation(self, attn_implementation: str | None, is_init_check: bool = False,
                                              allow_all_kernels: bool = False) -> str:
        """Always "eager": the reference model runs its own CSA2 attention, transformers' backends do not apply
        (veRL asks for flash_attention_2 on every config it loads; that must not stop the model from building)."""
        if attn_implementation not in (None, "eager"):
            log.info("DeepseekV41ForCausalLM: attn_implementation=%r does not apply (CSA2 attention); using the "
                     "reference attention", attn_implementation)
        return "eager"


class DeepseekV41ForCausalLM(DeepseekV41PreTrainedModel, GenerationMixin):
    """DeepSeek-V4.1-Flash for causal LM (text and image prompts), wrapping the reference model."""

    # The reference model's own forward (its other methods are copied in below the class).
    reference_forward = Transformer.forward

    def __init__(self, config: DeepseekV41Config, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, seed: int | None = 0) -> None:
        """Build the reference model (dtype: torch's default, which `from_config(dtype=...)` sets; seeded init)."""
        super().__init__(config)
        dtype = dtype or torch.get_default_dtype()
        core = Transformer(config.to_dsv4flash(), dtype=dtype, device=device, seed=seed)
        self.cfg = core.cfg
        for name, child in core._modules.items():
            self.add_module(name, child)
        for name, param in core._parameters.items():
            self.register_parameter(name, param)
        for name, buf in core._buffers.items():
            self.register_buffer(name, buf, persistent=name not in core._non_persistent_buffers_set)
        for name in ("vision", "aligner", "engram_hasher"):  # None when the config has no such part
            if getattr(core, name) is None:
                setattr(self, name, None)
        self.release_layout: Path | None = None  # set by from_pretrained: what save_pretrained needs to export
        self.post_init()

    # ---- transformers interface --------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (`embed`)."""
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        """Replace the token embedding."""
        self.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        """The fp32 LM head (`head`)."""
        return self.head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        """Replace the LM head."""
        self.head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """False: CSA2 layers keep compressed state a DynamicCache cannot hold; the model makes its own cache."""
        return False

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, token_types: torch.Tensor | None = None,
                images: Sequence | None = None, past_key_values: Any = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                return_dict: bool | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_hw: torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """input_ids [B,S] (image spans expanded; `token_types` [B,S]: -1 text, >= 0 span codes; the images as
        the processor gives them, `pixel_values` + `image_grid_hw`, or as `images`, ImageInput per span,
        batch-major) -> logits [B,S,vocab] fp32, loss if `labels` [B,S] (-100 ignored)."""
        images = _images_of(images, pixel_values, image_grid_hw)
        if inputs_embeds is not None:
            raise ValueError("DeepseekV41ForCausalLM: inputs_embeds is not supported (the embedding step also hashes "
                             "Engram n-grams from input_ids); pass input_ids")
        if input_ids is None:
            raise ValueError("DeepseekV41ForCausalLM: input_ids is required")
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        cache = None
        if past_key_values is not None:
            if not isinstance(past_key_values, DecodeCache):
                raise ValueError(f"DeepseekV41ForCausalLM: past_key_values must be the DecodeCache this model "
                                 f"returned, got {type(past_key_values).__name__}")
            if padded:
                raise ValueError("DeepseekV41ForCausalLM: past_key_values with a padded attention_mask: a cache "
                                 "holds rows of equal length only")
            logits, cache = self.decode(past_key_values, input_ids, token_types)  # the new tokens only
        elif use_cache and not padded:
            logits, cache = self.prefill(input_ids, token_types, images)  # [B,S,V], the prompt's cache
        else:
            if use_cache:
                _warn_no_cache()
            logits = self._masked_logits(input_ids, attention_mask, token_types, images)  # [B,S,V] fp32
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.cfg.text.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def _masked_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       token_types: torch.Tensor | None, images: Sequence | None) -> torch.Tensor:
        """Reference logits; rows with padding run on their contiguous valid span alone (pads get zeros)."""
        if attention_mask is None or bool(attention_mask.bool().all()):
            return self.reference_forward(input_ids, token_types, images)
        if images:
            raise ValueError("DeepseekV41ForCausalLM: padded batches with images are not supported; run image "
                             "prompts unpadded (one per call) or pad on the right without attention_mask")
        mask = attention_mask.bool()
        out = torch.zeros(*input_ids.shape, self.cfg.text.vocab_size, dtype=torch.float32, device=input_ids.device)
        for b in range(input_ids.shape[0]):
            valid = mask[b].nonzero().flatten()
            if valid.numel() == 0:
                continue
            start, stop = int(valid[0]), int(valid[-1]) + 1
            if valid.numel() != stop - start:
                raise ValueError(f"attention_mask row {b} has holes; only left or right padding is supported")
            types = token_types[b:b + 1, start:stop] if token_types is not None else None
            out[b, start:stop] = self.reference_forward(input_ids[b:b + 1, start:stop], types)[0]
        return out

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      token_types: torch.Tensor | None = None, images: Sequence | None = None,
                                      past_key_values: DecodeCache | None = None, use_cache: bool | None = None,
                                      pixel_values: torch.Tensor | None = None,
                                      image_grid_hw: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        """With a cache only the tokens it has not seen, else the whole sequence; generated positions are text."""
        images = _images_of(images, pixel_values, image_grid_hw)
        if token_types is not None and token_types.shape[1] < input_ids.shape[1]:
            grow = input_ids.shape[1] - token_types.shape[1]
            token_types = torch.cat([token_types, token_types.new_full((token_types.shape[0], grow), TEXT)], dim=1)
        if past_key_values is not None:
            seen = past_key_values.length
            input_ids = input_ids[:, seen:]
            token_types = None if token_types is None else token_types[:, seen:]
            images = None  # image spans live in the prompt, which the cache already holds
        return {"input_ids": input_ids, "attention_mask": attention_mask, "token_types": token_types,
                "images": images, "past_key_values": past_key_values, "use_cache": use_cache}

    def _reorder_cache(self, past_key_values: DecodeCache, beam_idx: torch.Tensor) -> DecodeCache:
        """Beam search: the cache rows of the surviving beams."""
        return past_key_values.select(beam_idx)

    # ---- checkpoints ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any,
                        config: DeepseekV41Config | None = None, dtype: Any = None, device: Any = None,
                        progress: bool = False, subfolder: str = "", staging_dir: str | os.PathLike | None = None,
                        **kwargs: Any) -> "DeepseekV41ForCausalLM":
        """Load a local directory: release layout (FP8/MXFP4/Engram decoded by the bridge under `staging_dir`),
        a `convert import` output, or a dsv4flash base (`model.safetensors` + config.json). dtype: float32 by
        default, "auto" = config.dtype."""
        from dsv4flash.hf.checkpoint import detect_layout, load_checkpoint

        dtype = kwargs.pop("torch_dtype", None) if dtype is None else dtype
        device = kwargs.pop("device_map", None) if device is None else device
        unknown = sorted(set(kwargs) - _HUB_KWARGS)
        if model_args or unknown:
            raise TypeError(f"DeepseekV41ForCausalLM.from_pretrained: unsupported argument(s) "
                            f"{unknown or list(model_args)}")
        directory = Path(pretrained_model_name_or_path) / subfolder
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: not a local checkpoint directory (nothing is downloaded)")
        layout = detect_layout(directory)  # headers only: a directory without weights fails before allocating
        if config is None:
            config = DeepseekV41Config.from_pretrained(directory)
        if dtype is None or dtype == "auto":
            dtype = torch.float32 if dtype is None else config.dtype
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if isinstance(device, dict):
            raise TypeError("DeepseekV41ForCausalLM.from_pretrained: device_map must name one device (the reference "
                            "model is single-device), got a dict")
        device = None if device in (None, "auto") else device
        model = cls(config, dtype=dtype, device=device or "cpu", seed=None)  # seed=None: allocated, not initialised
        model.release_layout = load_checkpoint(model, directory, progress=progress, staging_dir=staging_dir,
                                               layout=layout)
        model.name_or_path = str(directory)
        model.config.name_or_path = str(directory)
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        state_dict: dict | None = None, max_shard_size: int | str = "5GB", progress: bool = False,
                        **kwargs: Any) -> None:
        """Write the release layout (bit-exact where unchanged) if loaded from one, else a dsv4flash base."""
        from dsv4flash.hf.checkpoint import save_checkpoint

        if kwargs.get("push_to_hub"):
            raise ValueError("DeepseekV41ForCausalLM.save_pretrained: push_to_hub is not supported (local only)")
        if state_dict is not None:
            raise ValueError("DeepseekV41ForCausalLM.save_pretrained: state_dict is not supported; it saves the "
                             "model's own parameters")
        if is_main_process:
            save_checkpoint(self, Path(save_directory), max_shard_size=max_shard_size, progress=progress)


def _images_of(images: Sequence | None, pixel_values: torch.Tensor | None,
               image_grid_hw: torch.Tensor | None) -> Sequence | None:
    """`images`, or the ImageInputs of the processor's `pixel_values` + `image_grid_hw` (exactly one form)."""
    if pixel_values is None and image_grid_hw is None:
        return images
    if pixel_values is None or image_grid_hw is None:
        raise ValueError("DeepseekV41ForCausalLM: pixel_values and image_grid_hw come together (the processor's "
                         "output); got only " + ("pixel_values" if pixel_values is not None else "image_grid_hw"))
    if images is not None:
        raise ValueError("DeepseekV41ForCausalLM: pass the images once, as images= or as pixel_values= + "
                         "image_grid_hw=, not both")
    return split_pixel_values(pixel_values, image_grid_hw)


@functools.lru_cache(maxsize=1)
def _warn_no_cache() -> None:
    """Once per process: a padded batch cannot use the cache."""
    log.warning("DeepseekV41ForCausalLM: use_cache=True with a padded attention_mask: rows of different lengths "
                "cannot share one decode cache, so every step reruns the full sequence (past_key_values is None)")


def _adopt_reference_methods(cls: type) -> None:
    """Give `cls` every method of the reference model (embed_inputs, run_layers, logits, and whatever it
    gains, e.g. prefill/decode), so they run on the adopted children; transformers' own names win."""
    for name, value in vars(Transformer).items():
        if callable(value) and not name.startswith("__") and name != "forward" and not hasattr(cls, name):
            setattr(cls, name, value)


_adopt_reference_methods(DeepseekV41ForCausalLM)
