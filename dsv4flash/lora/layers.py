"""LoRA wrappers that replace reference-model modules in place, keeping every base parameter name.

Each wrapper subclasses the module it replaces and *shares* the base Parameter objects (`weight`,
`bias`, ...), so `state_dict()` keys of the base stay the release names, `isinstance` checks keep
working, and the base stays frozen. Adapter factors live next to them:

| wrapper               | replaces                        | factors (in-memory name)                        |
|-----------------------|---------------------------------|-------------------------------------------------|
| LoraLinear            | nn.Linear                       | `<m>.lora_A` [r, in], `<m>.lora_B` [out, r]        |
| GroupedLoraProjection | attn.wo_a (grouped)             | `<m>.lora_A` [G, r, in_g], `<m>.lora_B` [G, out_g, r] |
|                       |   (`wo_a_lora="shared_a"`)      | `<m>.lora_A` [r, in_g], `<m>.lora_B` [G·out_g, r]    |
| ExpertLoraLinear      | ffn.experts.{e}.w1/w2/w3        | slices of `ffn.experts_lora.{w}.lora_A` [E, r, in], `.lora_B` [E, out, r] |
|                       |   (`expert_lora="shared_outer"`) | w1/w3: A [r, in] shared, B [E, out, r]; w2: A [E, r, in], B [out, r] shared |
| LoraGate              | ffn.gate (router, opt-in only)  | `<m>.lora_A` [r, D], `<m>.lora_B` [E, r]           |

A is initialised like PEFT (Kaiming-uniform, a=√5, i.e. U(±1/√in)) from an explicit generator; B is
zero, so a fresh adapter leaves the output bit-identical to the base.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv4flash.lora.adapter_batch import active_batch
from dsv4flash.lora.functional import (grouped_lora_delta, grouped_lora_forward, lora_delta, lora_forward)
from dsv4flash.model.attention import GroupedOutputProjection
from dsv4flash.model.moe import Gate


class LoraModule:
    """Mixin marking a LoRA wrapper; `lora_kind` names the wrapped base kind."""

    lora_kind: str = ""
    scaling: float = 1.0
    lora_dropout: float = 0.0

    def delta_weight(self) -> torch.Tensor:
        """ΔW in the base weight's layout (fp32)."""
        raise NotImplementedError


def is_lora_module(module: nn.Module) -> bool:
    """Whether `module` is one of this package's LoRA wrappers."""
    return isinstance(module, LoraModule)


