"""Adapter tensors by canonical name: state dict save/load and group zeroing.

Canonical adapter keys (also the PEFT file keys, minus `base_model.model.`, and the packed layout of
`dsv4flash.lifecycle.packed`):

    <module>.lora_A.weight / <module>.lora_B.weight          linear, router: [r, in] / [out, r]
    layers.{i}.attn.wo_a.lora_A.weight / .lora_B.weight        grouped: [G, r, in_g] / [G, out_g, r]
    layers.{i}.ffn.experts.{w}.lora_A.weight / .lora_B.weight  packed experts: [E, r, in] / [E, out, r]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from dsv4flash.lora.apply import require_handle
from dsv4flash.lora.targets import expand_groups, module_group

PEFT_PREFIX = "base_model.model."
_FACTORS = (".lora_A", ".lora_B")


def canonical_key(param_name: str) -> str:
    """In-memory factor name -> canonical adapter key (`…experts_lora.w1.lora_A` -> `…experts.w1.lora_A.weight`)."""
    if not param_name.endswith(_FACTORS):
        raise ValueError(f"{param_name!r} is not a LoRA factor parameter (expected a name ending in .lora_A/.lora_B)")
    return param_name.replace(".ffn.experts_lora.", ".ffn.experts.") + ".weight"


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical key -> adapter Parameter (the live objects, in module order)."""
    return {canonical_key(n): p for n, p in model.named_parameters() if n.endswith(_FACTORS)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical key -> detached adapter tensor (shares storage with the live parameters)."""
    require_handle(model, "lora_state_dict")
    return {k: p.detach() for k, p in lora_parameters(model).items()}


def check_lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True,
                          source: str = "<state dict>") -> None:
    """Raise unless `state` fits the model's placement: every key (with `strict`: and no other), exact shapes.

    Errors name the tensor and what was expected (the module the placement adapts and its shape, or why the
    placement has no adapter there). Works on a `meta` model.
    """
    handle = require_handle(model, "check_lora_state_dict")
    params = lora_parameters(model)
    given = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
    missing = [k for k in params if k not in given]
    unexpected = [k for k in given if k not in params]
    if strict and (missing or unexpected):
        first = missing[0] if missing else unexpected[0]
        why = (f"the placement adapts {first.rsplit('.lora_', 1)[0]}, expected shape {list(params[first].shape)}"
               if missing else explain_unexpected(model, handle, first))
        raise KeyError(f"{source}: adapter keys do not match the model's LoRA placement: missing {missing[:5]}"
                       f"{' …' if len(missing) > 5 else ''} ({len(missing)}), unexpected {unexpected[:5]}"
                       f"{' …' if len(unexpected) > 5 else ''} ({len(unexpected)}); {first}: {why}")
    for key, value in given.items():
        if key in params and tuple(value.shape) != tuple(params[key].shape):
            raise ValueError(f"{source}: tensor {key!r} has shape {list(value.shape)}, the model's adapter "
                             f"expects {list(params[key].shape)} (placement rank {handle.config.rank})")


def load_lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool = True,
                         source: str = "<state dict>") -> list[str]:
    """Copy adapter tensors into the model (keys canonical, optionally PEFT-prefixed); returns keys loaded.

    Checked first by `check_lora_state_dict` (exact shapes; with `strict`, no missing or unexpected keys).
    """
    check_lora_state_dict(model, state, strict=strict, source=source)
    params = lora_parameters(model)
    loaded = []
    with torch.no_grad():
        for key, value in state.items():
            key = key.removeprefix(PEFT_PREFIX)
            if key in params:
                params[key].copy_(value.to(device=params[key].device))
                loaded.append(key)
    return loaded


def explain_unexpected(model: nn.Module, handle, key: str) -> str:
    """Why the model's placement has no adapter tensor `key` (frozen KV writer, layer range, rules, no such module)."""
    from dsv4flash.lora.targets import candidates, kv_write_modules, layer_ids, layer_of

    cfg = handle.config
    module = key.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
    probe = module.replace(".ffn.experts.", ".ffn.experts.0.") if module.count(".experts.") == 1 and \
        module.split(".ffn.experts.")[-1] in ("w1", "w2", "w3") else module
    names = {c.name for c in candidates(model)}
    if probe not in names:
        return f"{module} is not a LoRA-capable module of this model"
    if cfg.freeze_kv_write and probe in kv_write_modules(model):
        return (f"placement {cfg.preset!r} freezes the CED source layer's KV writers (freeze_kv_write), so {module} "
                "never carries LoRA")
    layer = layer_of(probe)
    text = model.cfg.text
    if layer is not None and layer not in layer_ids(cfg.layers, text.num_hidden_layers, model.cfg.decoder_start):
        return f"layer {layer} is outside placement {cfg.preset!r}'s layers={cfg.layers!r}"
    return f"placement {cfg.preset!r} does not target {module} (include={cfg.include}, exclude={cfg.exclude})"


def zero_lora(model: nn.Module, group: str | Iterable[str] | None = None) -> list[str]:
    """Zero B (so ΔW = 0 exactly) of every adapter, or of those in `group` (names or aliases, see
    `targets.GROUPS` / `GROUP_ALIASES`); returns the adapter modules zeroed."""
    require_handle(model, "zero_lora")
    groups = None if group is None else expand_groups(group if isinstance(group, str) else tuple(group))
    zeroed = []
    with torch.no_grad():
        for key, param in lora_parameters(model).items():
            if key.endswith(".lora_B.weight") and (groups is None or module_group(key) in groups):
                param.zero_()
                zeroed.append(key.removesuffix(".lora_B.weight"))
    return zeroed


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without adapter factors: release names only (what a base checkpoint holds)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith(_FACTORS) and ".experts_lora." not in k}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Release-named state dict with every adapter folded in (W + ΔW, in W's dtype); the model is untouched.

    Loading it into a fresh base model reproduces the adapted model's outputs up to the rounding of W's
    dtype (fp32: ~1e-6 relative).
    """
    from dsv4flash.lora.layers import is_lora_module

    require_handle(model, "merged_state_dict")
    out = base_state_dict(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_lora_module(module):
                key = f"{name}.weight"
                out[key] = (out[key].float() + module.delta_weight().to(out[key].device)).to(out[key].dtype)
    return out
