"""Adapter file layouts: the one conversion between canonical adapter tensors and each on-disk layout.

Canonical tensors are `lora_state_dict`'s (`state.py`): plain `<m>.lora_A/B.weight`, the grouped `wo_a` as
per-group `[G, r, in_g]` / `[G, out_g, r]` (or shared-A `[r, in_g]` / `[G·out_g, r]`) and the routed experts
packed per layer and projection, `layers.{i}.ffn.experts.{w}.lora_A/B.weight` `[E, r, in]` / `[E, out, r]`
(or the 2-D shared factors of `expert_lora="shared_outer"`). A layout only moves and reshapes bytes:

| layout            | plain linears | `attn.wo_a`                                                   | routed experts                     |
|-------------------|---------------|---------------------------------------------------------------|------------------------------------|
| `peft`            | as is         | PEFT `target_parameters` on `wo_a.weight`: per-group at rank  | one 2-D LoRA per expert module     |
|                   |               | G·r, A = [A_0; …; A_{G-1}] [G·r, in_g], B block-diagonal      | `layers.{i}.ffn.experts.{e}.{w}`   |
|                   |               | [G·out_g, G·r]; shared-A as is at rank r                      |                                    |
| `vllm`, `megatron`| as is         | canonical (per-group stacks at rank r)                        | one 2-D LoRA per expert module     |
| `packed`          | as is         | canonical                                                     | canonical (one tensor per layer)   |

The opt-in router LoRA (`ffn.gate`, not an `nn.Linear`) is a `target_parameters` entry in `peft` as well.

`peft` is what stock PEFT loads natively (`wo_a` is not an `nn.Linear`, so only a parameter LoRA reaches it;
block-diagonal B makes group g see only B_g·A_g). vLLM loads it too, but at rank G·r every LoRA slot of every
module is allocated at `max_lora_rank` ≥ G·r, so `vllm` keeps `wo_a` at rank r in the per-group stacks the
plugin's `GroupedOutputProjectionWithLoRA` takes. `megatron` is what `DSV41Bridge.stream_adapter_weights_
megatron_to_hf` yields (the same tensors as `vllm`). `packed` is the lifecycle store's layout (`dsv4flash-lora/1`
directories). Every conversion is exact both ways (copies and zero blocks only).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

LAYOUTS = ("peft", "vllm", "megatron", "packed")
PER_EXPERT_LAYOUTS = ("peft", "vllm", "megatron")
WO_A_RANK_KEY = r"attn\.wo_a(\.weight)?"  # matches PEFT's parameter key and vLLM's module name alike

_FACTOR = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_PACKED = re.compile(r"(?P<stem>(?:.+\.)?layers\.\d+\.ffn\.experts)\.(?P<w>w[123])")
_PER_EXPERT = re.compile(r"(?P<stem>(?:.+\.)?layers\.\d+\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])")
_GROUPED = re.compile(r"(?:.+\.)?attn\.wo_a")
_ROUTER = re.compile(r"(?:.+\.)?ffn\.gate")  # not an nn.Linear either: PEFT reaches it as a parameter LoRA


class AdapterLayoutError(ValueError):
    """An adapter file does not fit its layout or the model (message names the tensor and what was expected)."""


@dataclass
class LayoutTensors:
    """A layout's file tensors (keys without `base_model.model.`) and what its adapter config must declare."""

    tensors: dict[str, torch.Tensor]
    modules: list[str] = field(default_factory=list)  # 2-D LoRA modules (PEFT `target_modules`)
    parameters: list[str] = field(default_factory=list)  # PEFT `target_parameters`
    rank_scale: dict[str, int] = field(default_factory=dict)  # pattern -> rank multiple of r (G for wo_a)


def is_grouped(module: str) -> bool:
    """Whether a module name is the grouped output projection `attn.wo_a`."""
    return _GROUPED.fullmatch(module) is not None