def _factor(shape: tuple[int, ...], dtype: torch.dtype, device, generator: torch.Generator | None,
            fan_in: int | None) -> nn.Parameter:
    """A (fan_in given: U(±1/√fan_in)) or B (zeros) factor; nothing is drawn on the meta device."""
    t = torch.zeros(shape, dtype=dtype, device=device)
    if fan_in is not None and t.device.type != "meta":
        bound = 1.0 / math.sqrt(fan_in)
        draw = torch.rand(shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound
        t.copy_(draw)
    return nn.Parameter(t)


def _linear_with_lora(module, x: torch.Tensor, batch_factor) -> torch.Tensor:
    """Base linear + the module's low-rank delta; under an adapter batch, each adapter's delta on its own rows
    (one base op for all of them). `batch_factor(batch, index, "lora_A"|"lora_B")` finds an adapter's factor."""
    out = F.linear(x, module.weight, module.bias)
    batch = active_batch()
    if batch is not None:
        return batch.add_deltas(x, out, lambda i, rows: lora_forward(
            rows, batch_factor(batch, i, "lora_A"), batch_factor(batch, i, "lora_B"),
            batch.scaling(i, module.scaling),
            module.lora_dropout, module.training))
    return out + lora_forward(x, module.lora_A, module.lora_B, module.scaling, module.lora_dropout,
                              module.training).to(out.dtype)


class LoraLinear(nn.Linear, LoraModule):
    """y = x·Wᵀ + b + scaling · B·A·dropout(x), W and b shared with (and frozen like) the base Linear."""

    lora_kind = "linear"

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float, dtype: torch.dtype,
                 generator: torch.Generator | None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.scaling, self.lora_dropout = scaling, dropout
        self.lora_A = _factor((rank, self.in_features), dtype, base.weight.device, generator, self.in_features)
        self.lora_B = _factor((self.out_features, rank), dtype, base.weight.device, None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in the base output dtype."""
        return _linear_with_lora(self, x, lambda batch, i, name: batch.factor(i, self, name))

    def delta_weight(self) -> torch.Tensor:
        """ΔW [out, in] (fp32)."""
        return lora_delta(self.lora_A, self.lora_B, self.scaling)

    def extra_repr(self) -> str:
        """Base sizes plus rank and scaling."""
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


class GroupedLoraProjection(GroupedOutputProjection, LoraModule):
    """`wo_a` with block-diagonal LoRA: z_g = W_g·o_g + scaling · B_g·A_g·o_g (no cross-group terms)."""

    lora_kind = "grouped"

    def __init__(self, base: GroupedOutputProjection, rank: int, scaling: float, dropout: float,
                 dtype: torch.dtype, generator: torch.Generator | None, shared_a: bool = False) -> None:
        nn.Module.__init__(self)
        self.groups, self.rank, self.in_per_group = base.groups, base.rank, base.in_per_group
        self.weight = base.weight
        self.scaling, self.lora_dropout = scaling, dropout
        device = base.weight.device
        a_shape = (rank, self.in_per_group) if shared_a else (self.groups, rank, self.in_per_group)
        b_shape = (self.groups * self.rank, rank) if shared_a else (self.groups, self.rank, rank)
        self.lora_A = _factor(a_shape, dtype, device, generator, self.in_per_group)
        self.lora_B = _factor(b_shape, dtype, device, None, None)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o [B,S,G,in_g] -> [B,S,G·out_g]."""
        out = super().forward(o)
        batch = active_batch()
        if batch is not None:
            return batch.add_deltas(o, out, lambda i, rows: grouped_lora_forward(
                rows, batch.factor(i, self, "lora_A"), batch.factor(i, self, "lora_B"), batch.scaling(i, self.scaling),
                self.lora_dropout, self.training))
        return out + grouped_lora_forward(o, self.lora_A, self.lora_B, self.scaling, self.lora_dropout,
                                          self.training).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """ΔW [G·out_g, in_g] in `wo_a.weight`'s group-major layout (fp32)."""
        return grouped_lora_delta(self.lora_A, self.lora_B, self.scaling, self.groups)


def expert_factor_shapes(n_experts: int, rank: int, in_features: int, out_features: int, proj: str,
                         mode: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A, B) shapes of one packed projection. `per_expert`: A [E, r, in], B [E, out, r]. `shared_outer`:
    the outer factor is one matrix for all experts — A [r, in] for w1/w3 (they share the input x), B
    [out, r] for w2 (its output side) — as in vLLM's `enable_moe_shared_loras`."""
    a, b = (n_experts, rank, in_features), (n_experts, out_features, rank)
    if mode == "shared_outer":
        return (a[1:], b) if proj in ("w1", "w3") else (a, b[1:])
    return a, b


class PackedFactors(nn.Module):
    """The LoRA factors of one projection of all routed experts of one layer (see `expert_factor_shapes`)."""

    def __init__(self, n_experts: int, rank: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device, generator: torch.Generator | None, proj: str = "w1", mode: str = "per_expert") -> None:
        super().__init__()
        a_shape, b_shape = expert_factor_shapes(n_experts, rank, in_features, out_features, proj, mode)
        self.lora_A = _factor(a_shape, dtype, device, generator, in_features)
        self.lora_B = _factor(b_shape, dtype, device, None, None)


class PackedExpertLora(nn.Module):
    """`ffn.experts_lora`: the packed factors of a MoE layer, one `PackedFactors` per adapted projection."""

    def __init__(self, scaling: float, dropout: float) -> None:
        super().__init__()
        self.scaling, self.lora_dropout = scaling, dropout


class ExpertLoraLinear(nn.Linear, LoraModule):
    """Routed expert `e`'s w1/w2/w3: base + scaling · B[e]·A[e]·x, reading slices of the packed factors."""

    lora_kind = "expert"

    def __init__(self, base: nn.Linear, factors: PackedFactors, expert: int, scaling: float, dropout: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.expert, self.scaling, self.lora_dropout = expert, scaling, dropout
        # A plain attribute, not a submodule: the factors are registered once, under `ffn.experts_lora`.
        object.__setattr__(self, "_factors", factors)

    @property
    def lora_A(self) -> torch.Tensor:
        """This expert's A [r, in] (a view of the packed parameter, or the shared one)."""
        a = self._factors.lora_A
        return a[self.expert] if a.dim() == 3 else a

    @property
    def lora_B(self) -> torch.Tensor:
        """This expert's B [out, r] (a view of the packed parameter, or the shared one)."""
        b = self._factors.lora_B
        return b[self.expert] if b.dim() == 3 else b

    def _batch_factor(self, batch, index: int, name: str) -> torch.Tensor:
        """Adapter `index`'s factor of this expert (a slice of its packed tensor, or the shared one)."""
        t = batch.factor(index, self._factors, name)
        return t[self.expert] if t.dim() == 3 else t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]; under an adapter batch the caller groups rows by adapter (`batch.rows`)."""
        return _linear_with_lora(self, x, self._batch_factor)

    def delta_weight(self) -> torch.Tensor:
        """ΔW_e [out, in] (fp32)."""
        return lora_delta(self.lora_A, self.lora_B, self.scaling)

    def extra_repr(self) -> str:
        """Base sizes plus the expert index."""
        return f"{super().extra_repr()}, expert={self.expert}, packed"


class LoraGate(Gate, LoraModule):
    """Router with LoRA on its score projection: scores = sqrt(softplus(x·Wᵀ + scaling·B·A·x)) in fp32.

    Opt-in only (no preset targets it): a trained router changes which experts fire, so sampled and
    trained routes diverge unless the rollout engine serves the same adapter; vLLM has no router LoRA.
    """

    lora_kind = "router"

    def __init__(self, base: Gate, rank: int, scaling: float, dropout: float, dtype: torch.dtype,
                 generator: torch.Generator | None) -> None:
        nn.Module.__init__(self)
        self.topk, self.route_scale, self.normalise = base.topk, base.route_scale, base.normalise
        self.weight = base.weight
        self.bias = base.bias
        self.register_parameter("bias_vl", base.bias_vl)
        self.scaling, self.lora_dropout = scaling, dropout
        n_experts, dim = base.weight.shape
        self.lora_A = _factor((rank, dim), dtype, base.weight.device, generator, dim)
        self.lora_B = _factor((n_experts, rank), dtype, base.weight.device, None, None)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased expert scores [T, E] in fp32, the LoRA delta added before the softplus."""
        logits = x.float() @ self.weight.float().t()
        batch = active_batch()
        if batch is not None:
            return torch.sqrt(F.softplus(batch.add_deltas(x.float(), logits, lambda i, rows: lora_forward(
                rows, batch.factor(i, self, "lora_A"), batch.factor(i, self, "lora_B"), batch.scaling(i, self.scaling),
                self.lora_dropout, self.training).float())))
        logits = logits + lora_forward(x.float(), self.lora_A, self.lora_B, self.scaling, self.lora_dropout,
                                       self.training).float()
        return torch.sqrt(F.softplus(logits))

    def delta_weight(self) -> torch.Tensor:
        """ΔW [E, D] (fp32)."""
        return lora_delta(self.lora_A, self.lora_B, self.scaling)
