"""Padding-safe modality routing for megatron-core 0.19: the V4.1 gate as a `TopKRouter` subclass.

V4.1 scores experts with sqrt(softplus(x·Wᵀ)) and picks the top-k of `scores + bias`, where the bias is the
text `bias` or, on image-span tokens, `bias_vl` (docs/architecture.md §5); the bias never weights an expert. The
weights are the unbiased scores of the picked experts, normalised and scaled by the route scale.

Stock 0.19 has one `expert_bias`, no modality channel and routes padding like any other token. Here:

- `ModalityTopKRouter` keeps the text bias in megatron-core's own `expert_bias` buffer and the image bias in a
  child `image_balance` (`ExpertBalance`) with its own `local_tokens_per_expert`. Both follow the attribute
  names `finalize_model_grads._update_router_expert_bias` and `reset_model_temporary_tensors` duck-type, so
  the stock once-per-global-batch update moves each bias from its own modality's counts, and
  `frozen_expert_bias` (default True, the fine-tuning setting) freezes both.
- Padding rows (`padding_mask` True) keep k dispatcher rows, so every shape stays fixed, but with probability
  0 (no output, no router gradient), spread round-robin over the experts instead of piling onto the experts
  the pad embedding prefers, and they are left out of the aux losses, the z-loss and both bias counters.
- `ModalityMoELayer` accepts `image_mask` ([b, s] bool, True on image-span tokens, the layout of
  `padding_mask`) and hands it to its router, also under the MoE-internal selective recompute.

The image mask is optional everywhere: without it every token uses the text bias, which is what a stock
`TransformerLayer` (which only passes `padding_mask`) gets.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Iterator, Optional

import torch
from torch import nn

from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import (
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    topk_routing_with_score_function,
)
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = [
    "ExpertBalance",
    "ModalityTopKRouter",
    "ModalityMoELayer",
    "with_modality_routing",
    "copy_reference_gate",
]

_UNSUPPORTED_BALANCING = ("sinkhorn", "quantile_balancing")  # both ignore the expert bias entirely


def _keep_fp32(module: nn.Module, names: tuple[str, ...], apply) -> nn.Module:
    """Run `apply()` (the parent `_apply`) but keep the named fp32 buffers exact: follow a move, not a cast.

    `Float16Module` calls `.bfloat16()`; a bias rounded to bf16 and cast back no longer reproduces the
    released fp32 selection bias, so the values are carried over unrounded instead.
    """
    saved = {n: getattr(module, n) for n in names if isinstance(getattr(module, n, None), torch.Tensor)}
    out = apply()
    for name, before in saved.items():
        after = getattr(module, name)
        if after.dtype != torch.float32 and before.dtype == torch.float32 and not after.is_meta:
            after.data = before.detach().to(device=after.device, dtype=torch.float32)
    return out


class ExpertBalance(nn.Module):
    """One modality's selection bias `expert_bias` [E] (fp32, persistent) and token counter [E] (not saved).

    The names match what megatron-core's `_update_router_expert_bias` looks for on any module, so the stock
    finalize step all-reduces the counts and applies the sign update to this bias too.
    """

    def __init__(self, num_experts: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.frozen_expert_bias = True
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.register_buffer("local_tokens_per_expert",
                             torch.zeros(num_experts, dtype=torch.float32, device=device), persistent=False)

    def _apply(self, fn, recurse: bool = True):  # noqa: D401 - torch hook
        """Move/cast like nn.Module, but keep `expert_bias` exactly fp32."""
        return _keep_fp32(self, ("expert_bias",), lambda: super(ExpertBalance, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        """Expert count and whether the bias is frozen."""
        return f"experts={self.expert_bias.numel()}, frozen={self.frozen_expert_bias}"


class ModalityTopKRouter(TopKRouter):
    """sqrtsoftplus top-k router with per-token text/image selection bias and zero-probability padding rows.

    Built by `MoELayer` as `router(config=, pg_collection=, is_mtp_layer=)`; pass extra options with
    `functools.partial` (see `with_modality_routing`). `freeze_expert_bias=False` lets megatron-core's
    finalize step update both biases (set `moe_router_bias_update_rate` as in pretraining, 1e-3).
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False, *,
                 freeze_expert_bias: bool = True) -> None:
        _check_config(config)
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self._scoped_image_mask: Optional[torch.Tensor] = None
        self.image_balance = ExpertBalance(config.num_moe_experts, device=self.expert_bias.device)
        self.frozen_expert_bias = freeze_expert_bias

    # ---- the frozen flag covers both biases ------------------------------------------------------
    @property
    def frozen_expert_bias(self) -> bool:
        """Whether megatron-core's finalize step leaves both selection biases alone."""
        return self.__dict__.get("_frozen_expert_bias", False)

    @frozen_expert_bias.setter
    def frozen_expert_bias(self, value: bool) -> None:
        self.__dict__["_frozen_expert_bias"] = bool(value)
        balance = self._modules.get("image_balance") if "_modules" in self.__dict__ else None
        if balance is not None:
            balance.frozen_expert_bias = bool(value)

    def _apply(self, fn, recurse: bool = True):  # noqa: D401 - torch hook
        """Move/cast like nn.Module, but keep the text `expert_bias` exactly fp32 (the child does the same)."""
        return _keep_fp32(self, ("expert_bias",), lambda: super(ModalityTopKRouter, self)._apply(fn, recurse))

    def _maintain_float32_expert_bias(self) -> None:
        """Stock fp32 guard, extended to the image bias."""
        super()._maintain_float32_expert_bias()
        bias = self.image_balance.expert_bias
        if bias.dtype != torch.float32:
            bias.data = bias.data.to(torch.float32)

    # ---- modality channel ------------------------------------------------------------------------
    @contextlib.contextmanager
    def modality_scope(self, image_mask: Optional[torch.Tensor]) -> Iterator[None]:
        """Route every call inside the block with this image mask ([s, b] bool, True = image-span token)."""
        previous, self._scoped_image_mask = self._scoped_image_mask, image_mask
        try:
            yield
        finally:
            self._scoped_image_mask = previous

    def selection_bias(self, image_mask: Optional[torch.Tensor], num_tokens: int) -> torch.Tensor:
        """Per-token selection bias: [E] (text only) or [T, E] (image rows take `bias_vl`), fp32."""
        text = self.expert_bias.float()
        if image_mask is None:
            return text
        image = image_mask.reshape(num_tokens, 1)
        return torch.where(image, self.image_balance.expert_bias.float(), text)

    # ---- routing ---------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                image_mask: Optional[torch.Tensor] = None):
        """input [s, b, h], padding_mask / image_mask [s, b] bool -> (probs [s·b, E], routing_map [s·b, E])."""
        if image_mask is None:
            image_mask = self._scoped_image_mask
        for name, mask in (("padding_mask", padding_mask), ("image_mask", image_mask)):
            if mask is not None and tuple(mask.shape) != tuple(input.shape[:2]):
                raise ValueError(f"ModalityTopKRouter (layer {self.layer_number}): {name} must be [s, b] = "
                                 f"{list(input.shape[:2])} like the router input, got {list(mask.shape)}")
        self._maintain_float32_expert_bias()
        input = self.apply_input_jitter(input)
        logits = self.gating(input)  # [s, b, E]
        return self.routing(logits, padding_mask=padding_mask, image_mask=image_mask)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                image_mask: Optional[torch.Tensor] = None):
        """logits [s, b, E] -> (probs [T, E], routing_map [T, E]); padding rows: spread map, zero probs."""
        seq_length, bsz = logits.shape[:2]
        num_experts = self.config.num_moe_experts
        logits = logits.reshape(-1, num_experts)  # [T, E]
        num_tokens = logits.shape[0]
        pad = padding_mask.reshape(-1).bool() if padding_mask is not None else None  # [T]
        image = image_mask.reshape(-1).bool() if image_mask is not None else None  # [T]

        logits = self.apply_z_loss(logits, padding_mask=pad)
        probs, routing_map = self._select(logits, image, num_tokens)
        if pad is not None:
            # Fixed shapes: a pad row still occupies k dispatcher slots, but contributes nothing.
            routing_map = torch.where(pad.unsqueeze(-1), self._padding_routing_map(num_tokens, logits.device),
                                      routing_map)
            probs = probs.masked_fill(pad.unsqueeze(-1), 0.0)

        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk,
                capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            )

        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            # Load-balancing statistics use the unbiased natural top-k of real tokens only.
            map_for_aux, scores_for_aux = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=self.config.moe_router_fusion, padding_mask=pad)
            with_pad = pad is not None
            probs = self._apply_aux_loss(probs, scores_for_aux, map_for_aux, with_padding_mask=with_pad)
            probs = self._apply_seq_aux_loss(probs, scores_for_aux, map_for_aux, seq_length, bsz,
                                             with_padding_mask=with_pad)
            probs = self._apply_global_aux_loss(probs, scores_for_aux, map_for_aux, with_padding_mask=with_pad)

        self._apply_expert_bias(routing_map, padding_mask=pad, image_mask=image)
        return probs, routing_map

    def _select(self, logits: torch.Tensor, image: Optional[torch.Tensor], num_tokens: int):
        """Top-k with the per-token bias; the fused (TE) kernel takes one [E] bias, so it runs once per modality."""
        common = dict(
            use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups,
            group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function=self.score_function,
        )
        if not self.config.moe_router_fusion:
            return topk_routing_with_score_function(
                logits, self.topk, expert_bias=self.selection_bias(image, num_tokens), fused=False,
                router_replay=self.router_replay, **common)
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, expert_bias=self.expert_bias, fused=True, **common)
        if image is not None:
            probs_vl, map_vl = topk_routing_with_score_function(
                logits, self.topk, expert_bias=self.image_balance.expert_bias, fused=True, **common)
            rows = image.unsqueeze(-1)
            probs = torch.where(rows, probs_vl, probs)
            routing_map = torch.where(rows, map_vl, routing_map)
        return probs, routing_map

    def _padding_routing_map(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """[T, E] bool with k experts per row, token t on experts (t·k + j) mod E: balanced over experts/ranks."""
        num_experts = self.config.num_moe_experts
        slots = torch.arange(num_tokens, device=device).unsqueeze(-1) * self.topk
        experts = (slots + torch.arange(self.topk, device=device)) % num_experts  # [T, k], distinct per row
        return torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=device).scatter_(1, experts, True)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                           image_mask: Optional[torch.Tensor] = None) -> None:
        """Count real tokens per expert into the text or image counter (once per token, as stock).

        Counting only with grad enabled skips evaluation and the no-grad first pass of full recompute.
        """
        if not (self.enable_expert_bias and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            valid = torch.ones(routing_map.shape[0], dtype=torch.bool, device=routing_map.device)
            if padding_mask is not None:
                valid = ~padding_mask.reshape(-1)
            if image_mask is None:
                self.local_tokens_per_expert += (routing_map & valid.unsqueeze(-1)).sum(dim=0)
                return
            image = image_mask.reshape(-1)
            self.local_tokens_per_expert += (routing_map & (valid & ~image).unsqueeze(-1)).sum(dim=0)
            self.image_balance.local_tokens_per_expert += (routing_map & (valid & image).unsqueeze(-1)).sum(dim=0)


def _check_config(config) -> None:
    """Reject configurations under which the V4.1 selection semantics cannot hold, naming the config key."""
    if config.moe_router_score_function != "sqrtsoftplus":
        raise ValueError("ModalityTopKRouter: TransformerConfig.moe_router_score_function must be 'sqrtsoftplus' "
                         f"(the V4.1 gate), got {config.moe_router_score_function!r}")
    if not config.moe_router_enable_expert_bias:
        raise ValueError("ModalityTopKRouter: TransformerConfig.moe_router_enable_expert_bias must be True; the "
                         "text and image selection biases live in the expert-bias buffers")
    balancing = config.moe_router_load_balancing_type
    kinds = balancing if isinstance(balancing, list) else [balancing]
    bad = [k for k in kinds if k in _UNSUPPORTED_BALANCING]
    if bad:
        raise ValueError(f"ModalityTopKRouter: moe_router_load_balancing_type {bad[0]!r} ignores the selection "
                         "bias; use 'none', 'aux_loss', 'seq_aux_loss' or 'global_aux_loss'")
    if config.moe_router_fusion and config.moe_enable_routing_replay:
        raise ValueError("ModalityTopKRouter: moe_router_fusion bypasses router replay in megatron-core 0.19; "
                         "disable one of moe_router_fusion / moe_enable_routing_replay")


class ModalityMoELayer(MoELayer):
    """`MoELayer` whose forward also takes `image_mask` [b, s] bool and routes image tokens with `bias_vl`."""

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None, image_mask: Optional[torch.Tensor] = None):
        """hidden_states [s, b, h]; padding_mask / image_mask [b, s] bool -> (output [s, b, h], None)."""
        if image_mask is None:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if not isinstance(self.router, ModalityTopKRouter):
            raise TypeError(f"ModalityMoELayer got an image_mask but its router is {type(self.router).__name__}; "
                            "build it with with_modality_routing(spec)")
        expected = (hidden_states.shape[1], hidden_states.shape[0])
        if tuple(image_mask.shape) != expected:
            raise ValueError(f"ModalityMoELayer: image_mask must be [b, s] = {list(expected)} (the padding_mask "
                             f"layout), got {list(image_mask.shape)}")
        image_sb = image_mask.transpose(0, 1).bool()  # [s, b], the router's token order
        if self.moe_layer_recompute and self.training and intermediate_tensors is None:
            # Stock recompute re-runs route() in backward, after any scope opened here has closed: checkpoint
            # here instead, with the image mask as an explicit checkpoint input.
            if self.config.fp8 or self.config.fp4:
                from megatron.core.extensions.transformer_engine import te_checkpoint

                return te_checkpoint(self._forward_in_scope, False, tensor_parallel.random.get_cuda_rng_tracker,
                                     self.tp_group, hidden_states, padding_mask, image_sb)
            return tensor_parallel.checkpoint(self._forward_in_scope, False, hidden_states, padding_mask, image_sb)
        return self._forward_in_scope(hidden_states, padding_mask, image_sb, intermediate_tensors)

    def _forward_in_scope(self, hidden_states, padding_mask, image_sb, intermediate_tensors=None):
        """The stock forward with the router's modality scope open and the inner recompute switched off."""
        recompute, self.moe_layer_recompute = self.moe_layer_recompute, False
        try:
            with self.router.modality_scope(image_sb):
                return super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            self.moe_layer_recompute = recompute