def factor_pairs(tensors: Mapping[str, torch.Tensor], source: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`<m>.lora_A/B.weight` tensors -> {module: (A, B)}; a stray or unpaired tensor is an error naming it."""
    halves: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, t in tensors.items():
        m = _FACTOR.fullmatch(name)
        if m is None:
            raise AdapterLayoutError(f"{source}: tensor {name!r} is not a LoRA factor (expected <module>.lora_A.weight "
                                     "or <module>.lora_B.weight)")
        halves[m["module"]][m["ab"]] = t
    out = {}
    for module, pair in halves.items():
        for ab in "AB":
            if ab not in pair:
                other = "B" if ab == "A" else "A"
                raise AdapterLayoutError(f"{source}: {module}.lora_{other}.weight has no {module}.lora_{ab}.weight")
        out[module] = (pair["A"], pair["B"])
    return out


def detect_modes(canonical: Mapping[str, torch.Tensor]) -> tuple[str, str]:
    """(`wo_a_lora`, `expert_lora`) of canonical tensors, from the factor shapes."""
    wo_a, experts = "per_group", "per_expert"
    for module, (a, b) in factor_pairs(canonical, "<canonical>").items():
        if is_grouped(module) and a.dim() == 2:
            wo_a = "shared_a"
        if _PACKED.fullmatch(module) and (a.dim() == 2 or b.dim() == 2):
            experts = "shared_outer"
    return wo_a, experts


def to_layout(canonical: Mapping[str, torch.Tensor], layout: str) -> LayoutTensors:
    """Canonical adapter tensors -> `layout`'s file tensors (views where the layout keeps a tensor)."""
    _check_layout(layout)
    out = LayoutTensors({})
    for module, (a, b) in factor_pairs(canonical, "<canonical>").items():
        if module == "head" and layout == "vllm":  # the vllm_3d export goes through here too
            # vLLM names the head `lm_head` and the dsv4flash plugin maps no LoRA onto it; refused, never dropped
            raise AdapterLayoutError("head.lora_A.weight: a LoRA on the output head (train_unembed / "
                                     "LoraConfig.train_head) has no vLLM layout; train with train_unembed=False to "
                                     "serve the adapter with vLLM, or export the peft layout")
        packed = _PACKED.fullmatch(module)
        if packed and layout in PER_EXPERT_LAYOUTS:
            n = a.shape[0] if a.dim() == 3 else b.shape[0]
            for e in range(n):
                name = f"{packed['stem']}.{e}.{packed['w']}"
                out.tensors[f"{name}.lora_A.weight"] = a[e] if a.dim() == 3 else a
                out.tensors[f"{name}.lora_B.weight"] = b[e] if b.dim() == 3 else b
                out.modules.append(name)
            continue
        if is_grouped(module) and layout == "peft":
            if a.dim() == 3:  # per-group -> one parameter LoRA at rank G·r with block-diagonal B
                groups = a.shape[0]
                a, b = a.reshape(groups * a.shape[1], a.shape[2]), torch.block_diag(*b.unbind(0))
                out.rank_scale[WO_A_RANK_KEY] = groups
            out.parameters.append(f"{module}.weight")
        elif layout == "peft" and _ROUTER.fullmatch(module):
            out.parameters.append(f"{module}.weight")
        elif not packed:
            out.modules.append(module)
        out.tensors[f"{module}.lora_A.weight"] = a
        out.tensors[f"{module}.lora_B.weight"] = b
    return out


def from_layout(tensors: Mapping[str, torch.Tensor], layout: str, *, rank: int, wo_a_lora: str = "per_group",
                expert_lora: str = "per_expert", source: str = "<tensors>") -> dict[str, torch.Tensor]:
    """`layout`'s file tensors (no prefix) -> canonical tensors; exact inverse of `to_layout`.

    Errors name the tensor: a per-expert key in a packed file (or the reverse), a missing expert, a
    non-block-diagonal per-group `wo_a`, shared factors that differ between experts.
    """
    _check_layout(layout)
    canonical: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
    for module, (a, b) in factor_pairs(tensors, source).items():
        if m := _PER_EXPERT.fullmatch(module):
            if layout not in PER_EXPERT_LAYOUTS:
                raise AdapterLayoutError(f"{source}: {module}.lora_A.weight is a per-expert tensor, but the '{layout}' "
                                         "layout packs each layer's experts into one tensor per projection")
            experts[(m["stem"], m["w"])][int(m["e"])] = (a, b)
            continue
        if _PACKED.fullmatch(module) and layout in PER_EXPERT_LAYOUTS:
            raise AdapterLayoutError(f"{source}: {module}.lora_A.weight is a packed routed-expert tensor, but the "
                                     f"'{layout}' layout stores one LoRA per expert ({module.rsplit('.', 1)[0]}.<e>."
                                     f"{module.rsplit('.', 1)[1]})")
        if is_grouped(module) and layout == "peft" and wo_a_lora == "per_group":
            a, b = _unblock(module, a, b, rank, source)
        canonical[f"{module}.lora_A.weight"] = a
        canonical[f"{module}.lora_B.weight"] = b
    for (stem, proj), members in sorted(experts.items()):
        a, b = _stack_experts(stem, proj, members, expert_lora, source)
        canonical[f"{stem}.{proj}.lora_A.weight"] = a
        canonical[f"{stem}.{proj}.lora_B.weight"] = b
    return canonical


def target_regex(modules: Iterable[str]) -> str:
    """PEFT `target_modules` as one full-match regex naming exactly `modules` (layer ids and expert ids folded)."""
    by_shape: dict[str, set[str]] = defaultdict(set)
    literal: set[str] = set()
    for name in modules:
        m = re.fullmatch(r"(.*?layers)\.(\d+)\.(.+)", name)
        if m is None:
            literal.add(re.escape(name))
            continue
        rest = re.sub(r"^(ffn\.experts)\.\d+\.", r"\1.<E>.", m[3])
        by_shape[f"{m[1]}\x00{rest}"].add(m[2])
    alts = sorted(literal)
    for key, layers in sorted(by_shape.items()):
        head, rest = key.split("\x00")
        ids = "|".join(sorted(layers, key=int))
        alts.append(rf"{re.escape(head)}\.(?:{ids})\." + re.escape(rest).replace("<E>", r"\d+"))
    return "|".join(alts) if alts else "(?!)"


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown adapter layout {layout!r}; expected one of {LAYOUTS}")


def _unblock(module: str, a: torch.Tensor, b: torch.Tensor, rank: int, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's rank-G·r `wo_a` LoRA with block-diagonal B -> per-group A [G, r, in_g], B [G, out_g, r]."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or b.shape[1] != a.shape[0]:
        raise AdapterLayoutError(f"{source}: {module}.lora_A/B.weight have shapes {list(a.shape)} / {list(b.shape)}; "
                                 f"a per-group wo_a LoRA in the PEFT layout is A [G·r, in_g], B [G·out_g, G·r] with r={rank}")
    groups = a.shape[0] // rank
    if b.shape[0] % groups:
        raise AdapterLayoutError(f"{source}: {module}.lora_B.weight has {b.shape[0]} rows, not a multiple of the "
                                 f"{groups} groups its lora_A implies")
    out_g = b.shape[0] // groups
    blocks = b.view(groups, out_g, groups, rank)
    diag = torch.stack([blocks[g, :, g] for g in range(groups)])
    if torch.count_nonzero(blocks).item() != torch.count_nonzero(diag).item():
        raise AdapterLayoutError(f"{source}: {module}.lora_B.weight is not block-diagonal over its {groups} groups, so "
                                 "per-group wo_a factors cannot represent it (load it with wo_a_lora='shared_a' at "
                                 f"rank {groups * rank})")
    return a.reshape(groups, rank, a.shape[1]).clone(), diag.clone()


def _stack_experts(stem: str, proj: str, members: dict[int, tuple[torch.Tensor, torch.Tensor]], mode: str,
                   source: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert 2-D factors -> packed [E, r, in] / [E, out, r] (or the shared factor of `shared_outer`)."""
    n = max(members) + 1
    missing = [e for e in range(n) if e not in members]
    if missing:
        raise AdapterLayoutError(f"{source}: missing {stem}.{missing[0]}.{proj}.lora_A.weight / lora_B.weight (routed "
                                 f"experts are adapted per layer and projection: all {n} experts need a LoRA)")
    shapes = {(tuple(a.shape), tuple(b.shape)) for a, b in members.values()}
    if len(shapes) != 1:
        raise AdapterLayoutError(f"{source}: the experts of {stem}.*.{proj} disagree on LoRA shapes {sorted(shapes)}")
    shared = {"w1": "A", "w3": "A", "w2": "B"}.get(proj) if mode == "shared_outer" else None
    factors = []
    for index, ab in enumerate("AB"):
        parts = [members[e][index] for e in range(n)]
        if ab == shared:
            for e in range(1, n):
                if not torch.equal(parts[e], parts[0]):
                    raise AdapterLayoutError(f"{source}: {stem}.{e}.{proj}.lora_{ab}.weight differs from expert 0's, but "
                                             f"expert_lora='shared_outer' shares one lora_{ab} across the experts")
            factors.append(parts[0].clone())
        else:
            factors.append(torch.stack(parts))
    return factors[0], factors[1]
