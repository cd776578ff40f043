"""Runtime twin of DSV41-MCORE-003: padding tokens routed with probability 0 on fixed, balanced experts.

Why: megatron-core 0.19.x leaves padding tokens out of the aux losses, the z-loss and (with DSV41-MCORE-001)
the expert-bias counts, but still dispatches them by their own logits at full probability: padded batches
pay expert compute for unused outputs, feed router gradient from padding, and since every pad row has the
same embedding they all pile onto the same top-k experts (and EP ranks), evicting real tokens under a
capacity factor.

How: `TopKRouter.routing` is replaced by the 0.19.2 body (`_routing.routing`, shared with DSV41-MCORE-004) with the patch's one addition: when
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

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin
from dsv4flash.integrations.mcore.patches import _routing

TOUCHES = (
    "megatron.core.transformer.moe.router.TopKRouter.routing",
    "megatron.core.transformer.moe.router.TopKRouter._route_padding_tokens",
    "megatron.core.transformer.transformer_config.TransformerConfig",
)


def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
    """megatron-core 0.19.2 `TopKRouter.routing` plus zero-probability padding rows (see module docstring)."""
    return _routing.routing(self, logits, padding_mask)


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


@mcore_twin(
    patch_id="DSV41-MCORE-003",
    versions=">=0.19.2,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_PADDING_ZERO_PROB",
    tests=("tests/patches/test_mcore_padding_zero_prob.py",),
    depends_on=("DSV41-MCORE-001",),
    upstream_has_it=upstream_routes_padding_with_zero_prob,
)
def install(patcher: Patcher) -> None:
    """Swap in the padding-aware `routing` on megatron-core's TopKRouter."""
    from megatron.core.transformer.moe.router import TopKRouter

    patcher.replace(TopKRouter, "routing", routing)
