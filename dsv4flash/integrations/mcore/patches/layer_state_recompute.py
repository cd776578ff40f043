"""Runtime twin of DSV41-MCORE-007: an explicit per-layer state carried through full recompute.

Why: megatron-core 0.19.x's shared `recompute.checkpointed_forward` (TransformerBlock and HybridStack) passes
the layer-to-layer `context` slot to `save_for_backward`, so it must be one tensor, and HybridStack drops it
altogether without recompute. A layer stack whose layers hand each other several tensors (CSA2's compressed
KV, index keys, top-k, candidates and the mHC collapse weights) cannot use full/uniform/block recompute: a
state kept in a side channel would be produced under no_grad and silently lose every later consumer's gradient.

How: `checkpointed_forward` is replaced by the patched 0.19.2 body below: a tuple returned in the context slot
is flattened into explicit inputs and outputs of every checkpointed chunk (and rebuilt), so gradients reach
the producing layer through the recompute; a tensor or None context behaves as before. It is replaced where
it is used (`megatron.core.recompute`, `transformer_block`, `models.hybrid.hybrid_block`). HybridStack's
no-recompute loop gets the same carry by threading the context returned by each TransformerLayer into the
next one (a per-call wrapper on the layers, no copy of the loop). The runtime CSA2 block
(`dsv4flash.integrations.mcore.csa2.block`) implements the same flattening for its own layers and can use
the stock block once this lands.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, List, Optional, Set, Tuple, Union

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin

if TYPE_CHECKING:  # the upstream signature's annotations; megatron-core is imported only when the twin installs
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.module import MegatronModule
    from torch import Tensor

TOUCHES = (
    "megatron.core.recompute.checkpointed_forward",
    "megatron.core.models.hybrid.hybrid_block.HybridStack.forward",
)


def _checkpointed_forward(
    self: MegatronModule,
    hidden_states: Tensor,
    attention_mask: Tensor,
    context: Optional[Tensor],
    context_mask: Optional[Tensor],
    rotary_pos_emb: Tensor,
    attention_bias: Optional[Tensor],
    packed_seq_params: PackedSeqParams,
    use_inner_quantization_context: bool,
    padding_mask: Optional[Tensor] = None,
    extract_layer_indices: Optional[Set[int]] = None,
    layer_offset: int = 0,
    modality_mask: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Forward method with activation checkpointing (the patched body; 012 opens the modality channel).

    Args:
        extract_layer_indices (Set[int], optional): Global layer
            indices (across all pipeline stages) from which to
            extract features.
        layer_offset (int): The global layer offset for the current
            pipeline stage. Used to convert local layer indices to
            global indices when checking extract_layer_indices.
        modality_mask (Tensor, optional): MoE modality mask [b, s]; like padding_mask it is
            an input of every checkpointed chunk, so recomputation routes identically.

    A layer may hand the next one an explicit per-layer state instead of a cross-attention
    context: a tuple of tensors (or None entries) returned in the context slot. The state is
    flattened into explicit inputs and outputs of every checkpointed chunk, so a state produced
    in one chunk and consumed in a later one keeps its gradient path through the recompute.

    Returns:
        If extract_layer_indices is empty: hidden_states tensor
        If extract_layer_indices is non-empty: (hidden_states, intermediate_hidden_states) tuple
    """
    from contextlib import nullcontext

    from megatron.core import tensor_parallel
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.fp4_utils import get_fp4_context
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.transformer.transformer_layer import TransformerLayer

    te_checkpoint = None
    if HAVE_TE:
        from megatron.core.extensions.transformer_engine import te_checkpoint

    if extract_layer_indices is None:
        extract_layer_indices = set()
    intermediate_hidden_states: List[Tensor] = []

    # Wrap non-dual RoPE to tuple to unify custom_forward interface.
    is_dual_rope = isinstance(rotary_pos_emb, (tuple, list))
    assert not is_dual_rope or len(rotary_pos_emb) == 2, "Dual RoPE input length is not equal to 2"
    rotary_pos_emb = rotary_pos_emb if is_dual_rope else (None, rotary_pos_emb)

    def custom(start: int, end: int, context_is_state: bool, returns_state: List[bool]):
        def custom_forward(
            hidden_states,
            attention_mask,
            context_mask,
            rotary_pos_emb_local,
            rotary_pos_emb_global,
            padding_mask,
            modality_mask,
            *context_flat,
        ):
            # The context slot: a tensor / None, or a per-layer state tuple flattened by the caller.
            context = tuple(context_flat) if context_is_state else context_flat[0]
            rotary_pos_emb = (
                (rotary_pos_emb_local, rotary_pos_emb_global)
                if is_dual_rope
                else rotary_pos_emb_global
            )

            for index in range(start, end):
                # Use self.layers[index] (not self._get_layer) so this
                # function works for both TransformerBlock and HybridStack.
                layer = self.layers[index]

                # Get appropriate inner quantization context
                if use_inner_quantization_context:
                    if self.config.fp8:
                        inner_quantization_context = get_fp8_context(
                            self.config, layer.layer_number - 1
                        )
                    # TODO: check if fp4 is supported in this case
                    elif self.config.fp4:
                        inner_quantization_context = get_fp4_context(
                            self.config, layer.layer_number - 1
                        )
                    else:
                        inner_quantization_context = nullcontext()
                else:
                    inner_quantization_context = nullcontext()

                # Build the full TransformerLayer kwarg set; for non-TL
                # layers (currently MambaLayer in HybridStack) pop the kwargs
                # they don't accept and treat the return as a single tensor.
                layer_kwargs = dict(
                    hidden_states=hidden_states,
                    attention_mask=attention_mask,
                    context=context,
                    context_mask=context_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    attention_bias=attention_bias,
                    inference_context=None,
                    packed_seq_params=packed_seq_params,
                    padding_mask=padding_mask,
                )
                if modality_mask is not None:
                    layer_kwargs["modality_mask"] = modality_mask
                with inner_quantization_context:
                    if isinstance(layer, TransformerLayer):
                        hidden_states, context = layer(**layer_kwargs)
                    else:  # MambaLayer (HybridStack `M` slot)
                        for k in (
                            "context",
                            "context_mask",
                            "attention_bias",
                            "padding_mask",
                            "modality_mask",
                        ):
                            layer_kwargs.pop(k, None)
                        hidden_states = layer(**layer_kwargs)
                        context = None

                # Some layer paths may still return a tuple (defensive).
                if isinstance(hidden_states, tuple):
                    hidden_states = hidden_states[0]
            returns_state[:] = [isinstance(context, tuple)]
            # Flat outputs: torch.autograd.Function outputs cannot nest tuples.
            return (hidden_states, *(context if isinstance(context, tuple) else (context,)))

        return custom_forward

    def chunk_runner(start: int, end: int, use_checkpoint: bool):
        nonlocal hidden_states, context
        context_is_state = isinstance(context, tuple)
        returns_state: List[bool] = []
        cf = custom(start, end, context_is_state, returns_state)
        # Unpack the RoPE tuple and the layer state as torch cannot save tuples for backward.
        context_flat = context if context_is_state else (context,)
        args = (hidden_states, attention_mask, context_mask, *rotary_pos_emb, padding_mask)
        args = (*args, modality_mask, *context_flat)
        if use_checkpoint:
            # Precision-aware activation checkpoint: TE under FP8/FP4,
            # tensor_parallel under BF16/FP16/FP32.
            if self.config.fp8 or self.config.fp4:
                outputs = te_checkpoint(
                    cf,
                    self.config.distribute_saved_activations,
                    tensor_parallel.random.get_cuda_rng_tracker,
                    self.pg_collection.tp,
                    *args,
                )
            else:
                outputs = tensor_parallel.checkpoint(
                    cf, self.config.distribute_saved_activations, *args
                )
        else:
            outputs = cf(*args)
        hidden_states = outputs[0]
        context = tuple(outputs[1:]) if returns_state[0] else outputs[1]

        if self.config.recompute_method == "uniform":
            if (end - 1 + layer_offset) in extract_layer_indices:
                intermediate_hidden_states.append(hidden_states)
        else:
            if (start + layer_offset) in extract_layer_indices:
                intermediate_hidden_states.append(hidden_states)

    if self.config.recompute_method == 'uniform':
        # Uniformly divide the total number of layers and checkpoint
        # the input activation of each divided chunk.
        layer_idx = 0
        while layer_idx < self.num_layers_per_pipeline_rank:
            chunk_end = min(
                layer_idx + self.config.recompute_num_layers, self.num_layers_per_pipeline_rank
            )
            chunk_runner(layer_idx, chunk_end, True)
            layer_idx += self.config.recompute_num_layers
    elif self.config.recompute_method == 'block':
        # Checkpoint the input activation of only a set number of individual
        # layers and skip the rest. Need at least one input tensor with
        # gradient computation for the re-entrant autograd engine, so under
        # FP8/FP4 we skip checkpointing while hidden_states.requires_grad
        # is False (these slots get pushed past the recompute window).
        recompute_skip_num_layers = 0
        for layer_idx in range(self.num_layers_per_pipeline_rank):
            if (self.config.fp8 or self.config.fp4) and not hidden_states.requires_grad:
                recompute_skip_num_layers += 1
            use_checkpoint = (
                layer_idx >= recompute_skip_num_layers
                and layer_idx < self.config.recompute_num_layers + recompute_skip_num_layers
            )
            chunk_runner(layer_idx, layer_idx + 1, use_checkpoint)
    else:
        raise ValueError("Invalid activation recompute method.")

    # Return intermediate hidden states if feature extraction was requested
    if len(extract_layer_indices) > 0:
        return hidden_states, intermediate_hidden_states

    return hidden_states


