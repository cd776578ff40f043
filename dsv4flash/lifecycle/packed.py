"""Packed MoE LoRA: one 3-D tensor per (layer, projection, A|B) over all experts.

Per-expert layout (PEFT / vLLM 2-D):   layers.{i}.ffn.experts.{e}.{w1|w2|w3}.lora_A.weight   [r, in]
                                       layers.{i}.ffn.experts.{e}.{w1|w2|w3}.lora_B.weight   [out, r]
Packed layout (this module):           layers.{i}.ffn.experts.{w1|w2|w3}.lora_A.weight      [E, r, in]
                                       layers.{i}.ffn.experts.{w1|w2|w3}.lora_B.weight      [E, out, r]
For V4.1 (40 MoE layers × 384 experts × 3 projections × A/B) that is 92 160 tensors → 240, the same
bytes. The packed tensors are exactly the engine's stacked per-expert buffers (vLLM's
`w13_lora_a_stacked[slot]` is `[E, r, in]`), so loading is one read and no per-tensor work.
Non-expert LoRA modules (attention, shared experts, …) are carried unchanged as `dense`, including
the block-diagonal grouped `wo_a` factors `[G, r, in_g]` / `[G, out_g, r]` of `dsv4flash.lora`. The
packed names are the canonical adapter keys of `dsv4flash.lora.state`, so `lora_state_dict(model)`
is directly a packed adapter.
Conversion is lossless both ways: stacking and unstacking only copy bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

from dsv4flash.lifecycle.errors import AdapterFormatError

__all__ = ["PackedMoELoRA", "EXPERT_PROJECTIONS", "per_expert_key", "packed_key"]

EXPERT_PROJECTIONS = ("w1", "w2", "w3")
_PER_EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.lora_([AB])\.weight")
_PACKED = re.compile(r"layers\.(\d+)\.ffn\.experts\.(w[123])\.lora_([AB])\.weight")
_DENSE = re.compile(r"(.+)\.lora_([AB])\.weight")


def per_expert_key(layer: int, expert: int, proj: str, ab: str) -> str:
    """Release-style name of one expert's LoRA factor."""
    return f"layers.{layer}.ffn.experts.{expert}.{proj}.lora_{ab}.weight"


def packed_key(layer: int, proj: str, ab: str) -> str:
    """Name of the stacked factor of one (layer, projection)."""
    return f"layers.{layer}.ffn.experts.{proj}.lora_{ab}.weight"


