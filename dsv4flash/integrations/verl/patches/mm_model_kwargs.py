"""Runtime twin of DSV41-VERL-012: veRL's Megatron forward functions pass every multimodal input the model declares.

Why: `verl/models/mcore/model_forward.py` (`model_forward_gen`, `gptmodel_forward_model_engine`) and
`model_forward_fused.py` (`fused_forward_model_gen`, `fused_forward_model_engine`) copy only `pixel_values`,
`image_grid_thw`, `pixel_values_videos` and `video_grid_thw` out of the batch's `multi_modal_inputs`: Qwen-VL's
names. Any other processor's inputs are dropped on the way to the model, so DeepSeek-V4.1's `image_grid_hw`
and `token_types` (the image spans) never reach `DSV41MegatronModel.forward(..., token_types=, pixel_values=,
image_grid_hw=)`, which then refuses the pixels ("pixel_values need token_types marking the image spans").

How: the upstream form adds `verl.models.mcore.util.multi_modal_model_kwargs(model, multi_modal_inputs,
device)`, used by all four functions: the four default keys as before, plus every other key of
`multi_modal_inputs` that the (unwrapped) model's `forward` declares as a named argument, except the ones the
forward functions build themselves (`input_ids`, `packed_seq_params`, `labels`, ...). A processor output the
model does not name (`images_seqlens`) is still never passed. The twin wraps the four functions: the extra keys
are added to the model call by a forward pre-hook on the model for the duration of the call (the functions'
own keyword arguments win), and the registry's bindings point at the wrappers.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = (
    "verl.models.mcore.model_forward.model_forward_gen",
    "verl.models.mcore.model_forward.gptmodel_forward_model_engine",
    "verl.models.mcore.model_forward_fused.fused_forward_model_gen",
    "verl.models.mcore.model_forward_fused.fused_forward_model_engine",
)
# What stock veRL 0.9.1 already passes when present.
DEFAULT_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# Model arguments the forward functions build themselves; a processor output of that name is never passed.
FORWARD_BUILT_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "packed_seq_params", "labels",
                                "loss_mask", "padding_mask", "decoder_input", "inference_context",
                                "inference_params", "runtime_gather_output"})


def multi_modal_model_kwargs(model: torch.nn.Module, multi_modal_inputs: dict, device: Any) -> dict:
    """The model kwargs of `multi_modal_inputs`: the default keys plus every key the model's forward names."""
    from verl.utils.megatron_utils import unwrap_model

    if not multi_modal_inputs:
        return {}
    params = inspect.signature(type(unwrap_model(model)).forward).parameters
    declared = {n for n, p in params.items()
                if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    keys = [k for k in multi_modal_inputs if k in DEFAULT_KEYS or (k in declared and k not in FORWARD_BUILT_KEYS)]
    return {k: multi_modal_inputs[k].to(device) if isinstance(multi_modal_inputs[k], torch.Tensor)
            else multi_modal_inputs[k] for k in keys}


def passing_declared_keys(forward_fn: Callable) -> Callable:
    """`forward_fn(model, ..., multi_modal_inputs, ...)` whose model call also gets the declared extra keys."""
    signature = inspect.signature(forward_fn)

    @functools.wraps(forward_fn)
    def forward(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        model, inputs = bound.get("model"), bound.get("multi_modal_inputs") or {}
        device = bound["input_ids"].device if isinstance(bound.get("input_ids"), torch.Tensor) else None
        extra = {k: v for k, v in multi_modal_model_kwargs(model, inputs, device).items() if k not in DEFAULT_KEYS}
        if not extra or not isinstance(model, torch.nn.Module):
            return forward_fn(*args, **kwargs)

        def add_keys(_module, call_args, call_kwargs):
            return call_args, {**extra, **call_kwargs}

        handle = model.register_forward_pre_hook(add_keys, with_kwargs=True)
        try:
            return forward_fn(*args, **kwargs)
        finally:
            handle.remove()

    return forward


def upstream_passes_declared_keys() -> bool:
    """Probe: does veRL have `multi_modal_model_kwargs` in `verl.models.mcore.util`?"""
    from verl.models.mcore import util

    probe = getattr(util, "multi_modal_model_kwargs", None)
    return callable(probe) and not getattr(probe, "__module__", "").startswith("dsv4flash")


@verl_twin(
    patch_id="DSV41-VERL-012",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_MM_MODEL_KWARGS",
    tests=("tests/verl/test_mm_model_kwargs.py",),
    upstream_has_it=upstream_passes_declared_keys,
)
def install(patcher: Patcher) -> None:
    """Wrap the two engine functions and the two generators (their closures) where veRL defines and binds them."""
    from verl.models.mcore import model_forward, model_forward_fused, registry

    engine, fused_engine_gen = model_forward.gptmodel_forward_model_engine, model_forward_fused.fused_forward_model_engine
    gen, fused_gen = model_forward.model_forward_gen, model_forward_fused.fused_forward_model_gen

    def model_forward_gen(vision_model: bool = False):
        """veRL's `model_forward_gen`, passing the model's declared multimodal keys."""
        return passing_declared_keys(gen(vision_model))

    def fused_forward_model_gen(vision_model: bool = False):
        """veRL's `fused_forward_model_gen`, passing the model's declared multimodal keys."""
        return passing_declared_keys(fused_gen(vision_model))

    def fused_forward_model_engine(vision_model: bool = False):
        """veRL's `fused_forward_model_engine`, passing the model's declared multimodal keys."""
        return passing_declared_keys(fused_engine_gen(vision_model))

    gptmodel_forward_model_engine = passing_declared_keys(engine)
    for module, name, value in ((model_forward, "gptmodel_forward_model_engine", gptmodel_forward_model_engine),
                                (model_forward, "model_forward_gen", model_forward_gen),
                                (model_forward_fused, "fused_forward_model_gen", fused_forward_model_gen),
                                (model_forward_fused, "fused_forward_model_engine", fused_forward_model_engine)):
        patcher.replace(module, name, value)
        if getattr(registry, name, None) is not None:
            patcher.replace(registry, name, value)