def with_modality_routing(spec: Any, **router_options: Any) -> Any:
    """Copy of a layer/block spec with every `MoELayer` made a `ModalityMoELayer` routed by `ModalityTopKRouter`.

    `router_options` go to the router (e.g. `freeze_expert_bias=False`). Works on any spec tree megatron-core
    builds (`ModuleSpec`, `functools.partial` layer builders, `*Submodules` dataclasses, lists of them).
    """
    router = functools.partial(ModalityTopKRouter, **router_options) if router_options else ModalityTopKRouter
    found = []

    def visit(node: Any) -> Any:
        if isinstance(node, ModuleSpec):
            node = copy.copy(node)
            if node.module is MoELayer or node.module is ModalityMoELayer:
                node.module = ModalityMoELayer
                found.append(node)
            node.submodules = visit(node.submodules)
            return node
        if isinstance(node, functools.partial):
            func = node.func
            if func is MoELayer or func is ModalityMoELayer:
                func = ModalityMoELayer
                found.append(node)
            return functools.partial(func, *node.args, **{k: visit(v) for k, v in node.keywords.items()})
        if isinstance(node, MoESubmodules):
            return dataclasses.replace(node, router=router)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return dataclasses.replace(node, **{f.name: visit(getattr(node, f.name))
                                                for f in dataclasses.fields(node) if f.init})
        if isinstance(node, (list, tuple)):
            return type(node)(visit(item) for item in node)
        return node

    out = visit(spec)
    if not found:
        raise ValueError("with_modality_routing: the spec contains no MoELayer to convert")
    return out


@torch.no_grad()
def copy_reference_gate(router: ModalityTopKRouter, gate: nn.Module) -> None:
    """Load a reference `dsv4flash.model.moe.Gate` (weight, bias, bias_vl) into the router, checking shapes."""
    expected = tuple(router.weight.shape)
    if tuple(gate.weight.shape) != expected:
        raise ValueError(f"copy_reference_gate: gate.weight is {list(gate.weight.shape)}, the router expects "
                         f"{list(expected)}")
    router.weight.copy_(gate.weight)
    router.expert_bias.copy_(gate.bias.float())
    bias_vl = getattr(gate, "bias_vl", None)
    router.image_balance.expert_bias.copy_((bias_vl if bias_vl is not None else gate.bias).float())
