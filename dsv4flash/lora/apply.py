"""`apply_lora`: freeze the base, wrap the selected modules in place, return a `LoraHandle`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsv4flash.lora.config import LoraConfig
from dsv4flash.lora.layers import (ExpertLoraLinear, GroupedLoraProjection, LoraGate, LoraLinear, PackedExpertLora,
                                   PackedFactors, expert_factor_shapes, is_lora_module)
from dsv4flash.lora.targets import expert_site, module_group, resolve_targets

HANDLE_ATTR = "_dsv4flash_lora"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter unit: a module (or a packed expert projection), its kind, group and factor shapes."""

    name: str  # canonical adapter module name, e.g. layers.3.attn.wq_a or layers.3.ffn.experts.w1 (packed)
    kind: str  # linear | grouped | packed_experts | router
    group: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Trainable parameters of this unit."""
        return _prod(self.shape_a) + _prod(self.shape_b)


@dataclass(frozen=True)
class LoraHandle:
    """What `apply_lora` did: the config, the wrapped release modules and the adapter units."""

    config: LoraConfig
    modules: tuple[str, ...]  # every wrapped release module name (per expert), in module order
    adapters: tuple[AdapterInfo, ...]  # adapter units (packed experts: one per layer and projection)
    lora_dtype: torch.dtype = field(default=torch.float32)

    @property
    def trainable_params(self) -> int:
        """Adapter parameters (every one trainable)."""
        return sum(a.numel for a in self.adapters)

    @property
    def master_bytes(self) -> int:
        """Bytes of the adapter master weights (fp32 by default; Adam moments are 2× this again)."""
        return self.trainable_params * torch.empty((), dtype=self.lora_dtype).element_size()

    def params_by_group(self) -> dict[str, int]:
        """Trainable parameters per module group, largest first."""
        out: dict[str, int] = {}
        for a in self.adapters:
            out[a.group] = out.get(a.group, 0) + a.numel
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def layers(self) -> tuple[int, ...]:
        """Backbone layers that carry at least one adapter."""
        ids = {int(n.split(".")[1]) for n in self.modules if n.startswith("layers.")}
        return tuple(sorted(ids))

    def summary(self) -> str:
        """One line per group plus totals, for logs."""
        lines = [f"LoRA preset={self.config.preset} rank={self.config.rank} alpha={self.config.alpha:g} "
                 f"layers={self.config.layers} freeze_kv_write={self.config.freeze_kv_write} vit={self.config.vit}"]
        total = self.trainable_params
        for group, n in self.params_by_group().items():
            lines.append(f"  {group:<16} {n:>14,d}  {100.0 * n / total:5.1f}%")
        lines.append(f"  {'total':<16} {total:>14,d}  master {self.master_bytes / 2**20:,.1f} MiB "
                     f"over {len(self.modules)} modules / {len(self.adapters)} adapter units")
        return "\n".join(lines)


def get_handle(model: nn.Module) -> LoraHandle | None:
    """The handle of the LoRA applied to `model`, or None."""
    return model.__dict__.get(HANDLE_ATTR)


def require_handle(model: nn.Module, what: str) -> LoraHandle:
    """The model's handle, or a clear error naming the caller."""
    handle = get_handle(model)
    if handle is None:
        raise RuntimeError(f"{what}: the model has no LoRA adapters (call dsv4flash.lora.apply_lora first)")
    return handle


def plan_lora(model: nn.Module, lora_cfg: LoraConfig | str) -> LoraHandle:
    """Dry run: the handle `apply_lora` would return, without touching the model (works on `meta`)."""
    cfg = LoraConfig(preset=lora_cfg) if isinstance(lora_cfg, str) else lora_cfg
    targets = resolve_targets(model, cfg)
    r, adapters, seen = cfg.rank, [], set()
    for cand in targets:
        base = model.get_submodule(cand.name)
        if cand.kind == "expert":
            moe_name, _, proj = expert_site(cand.name)
            if (moe_name, proj) in seen:
                continue
            seen.add((moe_name, proj))
            n_experts = len(model.get_submodule(moe_name).experts)
            name, kind = f"{moe_name}.experts.{proj}", "packed_experts"
            shapes = expert_factor_shapes(n_experts, r, base.in_features, base.out_features, proj, cfg.expert_lora)
        elif cand.kind == "grouped":
            name, kind = cand.name, "grouped"
            g, out_g, in_g = base.groups, base.rank, base.in_per_group
            shapes = ((r, in_g), (g * out_g, r)) if cfg.wo_a_lora == "shared_a" else ((g, r, in_g), (g, out_g, r))
        else:
            name, kind = cand.name, cand.kind
            out_f, in_f = base.weight.shape
            shapes = (r, in_f), (out_f, r)
        adapters.append(AdapterInfo(name, kind, module_group(cand.name), *shapes))
    return LoraHandle(config=cfg, modules=tuple(c.name for c in targets), adapters=tuple(adapters),
                      lora_dtype=_DTYPES[cfg.lora_dtype])


