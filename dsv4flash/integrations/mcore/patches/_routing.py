"""The `TopKRouter.routing` body shared by the router twins DSV41-MCORE-003 and DSV41-MCORE-004.

megatron-core 0.19.2's routing with the two format-patches' additions, each inert unless its option is on:
padding rows on fixed experts with probability 0 (`config.moe_router_padding_zero_prob`, DSV41-MCORE-003)
and the per-token selection bias of a modality mask (`router.modality_expert_bias`, which only the
DSV41-MCORE-004 twin creates). One body, so applying both twins never stacks two copies of upstream code.
"""

from __future__ import annotations

from typing import Optional

import torch


def route_padding_tokens(topk: int, probs: torch.Tensor, routing_map: torch.Tensor, padding_mask: torch.Tensor):
    """probs / routing_map [T, E], padding_mask [T] (True = pad) -> pad rows on experts (t·k+j) % E, probs 0."""
    num_tokens, num_experts = routing_map.shape
    device = routing_map.device
    first = torch.arange(num_tokens, device=device).unsqueeze(-1) * topk
    experts = (first + torch.arange(topk, device=device)) % num_experts  # [T, k], distinct per row
    spread = torch.zeros_like(routing_map).scatter_(1, experts, True)
    pad = padding_mask.reshape(-1, 1)
    return probs.masked_fill(pad, 0.0), torch.where(pad, spread, routing_map)


def routing_expert_bias(self, modality_mask: Optional[torch.Tensor]):
    """Selection bias: `expert_bias` [E], or [T, E] with `modality_expert_bias` on the masked tokens."""
    if modality_mask is None:
        return self.expert_bias
    modality = getattr(self, "modality_expert_bias", None)
    if modality is None:
        raise ValueError("TopKRouter got a modality_mask but has no modality expert bias; "
                         "set moe_router_enable_expert_bias and moe_router_modality_expert_bias")
    return torch.where(modality_mask.reshape(-1, 1), modality.expert_bias, self.expert_bias)


def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
            modality_mask: Optional[torch.Tensor] = None):
    """megatron-core 0.19.2 `TopKRouter.routing` plus zero-probability padding rows and modality bias."""
    from megatron.core.transformer.moe.moe_utils import (
        apply_router_token_dropping,
        compute_routing_scores_for_aux_loss,
        topk_routing_with_score_function,
    )

    seq_length, bsz = logits.shape[:2]
    logits = logits.view(-1, self.config.num_moe_experts)

    # Flatten padding_mask and modality_mask to [num_tokens] if provided
    if padding_mask is not None:
        padding_mask = padding_mask.reshape(-1)
    if modality_mask is not None:
        modality_mask = modality_mask.reshape(-1).bool()

    # Apply Z-Loss
    logits = self.apply_z_loss(logits, padding_mask=padding_mask)

    # Calculate probs and routing_map for token dispatching
    if self.routing_type == "sinkhorn":
        probs, routing_map = self.sinkhorn_load_balancing(logits)
    elif self.routing_type == "quantile_balancing":
        assert (
            padding_mask is None
        ), "Quantile balancing routing does not support padding masks yet."
        probs, routing_map = self.quantile_balancing(logits)
    else:
        probs, routing_map = topk_routing_with_score_function(
            logits,
            self.topk,
            use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups,
            group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function=self.score_function,
            expert_bias=routing_expert_bias(self, modality_mask),
            fused=self.config.moe_router_fusion,
            router_replay=self.router_replay,
        )

    if padding_mask is not None and getattr(self.config, "moe_router_padding_zero_prob", False):
        probs, routing_map = route_padding_tokens(self.topk, probs, routing_map, padding_mask)

    # Apply token dropping to probs and routing_map.
    if self.config.moe_expert_capacity_factor is not None:
        probs, routing_map = apply_router_token_dropping(
            probs,
            routing_map,
            router_topk=self.topk,
            capacity_factor=self.config.moe_expert_capacity_factor,
            drop_policy=self.config.moe_token_drop_policy,
            pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
        )

    # Apply each aux loss type and attach aux loss autograd function to probs
    if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
        # Calculate scores and routing_map for aux loss
        routing_map_for_aux_loss, scores_for_aux_loss = compute_routing_scores_for_aux_loss(
            logits,
            self.topk,
            self.score_function,
            fused=self.config.moe_router_fusion,
            padding_mask=padding_mask,
        )
        probs = self._apply_aux_loss(
            probs,
            scores_for_aux_loss,
            routing_map_for_aux_loss,
            with_padding_mask=padding_mask is not None,
        )
        probs = self._apply_seq_aux_loss(
            probs,
            scores_for_aux_loss,
            routing_map_for_aux_loss,
            seq_length,
            bsz,
            with_padding_mask=padding_mask is not None,
        )
        probs = self._apply_global_aux_loss(
            probs,
            scores_for_aux_loss,
            routing_map_for_aux_loss,
            with_padding_mask=padding_mask is not None,
        )

    # Optionally apply expert bias
    if modality_mask is None:
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
    else:
        self._apply_expert_bias(routing_map, padding_mask=padding_mask, modality_mask=modality_mask)

    return probs, routing_map
