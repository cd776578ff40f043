"""MoE: sqrtsoftplus router with selection-only `bias`/`bias_vl`, clamped SwiGLU experts (§5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4flash.config import TextConfig


class Gate(nn.Module):
    """Router: scores = sqrt(softplus(x·Wᵀ)) in fp32; the per-token bias picks experts but never weights them."""

    def __init__(self, text: TextConfig, n_experts: int, topk: int, with_bias_vl: bool, dtype, device) -> None:
        super().__init__()
        self.topk = topk
        self.route_scale = text.routed_scaling_factor
        self.normalise = text.norm_topk_prob and topk > 1
        self.weight = nn.Parameter(torch.empty(n_experts, text.hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32, device=device))
        self.bias_vl = (nn.Parameter(torch.zeros(n_experts, dtype=torch.float32, device=device))
                        if with_bias_vl else None)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased expert scores [T, E] in fp32."""
        return torch.sqrt(F.softplus(x.float() @ self.weight.float().t()))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        """x: [T, D], image_mask: [T] bool -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        scores = self.scores(x)
        bias = self.bias.float().expand_as(scores)
        if self.bias_vl is not None and image_mask is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl.float(), bias)
        idx = torch.topk(scores + bias, self.topk, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, idx


class Expert(nn.Module):
    """SwiGLU expert with the V4.1 clamp (up ∈ [−limit, limit], gate ≤ limit); routed and shared alike."""

    def __init__(self, dim: int, inter: int, swiglu_limit: float, dtype, device) -> None:
        super().__init__()
        self.limit = swiglu_limit
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, route_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, D] -> [T, D]; routed experts scale the activation by their route weight [T, 1]."""
        gate = self.w1(x).float().clamp(max=self.limit)
        up = self.w3(x).float().clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if route_weight is not None:
            h = h * route_weight
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    """Routed experts (top-k of `n_experts`) plus one always-on shared expert."""

    def __init__(self, text: TextConfig, n_experts: int, topk: int, with_bias_vl: bool, dtype, device) -> None:
        super().__init__()
        dim, inter = text.hidden_size, text.moe_intermediate_size
        self.gate = Gate(text, n_experts, topk, with_bias_vl, dtype, device)
        self.experts = nn.ModuleList(Expert(dim, inter, text.swiglu_limit, dtype, device) for _ in range(n_experts))
        self.shared_experts = Expert(dim, inter, text.swiglu_limit, dtype, device)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B,S,D], image_mask: [B,S] bool -> [B,S,D]."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, D]
        mask = image_mask.reshape(-1) if image_mask is not None else None
        weights, idx = self.gate(tokens, mask)  # [T, k]
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
        for expert_id in torch.unique(idx).tolist():
            token_ids, slot = torch.nonzero(idx == expert_id, as_tuple=True)
            routed = self.experts[expert_id](tokens[token_ids], weights[token_ids, slot].unsqueeze(-1))
            out.index_add_(0, token_ids, routed.float())
        out = out + self.shared_experts(tokens).float()
        return out.to(x.dtype).reshape(shape)
