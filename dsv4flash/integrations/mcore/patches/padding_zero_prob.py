"""Runtime twin of DSV41-MCORE-003: padding tokens routed with probability 0 on fixed, balanced experts.

Why: megatron-core 0.19.x leaves padding tokens out of the aux losses, the z-loss and (with DSV41-MCORE-001)
the expert-bias counts, but still dispatches them by their own logits at full probability: padded batches
pay expert compute for unused outputs, feed router gradient from padding, and since every pad row has the
same embedding they all pile onto the same top-k experts (and EP ranks), evicting real tokens under a
capacity factor.

How: `TopKRouter.routing` is replaced by the 0.19.2 body with the patch's one addition: when
`config.moe_router_padding_zero_prob` is set (an attribute here, a `TransformerConfig` field in the
format-patch) and a padding mask is given, padding rows of the routing map become experts
`(t * topk + j) % E` and their probabilities 0, right after top-k and before capacity dropping. Shapes,
real tokens and the default (off) are unchanged. The same spread is computed by
`dsv4flash.integrations.mcore.router.ModalityTopKRouter._padding_routing_map` (to be shared once that
module is refactored).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from dsv4flash._patching import Patcher, runtime_patch

TOUCHES = (
    "megatron.core.transformer.moe.router.TopKRouter.routing",
    "megatron.core.transformer.moe.router.TopKRouter._route_padding_tokens",
    "megatron.core.transformer.transformer_config.TransformerConfig",
)


def route_padding_tokens(topk: int, probs: torch.Tensor, routing_map: torch.Tensor, padding_mask: torch.Tensor):
    """probs / routing_map [T, E], padding_mask [T] (True = pad) -> pad rows on experts (t·k+j) % E, probs 0."""
    num_tokens, num_experts = routing_map.shape
    device = routing_map.device
    first = torch.arange(num_tokens, device=device).unsqueeze(-1) * topk
    experts = (first + torch.arange(topk, device=device)) % num_experts  # [T, k], distinct per row
    spread = torch.zeros_like(routing_map).scatter_(1, experts, True)
    pad = padding_mask.reshape(-1, 1)
    return probs.masked_fill(pad, 0.0), torch.where(pad, spread, routing_map)


def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
    """megatron-core 0.19.2 `TopKRouter.routing` plus zero-probability padding rows (see module docstring)."""
    from megatron.core.transformer.moe.moe_utils import (
        apply_router_token_dropping,
        compute_routing_scores_for_aux_loss,
        topk_routing_with_score_function,
    )

    seq_length, bsz = logits.shape[:2]
    logits = logits.view(-1, self.config.num_moe_experts)

    # Flatten padding_mask to [num_tokens] if provided
    if padding_mask is not None:
        padding_mask = padding_mask.reshape(-1)

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
            expert_bias=self.expert_bias,
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
    self._apply_expert_bias(routing_map, padding_mask=padding_mask)

    return probs, routing_map


def upstream_routes_padding_with_zero_prob() -> bool:
    """Probe: does the installed TopKRouter give two padding tokens probability 0 on experts (t·k+j) % E?"""
    from megatron.core.transformer.moe.router import TopKRouter

    fn = getattr(TopKRouter, "_route_padding_tokens", None)
    if fn is None:
        return False
    probs = torch.full((3, 4), 0.5)
    routing_map = torch.tensor([[True, True, False, False]] * 3)
    padding = torch.tensor([False, True, True])
    out_probs, out_map = fn(SimpleNamespace(topk=2), probs, routing_map, padding)
    return out_probs[1:].eq(0).all().item() and out_map[2].tolist() == [True, True, False, False] and \
        out_map[1].tolist() == [False, False, True, True]


@runtime_patch(
    patch_id="DSV41-MCORE-003",
    target="NVIDIA/Megatron-LM",
    distribution="megatron-core",
    versions=">=0.19.2,<0.20.0",
    touches=TOUCHES,
    upstream_status="Pending",
    forwarded="no",
    remove_when="megatron-core>=0.20.0",
    gate="DSV4FLASH_MCORE_PADDING_ZERO_PROB",
    tests=("tests/patches/test_mcore_padding_zero_prob.py",),
    depends_on=("DSV41-MCORE-001",),
    upstream_has_it=upstream_routes_padding_with_zero_prob,
)
def install(patcher: Patcher) -> None:
    """Swap in the padding-aware `routing` on megatron-core's TopKRouter."""
    from megatron.core.transformer.moe.router import TopKRouter

    patcher.replace(TopKRouter, "routing", routing)