@dataclass
class PackedMoELoRA:
    """A LoRA adapter whose routed-expert factors are stacked over experts."""

    rank: int
    alpha: float
    num_experts: int
    experts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # A [E,r,in], B [E,out,r]
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # A [r,in], B [out,r]

    def __post_init__(self) -> None:
        for (layer, proj), (a, b) in self.experts.items():
            where = packed_key(layer, proj, "A/B")
            if a.dim() != 3 or b.dim() != 3 or a.shape[0] != self.num_experts or b.shape[0] != self.num_experts:
                raise AdapterFormatError(f"{where}: expected A [E={self.num_experts}, r, in] and B [E, out, r], got {list(a.shape)} / {list(b.shape)}")
            self._check_rank(where, a.shape[1], b.shape[2])
        for name, (a, b) in self.dense.items():
            # 2-D plain linears; 3-D [G, r, in_g]/[G, out_g, r] block-diagonal (grouped wo_a) factors
            if a.dim() != b.dim() or a.dim() not in (2, 3) or (a.dim() == 3 and a.shape[0] != b.shape[0]):
                raise AdapterFormatError(f"{name}: expected A [r, in] / B [out, r] (or grouped [G, r, in_g] / [G, out_g, r]), got {list(a.shape)} / {list(b.shape)}")
            self._check_rank(name, a.shape[-2], b.shape[-1])

    def _check_rank(self, where: str, ra: int, rb: int) -> None:
        if ra != self.rank or rb != self.rank:
            raise AdapterFormatError(f"{where}: LoRA rank {ra}/{rb} differs from the adapter rank {self.rank}")

    # ---- sizes ----
    @property
    def scaling(self) -> float:
        """alpha / rank, the factor on B @ A."""
        return self.alpha / self.rank

    def tensors_per_expert_layout(self) -> int:
        """Tensor objects in the per-expert (PEFT 2-D) layout."""
        return 2 * (len(self.experts) * self.num_experts + len(self.dense))

    def tensors_packed_layout(self) -> int:
        """Tensor objects in the packed layout."""
        return 2 * (len(self.experts) + len(self.dense))

    def nbytes(self) -> int:
        """Payload bytes (identical in both layouts)."""
        pairs = list(self.experts.values()) + list(self.dense.values())
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)

    def moe_layers(self) -> list[int]:
        """MoE layers that carry expert LoRA."""
        return sorted({layer for layer, _ in self.experts})

    # ---- packed tensors ----
    def to_packed_tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict in the packed layout (no copies)."""
        out: dict[str, torch.Tensor] = {}
        for (layer, proj), (a, b) in self.experts.items():
            out[packed_key(layer, proj, "A")] = a
            out[packed_key(layer, proj, "B")] = b
        for name, (a, b) in self.dense.items():
            out[f"{name}.lora_A.weight"] = a
            out[f"{name}.lora_B.weight"] = b
        return out

    @classmethod
    def from_packed_tensors(cls, tensors: Mapping[str, torch.Tensor], *, alpha: float, source: str = "<tensors>") -> "PackedMoELoRA":
        """Inverse of `to_packed_tensors` (views, no copies)."""
        experts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        dense: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            if m := _PACKED.fullmatch(name):
                experts.setdefault((int(m[1]), m[2]), {})[m[3]] = t
            elif _PER_EXPERT.fullmatch(name):
                raise AdapterFormatError(f"{source}: {name!r} is a per-expert key in a packed adapter; use from_per_expert")
            elif m := _DENSE.fullmatch(name):
                dense.setdefault(m[1], {})[m[2]] = t
            else:
                raise AdapterFormatError(f"{source}: tensor {name!r} is not a LoRA factor (expected *.lora_A.weight / *.lora_B.weight)")
        pairs = {k: _pair(v, packed_key(*k, "A/B"), source) for k, v in experts.items()}
        dpairs = {k: _pair(v, k, source) for k, v in dense.items()}
        first = next(iter(pairs.values()), None) or next(iter(dpairs.values()), None)
        if first is None:
            raise AdapterFormatError(f"{source}: no LoRA tensors")
        num_experts = next(iter(pairs.values()))[0].shape[0] if pairs else 0
        rank = first[0].shape[-2]
        return cls(rank=rank, alpha=alpha, num_experts=num_experts, experts=pairs, dense=dpairs)

    # ---- per-expert tensors ----
    def to_per_expert(self) -> dict[str, torch.Tensor]:
        """Flat dict in the per-expert layout (views into the packed tensors, no copies)."""
        out: dict[str, torch.Tensor] = {}
        for (layer, proj), (a, b) in sorted(self.experts.items()):
            for e in range(self.num_experts):
                out[per_expert_key(layer, e, proj, "A")] = a[e]
                out[per_expert_key(layer, e, proj, "B")] = b[e]
        for name, (a, b) in self.dense.items():
            out[f"{name}.lora_A.weight"] = a
            out[f"{name}.lora_B.weight"] = b
        return out

    @classmethod
    def from_per_expert(cls, tensors: Mapping[str, torch.Tensor], *, alpha: float, source: str = "<tensors>", strip_prefix: str = "") -> "PackedMoELoRA":
        """Stack a per-expert adapter; every expert of a packed (layer, projection) must be present."""
        groups: dict[tuple[int, str], dict[tuple[int, str], torch.Tensor]] = {}
        dense: dict[str, dict[str, torch.Tensor]] = {}
        for raw_name, t in tensors.items():
            name = raw_name.removeprefix(strip_prefix)
            if m := _PER_EXPERT.fullmatch(name):
                groups.setdefault((int(m[1]), m[3]), {})[(int(m[2]), m[4])] = t
            elif m := _DENSE.fullmatch(name):
                dense.setdefault(m[1], {})[m[2]] = t
            else:
                raise AdapterFormatError(f"{source}: tensor {raw_name!r} is not a LoRA factor")
        num_experts = 1 + max((e for g in groups.values() for e, _ in g), default=-1)
        experts = {}
        for (layer, proj), members in sorted(groups.items()):
            for e in range(num_experts):
                for ab in "AB":
                    if (e, ab) not in members:
                        raise AdapterFormatError(
                            f"{source}: missing {strip_prefix}{per_expert_key(layer, e, proj, ab)} "
                            f"(layer {layer} {proj} has LoRA for some experts; all {num_experts} are required)"
                        )
            experts[(layer, proj)] = (
                _stack([members[(e, "A")] for e in range(num_experts)], packed_key(layer, proj, "A"), source),
                _stack([members[(e, "B")] for e in range(num_experts)], packed_key(layer, proj, "B"), source),
            )
        dpairs = {k: _pair(v, k, source) for k, v in dense.items()}
        first = next(iter(experts.values()), None)
        rank = first[0].shape[1] if first else next(iter(dpairs.values()))[0].shape[-2]
        return cls(rank=rank, alpha=alpha, num_experts=num_experts, experts=experts, dense=dpairs)

    # ---- math ----
    def delta(self, module: str, expert: int | None = None) -> torch.Tensor:
        """The weight update `scaling · B @ A` (fp32) of a dense module or one routed expert."""
        if expert is None:
            a, b = self.dense[module]
            if a.dim() == 3:  # grouped wo_a: ΔW in the stored [G·out_g, in_g] layout of the base weight
                return (self.scaling * torch.bmm(b.float(), a.float())).flatten(0, 1)
        else:
            m = re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(w[123])", module)
            if not m:
                raise KeyError(f"{module!r} is not a routed-expert module name (layers.<i>.ffn.experts.<w>)")
            a, b = self.experts[(int(m[1]), m[2])]
            a, b = a[expert], b[expert]
        return self.scaling * (b.float() @ a.float())

    def equal(self, other: "PackedMoELoRA") -> bool:
        """Bit-exact equality of every factor (and of rank/alpha/expert count)."""
        if (self.rank, self.alpha, self.num_experts) != (other.rank, other.alpha, other.num_experts):
            return False
        mine, theirs = self.to_packed_tensors(), other.to_packed_tensors()
        return mine.keys() == theirs.keys() and all(
            mine[k].dtype == theirs[k].dtype and torch.equal(mine[k].view(torch.uint8), theirs[k].view(torch.uint8))
            for k in mine
        )

    @classmethod
    def random(
        cls,
        *,
        layers: Iterable[int],
        num_experts: int,
        hidden: int,
        moe_inter: int,
        rank: int = 1,
        alpha: float | None = None,
        dtype: torch.dtype = torch.bfloat16,
        projections: Iterable[str] = EXPERT_PROJECTIONS,
        dense_shapes: Mapping[str, tuple[int, int]] | None = None,
        seed: int = 0,
    ) -> "PackedMoELoRA":
        """A synthetic adapter of a given shape (benchmarks, tests); B is non-zero so deltas are non-trivial."""
        gen = torch.Generator().manual_seed(seed)
        io = {"w1": (hidden, moe_inter), "w2": (moe_inter, hidden), "w3": (hidden, moe_inter)}
        experts = {}
        for layer in layers:
            for proj in projections:
                d_in, d_out = io[proj]
                a = torch.randn(num_experts, rank, d_in, generator=gen).to(dtype)
                b = torch.randn(num_experts, d_out, rank, generator=gen).to(dtype)
                experts[(layer, proj)] = (a, b)
        dense = {}
        for name, (d_out, d_in) in (dense_shapes or {}).items():
            dense[name] = (torch.randn(rank, d_in, generator=gen).to(dtype), torch.randn(d_out, rank, generator=gen).to(dtype))
        return cls(rank=rank, alpha=float(alpha if alpha is not None else 2 * rank), num_experts=num_experts, experts=experts, dense=dense)


def _pair(members: Mapping[str, torch.Tensor], where: str, source: str) -> tuple[torch.Tensor, torch.Tensor]:
    missing = [ab for ab in "AB" if ab not in members]
    if missing:
        raise AdapterFormatError(f"{source}: {where} has no lora_{missing[0]} factor")
    return members["A"], members["B"]


def _stack(parts: list[torch.Tensor], where: str, source: str) -> torch.Tensor:
    shapes = {tuple(p.shape) for p in parts}
    dtypes = {p.dtype for p in parts}
    if len(shapes) != 1 or len(dtypes) != 1:
        raise AdapterFormatError(f"{source}: experts of {where} disagree on shape/dtype: {sorted(shapes)} {sorted(map(str, dtypes))}")
    out = torch.empty((len(parts), *parts[0].shape), dtype=parts[0].dtype)
    for e, p in enumerate(parts):
        out[e].copy_(p)
    return out
