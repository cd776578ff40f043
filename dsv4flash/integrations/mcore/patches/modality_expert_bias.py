"""Runtime twin of DSV41-MCORE-004: a second (per-modality) expert bias and a switch that freezes the biases.

Why: megatron-core 0.19.x keeps one aux-loss-free expert bias per router, updated from every token's counts;
a vision-language MoE whose image tokens prefer other experts (DeepSeek-V4.1 ships `bias` and `bias_vl` per
gate) cannot be reproduced or fine-tuned with it, and freezing the bias means poking router attributes.

How: on megatron-core's classes, reading the options as config attributes (fields in the format-patch):
`TopKRouter.__init__` also sets `frozen_expert_bias` from `moe_router_freeze_expert_bias` and, with
`moe_router_modality_expert_bias`, adds `modality_expert_bias` (the `ExpertBalance` module of
`dsv4flash.integrations.mcore.router`: its own fp32 `expert_bias` and `local_tokens_per_expert`, names the
stock finalize step duck-types); `TopKRouter.forward`/`routing` take `modality_mask` (the routing body shared
with DSV41-MCORE-003 in `_routing`); `_apply_expert_bias` counts each modality into its own counter;
`MoELayer.route`/`forward` take `modality_mask` ([b, s]) and keep it an explicit input of the MoE-internal
recompute (like `ModalityMoELayer` of the runtime router, whose scope mechanism this reuses).
Without a modality mask and with both options off, behaviour is stock.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin
from dsv4flash.integrations.mcore.patches import _routing

TOUCHES = (
    "megatron.core.transformer.transformer_config.TransformerConfig",
    "megatron.core.transformer.moe.router.ModalityExpertBias",
    "megatron.core.transformer.moe.router.TopKRouter.forward",
    "megatron.core.transformer.moe.router.TopKRouter.routing",
    "megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias",
    "megatron.core.transformer.moe.router.TopKRouter._routing_expert_bias",
    "megatron.core.transformer.moe.moe_layer.MoELayer.forward",
    "megatron.core.transformer.moe.moe_layer.MoELayer.route",
)
_SCOPE = "_dsv41_modality_mask"  # router attribute: the [s, b] mask of the MoELayer call in progress


def _with_modality_bias(original_init):
    """`TopKRouter.__init__` that also honours the freeze switch and creates the modality bias."""

    @functools.wraps(original_init)
    def __init__(self, config, *args, **kwargs):
        original_init(self, config, *args, **kwargs)
        from dsv4flash.integrations.mcore.router import ExpertBalance

        self.frozen_expert_bias = bool(getattr(config, "moe_router_freeze_expert_bias", False))
        if getattr(config, "moe_router_modality_expert_bias", False):
            if not self.enable_expert_bias:
                raise ValueError("moe_router_modality_expert_bias requires moe_router_enable_expert_bias")
            if config.moe_router_fusion:
                raise ValueError("moe_router_modality_expert_bias uses a per-token bias, which the fused router "
                                 "kernel does not take; unset moe_router_fusion")
            self.modality_expert_bias = ExpertBalance(config.num_moe_experts, device=self.expert_bias.device)
            self.modality_expert_bias.frozen_expert_bias = self.frozen_expert_bias

    return __init__


def router_forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                   modality_mask: Optional[torch.Tensor] = None):
    """megatron-core 0.19.2 `TopKRouter.forward` taking `modality_mask` [s, b] (or the MoELayer's scope)."""
    from megatron.core.transformer.moe.moe_utils import apply_biased_logits, apply_random_logits

    if modality_mask is None:
        modality_mask = self.__dict__.get(_SCOPE)
    self._maintain_float32_expert_bias()
    modality = getattr(self, "modality_expert_bias", None)
    if modality is not None and modality.expert_bias.dtype != torch.float32:
        modality.expert_bias.data = modality.expert_bias.data.to(torch.float32)
    input = self.apply_input_jitter(input)
    logits = self.gating(input)
    if self.config.moe_router_force_load_balancing:
        logits = apply_random_logits(logits)
    if self.config.moe_router_force_biased is not None:
        logits = apply_biased_logits(logits, self.config.moe_router_force_biased, self.layer_number)
    return self.routing(logits, padding_mask=padding_mask, modality_mask=modality_mask)


def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
            modality_mask: Optional[torch.Tensor] = None):
    """The shared routing body with the modality channel open."""
    return _routing.routing(self, logits, padding_mask, modality_mask)


def apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                      modality_mask: Optional[torch.Tensor] = None) -> None:
    """Count real tokens per expert, each modality into its own counter (grad enabled only, as stock)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask.reshape(-1, 1))  # [T, E] & valid [T, 1]
            if modality_mask is None:
                self.local_tokens_per_expert += routing_map.sum(dim=0)
            else:
                modality = modality_mask.reshape(-1, 1)
                self.local_tokens_per_expert += (routing_map & ~modality).sum(dim=0)
                self.modality_expert_bias.local_tokens_per_expert += (routing_map & modality).sum(dim=0)


def moe_route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
              modality_mask: Optional[torch.Tensor] = None):
    """`MoELayer.route` passing the modality mask on to the router."""
    from megatron.core.transformer.moe.moe_layer import apply_module

    if modality_mask is None:
        return apply_module(self.router)(hidden_states, padding_mask)
    return apply_module(self.router)(hidden_states, padding_mask, modality_mask=modality_mask)


@contextlib.contextmanager
def _modality_scope(router, modality_sb: torch.Tensor):
    """Route every router call inside the block with this [s, b] modality mask."""
    previous = router.__dict__.get(_SCOPE)
    router.__dict__[_SCOPE] = modality_sb
    try:
        yield
    finally:
        router.__dict__[_SCOPE] = previous


def _moe_forward(original):
    """`MoELayer.forward` taking `modality_mask` [b, s], an explicit input of the MoE-internal recompute."""

    @functools.wraps(original)
    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None, modality_mask=None):
        if modality_mask is None:
            return original(self, hidden_states, intermediate_tensors, padding_mask)
        modality_sb = modality_mask.transpose(0, 1).bool()  # [s, b], the router's token order

        def in_scope(hidden, pad, modality, intermediate=None):
            recompute, self.moe_layer_recompute = self.moe_layer_recompute, False
            try:
                with _modality_scope(self.router, modality):
                    return original(self, hidden, intermediate, pad)
            finally:
                self.moe_layer_recompute = recompute

        if self.moe_layer_recompute and self.training and intermediate_tensors is None:
            from megatron.core import tensor_parallel

            if self.config.fp8 or self.config.fp4:
                from megatron.core.extensions.transformer_engine import te_checkpoint

                return te_checkpoint(in_scope, False, tensor_parallel.random.get_cuda_rng_tracker, self.tp_group,
                                     hidden_states, padding_mask, modality_sb)
            return tensor_parallel.checkpoint(in_scope, False, hidden_states, padding_mask, modality_sb)
        return in_scope(hidden_states, padding_mask, modality_sb, intermediate_tensors)

    return forward


def upstream_has_modality_bias() -> bool:
    """Probe: does the installed TopKRouter give masked tokens the modality bias ([T, E] selection bias)?"""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router import TopKRouter

    fn = getattr(TopKRouter, "_routing_expert_bias", None)
    if fn is None:
        return False
    fake = SimpleNamespace(expert_bias=torch.zeros(2),
                           modality_expert_bias=SimpleNamespace(expert_bias=torch.ones(2)))
    bias = fn(fake, torch.tensor([False, True]))
    return bias.tolist() == [[0.0, 0.0], [1.0, 1.0]]


@mcore_twin(
    patch_id="DSV41-MCORE-004",
    versions=">=0.19.2,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_MODALITY_EXPERT_BIAS",
    tests=("tests/patches/test_mcore_modality_expert_bias.py",),
    depends_on=("DSV41-MCORE-001", "DSV41-MCORE-003"),
    upstream_has_it=upstream_has_modality_bias,
)
def install(patcher: Patcher) -> None:
    """Give megatron-core's TopKRouter and MoELayer the modality channel and the freeze switch."""
    from megatron.core.jit import jit_fuser
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    patcher.replace(TopKRouter, "__init__", _with_modality_bias(TopKRouter.__init__))
    patcher.replace(TopKRouter, "forward", router_forward)
    patcher.replace(TopKRouter, "routing", routing)
    patcher.replace(TopKRouter, "_apply_expert_bias", jit_fuser(apply_expert_bias))
    patcher.replace(MoELayer, "route", moe_route)
    patcher.replace(MoELayer, "forward", _moe_forward(MoELayer.forward))
