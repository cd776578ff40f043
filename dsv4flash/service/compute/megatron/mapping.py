"""Megatron adapter parameters <-> canonical adapter tensors, derived from the bridge's own adapter export.

The trainer group holds each policy's LoRA as Megatron parameters, local to each rank (experts split over EP
ranks, factors over TP, dense adapters replicated over DP, fused projections such as `linear_fc1` = gate ‖ up
holding two release modules). The lifecycle store, the samplers and the local trainer speak canonical tensors
(`dsv4flash.lora.layouts`). Megatron-Bridge exports adapters (release names, the `megatron` layout) but has no
import, and the name rules are the bridge's to own. So the mapping is read off the export itself: every rank
fills its adapter parameters with distinct integer codes (1-based global element numbers, written in digits
of `bits` bits so the dtype holds them exactly), exports, converts to canonical; the canonical tensor then
says, element by element, which rank's which element it is a copy of (0: a structural zero of the layout).
Export of a policy is a gather over those sources; import gives every local element the first canonical
element that copies it (in key order, so `w1.lora_A` before `w3.lora_A` of a fused gate/up). `check_roundtrip`
refuses canonical tensors Megatron cannot hold (two copies that differ, a value where the layout has a zero),
naming the tensor. Nothing here imports Megatron or veRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Integer digits a floating dtype holds exactly (mantissa bits + the implicit one, minus one to stay clear of
# the rounding boundary).
DIGIT_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def digits_needed(total: int, bits: int) -> int:
    """Probe passes for `total` codes (1 … total) in base 2**bits."""
    passes = 1
    while total >= (1 << (bits * passes)):
        passes += 1
    return passes


def probe_values(numels: list[int], offset: int, bits: int, digit: int) -> list[torch.Tensor]:
    """Digit `digit` of the codes offset+1 … offset+Σnumels, one flat int64 tensor per parameter."""
    out, start = [], offset + 1
    for n in numels:
        codes = torch.arange(start, start + n, dtype=torch.int64)
        out.append((codes >> (bits * digit)) & ((1 << bits) - 1))
        start += n
    return out


@dataclass
class AdapterMap:
    """Where each canonical adapter element comes from and where each rank's Megatron element goes."""

    keys: tuple[str, ...]  # canonical tensor names (sorted)
    shapes: tuple[tuple[int, ...], ...]
    rank_params: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # per rank: (Megatron name, shape) in order
    export_src: torch.Tensor  # [C] int64: global element number (0-based) each canonical element copies, or -1
    import_idx: tuple[torch.Tensor, ...]  # per rank [n_r] int64: the canonical element each local element takes

    @classmethod
    def from_codes(cls, keys, shapes, rank_params, rank_codes: list[torch.Tensor]) -> "AdapterMap":
        """From each rank's decoded canonical codes (its own export: dense adapters are its own copies)."""
        numels = [sum(_numel(s) for _, s in params) for params in rank_params]
        offsets = [sum(numels[:r]) for r in range(len(numels))]
        total = sum(numels)
        first = rank_codes[0]
        if any(c.shape != first.shape for c in rank_codes):
            raise RuntimeError("adapter export: the ranks exported canonical tensors of different sizes")
        export_src = first - 1  # codes are 1-based; 0 (a structural zero) becomes -1
        imports = []
        for r, codes in enumerate(rank_codes):
            lo, hi = offsets[r] + 1, offsets[r] + numels[r]
            mine = torch.nonzero((codes >= lo) & (codes <= hi)).squeeze(-1)  # ascending: first copy wins
            idx = torch.full((numels[r],), -1, dtype=torch.int64)
            local = codes[mine] - lo
            # scatter the positions in reverse so that, for duplicates, the lowest position is written last
            idx[local.flip(0)] = mine.flip(0)
            missing = int((idx < 0).sum())
            if missing:
                name = _param_of(rank_params[r], int(torch.nonzero(idx < 0)[0]))
                raise RuntimeError(f"adapter export: {missing} elements of rank {r}'s adapter (first in {name}) "
                                   f"appear in no exported tensor")
            imports.append(idx)
        bad = (export_src < -1) | (export_src >= total)
        if bool(bad.any()):
            raise RuntimeError("adapter export: an exported value is not a probe code (the export is not a copy)")
        return cls(tuple(keys), tuple(tuple(s) for s in shapes), tuple(tuple(p) for p in rank_params), export_src,
                   tuple(imports))

    @property
    def numel(self) -> int:
        """Canonical elements of the shell."""
        return int(self.export_src.numel())

    def rank_numels(self) -> list[int]:
        """Adapter elements held by each rank."""
        return [sum(_numel(s) for _, s in params) for params in self.rank_params]

    def to_canonical(self, rank_flat: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each rank's flat adapter values (parameters in order) -> canonical tensors (fp32)."""
        every = torch.cat([v.reshape(-1).to(torch.float32) for v in rank_flat])
        flat = torch.zeros(self.numel, dtype=torch.float32)
        have = self.export_src >= 0
        flat[have] = every[self.export_src[have]]
        return self._split(flat)

    def to_local(self, canonical: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Canonical tensors of the whole shell -> each rank's flat adapter values (fp32)."""
        flat = self._cat(canonical)
        return [flat[idx] for idx in self.import_idx]

    def check_roundtrip(self, canonical: dict[str, torch.Tensor], what: str) -> None:
        """Refuse canonical tensors the Megatron adapter cannot hold exactly, naming the first tensor that differs
        after import and export (e.g. gate and up LoRA A of one fused `linear_fc1`, which Megatron shares)."""
        back = self.to_canonical(self.to_local(canonical))
        for key in self.keys:
            if not torch.equal(back[key], canonical[key].to(torch.float32)):
                diff = float((back[key] - canonical[key].to(torch.float32)).abs().max())
                raise ValueError(f"{what}: tensor {key} cannot be held by the Megatron trainer's adapter (max "
                                 f"|difference| after import {diff:.3g}: the Megatron module that holds it shares "
                                 f"its factors with another release module, or its layout has zeros there)")

    def split_local(self, rank: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """One rank's flat values -> {Megatron name: tensor}."""
        out, start = {}, 0
        for name, shape in self.rank_params[rank]:
            n = _numel(shape)
            out[name] = flat[start:start + n].view(shape)
            start += n
        return out

    def _cat(self, canonical: dict[str, torch.Tensor]) -> torch.Tensor:
        missing = [k for k in self.keys if k not in canonical]
        extra = sorted(set(canonical) - set(self.keys))
        if missing or extra:
            raise KeyError(f"adapter tensors do not match the trainer's shell: missing {missing[:3]}, unexpected "
                           f"{extra[:3]}")
        parts = []
        for key, shape in zip(self.keys, self.shapes):
            t = canonical[key]
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor {key} has shape {list(t.shape)}, the trainer's shell {list(shape)}")
            parts.append(t.reshape(-1).to(torch.float32))
        return torch.cat(parts)

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for key, shape in zip(self.keys, self.shapes):
            n = _numel(shape)
            out[key] = flat[start:start + n].view(shape).clone()
            start += n
        return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _param_of(params, index: int) -> str:
    start = 0
    for name, shape in params:
        start += _numel(shape)
        if index < start:
            return name
    return "?"


# ---- rank padding: a policy of rank r inside the shell's rank R ----
def rank_dim(key: str) -> int:
    """The LoRA rank's dimension of a canonical factor: A is [..., r, in], B is [..., out, r]."""
    if key.endswith("lora_A.weight"):
        return -2
    if key.endswith("lora_B.weight"):
        return -1
    raise ValueError(f"tensor {key}: not a LoRA factor (<module>.lora_A.weight or <module>.lora_B.weight)")


def pad_to_shell(tensors: dict[str, torch.Tensor], keys, shapes) -> dict[str, torch.Tensor]:
    """A policy's canonical tensors (rank r, a subset of the shell's modules) as the shell's (rank R): the extra
    rank rows of A and columns of B, and every module the policy does not adapt, are zero. Zero A rows and B
    columns stay exactly zero under the gradient and Adam (each one's gradient is the other's zero part)."""
    out = {}
    for key, shape in zip(keys, shapes):
        t = tensors.get(key)
        full = torch.zeros(shape, dtype=torch.float32)
        if t is not None:
            dim = rank_dim(key)
            lead = [slice(None)] * len(shape)
            lead[dim] = slice(0, t.shape[dim])
            if tuple(t.shape[:dim] if dim == -1 else t.shape[:dim] + t.shape[dim + 1:]) != \
                    tuple(shape[:dim] if dim == -1 else shape[:dim] + shape[dim + 1:]) or t.shape[dim] > shape[dim]:
                raise ValueError(f"tensor {key} has shape {list(t.shape)}, which does not fit the trainer's shell "
                                 f"{list(shape)} (same module, rank at most {shape[dim]})")
            full[tuple(lead)] = t.to(torch.float32)
        out[key] = full
    unknown = sorted(set(tensors) - set(keys))
    if unknown:
        raise KeyError(f"tensor {unknown[0]}: a module outside the trainer's placement shell")
    return out


def cut_from_shell(full: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                   what: str) -> dict[str, torch.Tensor]:
    """The policy's own tensors (`shapes`: key -> its shape) out of shell-sized ones; everything cut away must
    be exactly zero (RuntimeError naming the tensor otherwise: the padding invariant broke)."""
    out = {}
    for key, shape in shapes.items():
        t = full[key]
        dim = rank_dim(key)
        r = shape[dim]
        keep = [slice(None)] * t.dim()
        keep[dim] = slice(0, r)
        rest = [slice(None)] * t.dim()
        rest[dim] = slice(r, None)
        if bool(t[tuple(rest)].any()):
            raise RuntimeError(f"{what}: tensor {key} has nonzero values beyond the policy's rank {r}")
        out[key] = t[tuple(keep)].clone()
    for key in set(full) - set(shapes):
        if bool(full[key].any()):
            raise RuntimeError(f"{what}: tensor {key}, outside the policy's placement, is not zero")
    return out