def apply_lora(model: nn.Module, lora_cfg: LoraConfig | str) -> LoraHandle:
    """Freeze every base parameter, wrap the modules `lora_cfg` selects, return the handle.

    Applying the same (resolved) config again returns the existing handle; a different one is an error.
    """
    cfg = LoraConfig(preset=lora_cfg) if isinstance(lora_cfg, str) else lora_cfg
    existing = get_handle(model)
    if existing is not None:
        if existing.config.to_dict() == cfg.to_dict():
            return existing
        raise RuntimeError(f"apply_lora: the model already carries LoRA preset {existing.config.preset!r} "
                           f"(rank {existing.config.rank}); a second, different placement ({cfg.preset!r}, rank "
                           f"{cfg.rank}) would stack adapters. Build a fresh model or reuse the existing handle.")
    if any(is_lora_module(m) for m in model.modules()):
        raise RuntimeError("apply_lora: the model already contains LoRA wrappers but no handle (copied model?)")
    targets = resolve_targets(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    dtype = _DTYPES[cfg.lora_dtype]
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    adapters: list[AdapterInfo] = []
    packed: dict[tuple[str, str], PackedFactors] = {}
    for cand in targets:
        base = model.get_submodule(cand.name)
        if cand.kind == "expert":
            moe_name, expert, proj = expert_site(cand.name)
            factors = packed.get((moe_name, proj))
            if factors is None:
                factors = _packed_factors(model, moe_name, proj, base, cfg, dtype, gen)
                packed[(moe_name, proj)] = factors
                adapters.append(AdapterInfo(f"{moe_name}.experts.{proj}", "packed_experts", module_group(cand.name),
                                            tuple(factors.lora_A.shape), tuple(factors.lora_B.shape)))
            wrapper = ExpertLoraLinear(base, factors, expert, cfg.scaling, cfg.dropout)
        else:
            wrapper = _wrap(base, cand.kind, cfg, dtype, gen)
            adapters.append(AdapterInfo(cand.name, cand.kind, module_group(cand.name),
                                        tuple(wrapper.lora_A.shape), tuple(wrapper.lora_B.shape)))
        wrapper.train(base.training)
        _replace(model, cand.name, wrapper)
    handle = LoraHandle(config=cfg, modules=tuple(c.name for c in targets), adapters=tuple(adapters), lora_dtype=dtype)
    model.__dict__[HANDLE_ATTR] = handle
    return handle


def _wrap(base: nn.Module, kind: str, cfg: LoraConfig, dtype, gen) -> nn.Module:
    if kind == "linear":
        return LoraLinear(base, cfg.rank, cfg.scaling, cfg.dropout, dtype, gen)
    if kind == "grouped":
        return GroupedLoraProjection(base, cfg.rank, cfg.scaling, cfg.dropout, dtype, gen,
                                     shared_a=cfg.wo_a_lora == "shared_a")
    if kind == "router":
        return LoraGate(base, cfg.rank, cfg.scaling, cfg.dropout, dtype, gen)
    raise AssertionError(f"unknown LoRA candidate kind {kind!r}")


def _packed_factors(model, moe_name: str, proj: str, base: nn.Linear, cfg: LoraConfig, dtype, gen) -> PackedFactors:
    moe = model.get_submodule(moe_name)
    holder = moe._modules.get("experts_lora")
    if holder is None:
        holder = PackedExpertLora(cfg.scaling, cfg.dropout)
        moe.add_module("experts_lora", holder)
    factors = PackedFactors(len(moe.experts), cfg.rank, base.in_features, base.out_features, dtype,
                            base.weight.device, gen, proj=proj, mode=cfg.expert_lora)
    holder.add_module(proj, factors)
    return factors


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module) if not child.isdigit() else parent.__setitem__(int(child), module)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