def checkpointed_forward(
    self: MegatronModule,
    hidden_states: Tensor,
    attention_mask: Tensor,
    context: Optional[Tensor],
    context_mask: Optional[Tensor],
    rotary_pos_emb: Tensor,
    attention_bias: Optional[Tensor],
    packed_seq_params: PackedSeqParams,
    use_inner_quantization_context: bool,
    padding_mask: Optional[Tensor] = None,
    extract_layer_indices: Optional[Set[int]] = None,
    layer_offset: int = 0,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """DSV41-MCORE-007's `checkpointed_forward`: the patched body without a modality mask."""
    return _checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                                 attention_bias, packed_seq_params, use_inner_quantization_context,
                                 padding_mask, extract_layer_indices, layer_offset)


@contextlib.contextmanager
def _threaded_context(stack):
    """Each TransformerLayer of `stack` receives the context the previous one returned (for one call)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    carry = [None]
    layers = [layer for layer in stack.layers if isinstance(layer, TransformerLayer)]

    def threaded(layer):
        forward = type(layer).forward

        @functools.wraps(forward)
        def call(*args, **kwargs):
            kwargs["context"] = carry[0]
            hidden_states, carry[0] = forward(layer, *args, **kwargs)
            return hidden_states, carry[0]

        return call

    for layer in layers:
        layer.forward = threaded(layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _hybrid_forward(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if self.config.recompute_granularity == "full" and self.training:
            return original(self, *args, **kwargs)
        with _threaded_context(self):
            return original(self, *args, **kwargs)

    return forward


def upstream_carries_layer_state() -> bool:
    """Probe: does the installed checkpointed_forward keep a tuple state through a checkpointed chunk?"""
    import torch
    from types import SimpleNamespace

    from megatron.core import recompute
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class Layer(TransformerLayer):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.layer_number = 1

        def forward(self, hidden_states, context=None, **kwargs):
            previous = context[0] if isinstance(context, tuple) else 0
            return hidden_states * 2, (hidden_states + previous,)

        __call__ = forward  # a bare probe layer: skip TransformerLayer's config-driven __call__

    stack = SimpleNamespace(layers=[Layer(), Layer()], num_layers_per_pipeline_rank=2,
                            config=SimpleNamespace(recompute_method="uniform", recompute_num_layers=1,
                                                   fp8=False, fp4=False, distribute_saved_activations=False))
    hidden = torch.ones(1, 1, 1, requires_grad=True)
    try:
        out = recompute.checkpointed_forward(stack, hidden, None, None, None, None, None, None, False)
    except TypeError:  # 0.19.x: the tuple reaches save_for_backward
        return False
    except (RuntimeError, AssertionError):  # no CUDA RNG to checkpoint with: cannot tell, keep the twin
        return False
    return out.item() == 4.0


@mcore_twin(
    patch_id="DSV41-MCORE-007",
    versions=">=0.19.2,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_LAYER_STATE_RECOMPUTE",
    tests=("tests/patches/test_mcore_layer_state_recompute.py",),
    upstream_has_it=upstream_carries_layer_state,
)
def install(patcher: Patcher) -> None:
    """Swap the shared checkpointed_forward where both stacks look it up; thread HybridStack's context."""
    from megatron.core import recompute
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer import transformer_block

    for module in (recompute, transformer_block, hybrid_block):
        patcher.replace(module, "checkpointed_forward", checkpointed_forward)
    patcher.replace(hybrid_block.HybridStack, "forward", _hybrid_forward(hybrid_block.HybridStack.forward))
