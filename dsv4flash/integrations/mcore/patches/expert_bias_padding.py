"""Runtime twin of DSV41-MCORE-001: padded tokens must not count towards the expert-bias load statistics.

Why: in megatron-core 0.19.x `TopKRouter._apply_expert_bias` computes `routing_map & (~padding_mask)` with a
`[num_tokens, num_experts]` routing map and a `[num_tokens]` padding mask (True = padding). Broadcasting
lines the mask up with the expert axis, so any MoE forward with `moe_router_enable_expert_bias` and a padding
mask raises a shape error, and when num_tokens == num_experts it silently masks experts instead of tokens,
corrupting the counts that drive the aux-loss-free bias update (`_update_router_expert_bias`).

How: replace `TopKRouter._apply_expert_bias` with a version that reshapes the mask to `[num_tokens, 1]` so
whole token rows are dropped; behaviour without a padding mask is unchanged, and the replacement is wrapped
in megatron-core's own `jit_fuser` like the original. Fixed upstream on main by NVIDIA/Megatron-LM#6114.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

TOUCHES = ("megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias",)


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> None:
    """Accumulate per-expert token counts for the expert-bias update, skipping padded tokens."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                # routing_map [T, E] & valid [T, 1]: drop padded token rows, never expert columns.
                routing_map = routing_map & (~padding_mask.reshape(-1, 1))
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def upstream_masks_token_rows() -> bool:
    """Probe: does the installed `TopKRouter._apply_expert_bias` drop padded token rows with T != E?"""
    from megatron.core.transformer.moe.router import TopKRouter

    fn = TopKRouter.__dict__["_apply_expert_bias"]
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)  # probe the Python body; never trigger torch.compile
    fake_router = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(2))
    routing_map = torch.tensor([[True, False], [True, False], [False, True]])  # T=3 tokens, E=2 experts
    padding_mask = torch.tensor([False, True, False])  # token 1 is padding
    with torch.enable_grad():
        try:
            fn(fake_router, routing_map, padding_mask)
        except RuntimeError:  # the 0.19.x shape error
            return False
    return fake_router.local_tokens_per_expert.tolist() == [1.0, 1.0]


@mcore_twin(
    patch_id="DSV41-MCORE-001",
    versions=">=0.19.0,<0.20.0",
    touches=TOUCHES,
    upstream_status="Backport [https://github.com/NVIDIA/Megatron-LM/pull/6114]",
    forwarded="not-needed",
    gate="DSV4FLASH_MCORE_EXPERT_BIAS_PADDING",
    tests=("tests/patches/test_mcore_expert_bias_padding.py",),
    upstream_has_it=upstream_masks_token_rows,
)
def install(patcher: Patcher) -> None:
    """Swap in the row-broadcasting `_apply_expert_bias` on megatron-core's TopKRouter."""
    from megatron.core.jit import jit_fuser
    from megatron.core.transformer.moe.router import TopKRouter

    patcher.replace(TopKRouter, "_apply_expert_bias", jit_fuser(_apply_expert_bias))
