"""Runtime twin of DSV41-MCORE-012: the MoE modality mask passed from GPTModel down to the router.

Why: DSV41-MCORE-004 lets `MoELayer.forward` take `modality_mask` (image tokens select experts with the
modality expert bias, the release's `bias_vl`), but megatron-core 0.19.x's GPTModel, TransformerBlock and
TransformerLayer drop it, so image tokens route with the text bias; a per-forward attribute is no substitute,
since recomputed layers run again in the backward pass.

How: as in the format-patch, `modality_mask` ([b, s] bool) travels like `padding_mask`:
`GPTModel.forward` checks it (`_preprocess_modality_mask`: shape, MTP refused, sequence-parallel scatter) and
hands it to the decoder through `extra_block_kwargs`; `TransformerBlock.forward` gives every layer of the
no-recompute loop the keyword for one call (an instance `forward`, as the DSV41-MCORE-007 twin threads
HybridStack's context) and puts the mask on the block for `checkpointed_forward`, whose patched body it shares
with the 007 twin (`layer_state_recompute._checkpointed_forward`: an explicit input of every checkpointed
chunk); `TransformerLayer.forward` / `_forward_mlp` are the patched 0.19.2 bodies (MoE layers only, through
MLP recompute, MLP chunking and the packed-sequence unflatten); `MoETransformerLayer._forward_mlp` refuses the
mask with partial CUDA graphs; `HyperConnectionTransformerLayer.forward` (the DSV41-MCORE-010 module, and the
CSA2 layers on it) hands it to its MoE layer for the call. Without a mask every call is stock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import TYPE_CHECKING, List, Optional, Union

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mcore.patches import mcore_twin
from dsv4flash.integrations.mcore.patches import layer_state_recompute

if TYPE_CHECKING:  # the upstream signature's annotations; megatron-core is imported only when the twin installs
    from megatron.core.inference.contexts import BaseInferenceContext
    from torch import Tensor

TOUCHES = (
    "megatron.core.models.gpt.gpt_model.GPTModel.forward",
    "megatron.core.models.gpt.gpt_model.GPTModel._preprocess_modality_mask",
    "megatron.core.transformer.transformer_block.TransformerBlock.forward",
    "megatron.core.recompute.checkpointed_forward",
    "megatron.core.transformer.transformer_layer.TransformerLayer.forward",
    "megatron.core.transformer.transformer_layer.TransformerLayer._forward_mlp",
    "megatron.core.transformer.transformer_layer.MoETransformerLayer._forward_mlp",
    "megatron.core.transformer.hyper_connection.HyperConnectionTransformerLayer.forward",
)
_SCOPE = "_dsv41_block_modality_mask"  # TransformerBlock attribute: the mask of the block call in progress


def preprocess_modality_mask(self, modality_mask: Tensor, input_ids: Optional[Tensor]):
    """Checks the [bsz, seq_length] modality mask and splits it like the decoder input."""
    from megatron.core import tensor_parallel

    if self.mtp_process:
        raise NotImplementedError(
            "modality_mask is not passed to the multi-token prediction layers yet; "
            "unset mtp_num_layers to route with a modality mask"
        )
    if modality_mask.dim() != 2 or (
        input_ids is not None and modality_mask.shape != input_ids.shape
    ):
        raise ValueError(
            f"modality_mask must be [bsz, seq_length] like input_ids "
            f"{tuple(input_ids.shape) if input_ids is not None else ''}, "
            f"got {tuple(modality_mask.shape)}"
        )
    modality_mask = modality_mask.bool()
    if self.config.sequence_parallel:
        # Every pipeline stage holds its sequence-parallel chunk of the decoder input.
        modality_mask = (
            tensor_parallel.scatter_to_sequence_parallel_region(
                modality_mask.transpose(0, 1).contiguous(), group=self.pg_collection.tp
            )
            .transpose(0, 1)
            .contiguous()
        )
    return modality_mask


def _gpt_forward(original):
    """`GPTModel.forward` taking `modality_mask`, handed to the decoder with `extra_block_kwargs`."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, modality_mask=None, **kwargs):
        if modality_mask is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        modality_mask = self._preprocess_modality_mask(modality_mask, bound.arguments.get("input_ids"))
        extra = bound.arguments.get("extra_block_kwargs") or {}
        bound.arguments["extra_block_kwargs"] = {**extra, "modality_mask": modality_mask}
        return original(*bound.args, **bound.kwargs)

    return forward


@contextlib.contextmanager
def _called_with(modules, **keywords):
    """Each module's forward receives these keywords for the duration of the block (an instance `forward`)."""
    modules = list(modules)
    previous = [module.__dict__.get("forward") for module in modules]
    for module in modules:
        forward = module.__dict__.get("forward") or functools.partial(type(module).forward, module)
        module.forward = functools.partial(forward, **keywords)
    try:
        yield
    finally:
        for module, forward in zip(modules, previous):
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


def _block_forward(original):
    """`TransformerBlock.forward` taking `modality_mask` for its layers and its checkpointed chunks."""

    @functools.wraps(original)
    def forward(self, *args, modality_mask=None, **kwargs):
        if modality_mask is None:
            return original(self, *args, **kwargs)
        previous = self.__dict__.get(_SCOPE)
        self.__dict__[_SCOPE] = modality_mask
        try:
            with _called_with(self.layers, modality_mask=modality_mask):
                return original(self, *args, **kwargs)
        finally:
            self.__dict__[_SCOPE] = previous

    return forward


def checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                         attention_bias, packed_seq_params, use_inner_quantization_context, padding_mask=None,
                         extract_layer_indices=None, layer_offset=0, modality_mask=None):
    """The patched `checkpointed_forward`; the block's mask when its forward does not pass one."""
    if modality_mask is None:
        modality_mask = self.__dict__.get(_SCOPE)
    return layer_state_recompute._checkpointed_forward(
        self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb, attention_bias,
        packed_seq_params, use_inner_quantization_context, padding_mask, extract_layer_indices, layer_offset,
        modality_mask=modality_mask)


def layer_forward(self, *args, **kwargs):
    """
    Perform a forward pass through the transformer layer.

    This method calls the core computation of a transformer layer, including
    self-attention, cross-attention (if applicable), and feed-forward operations.
    An optional ``modality_mask`` keyword ([b, s] bool) is passed to the MoE router.
    """
    modality_mask = kwargs.pop("modality_mask", None)
    hidden_states, context = self._forward_attention(*args, **kwargs)
    mlp_kwargs = {} if modality_mask is None else {"modality_mask": modality_mask}
    output = self._forward_mlp(
        hidden_states,
        kwargs.get("inference_context", None),
        padding_mask=kwargs.get("padding_mask", None),
        packed_seq_params=kwargs.get("packed_seq_params", None),
        **mlp_kwargs,
    )
    return output, context


def layer_forward_mlp(
    self,
    hidden_states: Tensor,
    inference_context: Optional[BaseInferenceContext] = None,
    padding_mask: Optional[Tensor] = None,
    packed_seq_params=None,
    modality_mask: Optional[Tensor] = None,
) -> Union[Tensor, List[Optional[Tensor]]]:
    """
    Perform a forward pass through the feed-forward layer.

    Args:
        hidden_states (Tensor): Transformed hidden states before the MLP layernorm.
            Shape [seq_length, batch_size, hidden_size].
        inference_context: Inference context for optimizations.
        padding_mask (Tensor, optional): Padding mask for MoE routing.
            Shape [bsz, seq_length]. True = padding (exclude), False = valid (include).
            Only used for MoE layers to exclude padding tokens from aux loss computations.
            The MoELayer will internally transform this to [seq_length, bsz] format.
        packed_seq_params: Packed sequence parameters, used to detect flattened
            batches that need reshaping for MoE sequence load balancing.
        modality_mask (Tensor, optional): Modality mask for MoE routing, [bsz, seq_length]
            like padding_mask. True = the token selects experts with the router's modality
            expert bias. Only passed to MoE layers; dense MLPs ignore it.
    Returns:
        output (Tensor): Transformed hidden states of shape [s, b, h].
    """
    import functools

    from megatron.core import tensor_parallel
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.transformer.cuda_graphs import is_graph_capturing
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import apply_module, nvtx_range_pop, nvtx_range_push


    # Optional Layer norm post the cross-attention.
    pre_mlp_layernorm_output = self._forward_pre_mlp_layernorm(hidden_states)

    if isinstance(pre_mlp_layernorm_output, tuple):
        if len(pre_mlp_layernorm_output) != 2:
            raise ValueError(
                f"When the output of pre_mlp_layernorm is a tuple, it is "
                f"expected to have 2 elements (output, residual), but "
                f"got {len(pre_mlp_layernorm_output)}"
            )
        pre_mlp_layernorm_output, residual = pre_mlp_layernorm_output
    else:
        # Residual connection.
        residual = hidden_states

    if self.config.fp32_residual_connection:
        residual = residual.float()

    pre_mlp_layernorm_output, padding_mask, moe_unflatten_mbs = self._maybe_unflatten_for_moe(
        pre_mlp_layernorm_output, padding_mask, packed_seq_params
    )
    # The MoE router takes the modality mask; dense MLPs never see it.
    moe_kwargs = {}
    if modality_mask is not None and self.is_moe_layer:
        if moe_unflatten_mbs is not None:  # same [mbs, tokens_per_sample] view as padding_mask
            modality_mask = modality_mask.reshape(moe_unflatten_mbs, -1)
        moe_kwargs["modality_mask"] = modality_mask

    nvtx_range_push(suffix="mlp")
    # Potentially chunk the MLP computation during prefill to minimize the peak activation size
    should_chunk_mlp_for_prefill = (
        self.config.mlp_chunks_for_prefill > 1
        and inference_context is not None
        and not inference_context.is_decode_only()
        and not isinstance(self.mlp, IdentityOp)
        and not self.config.transformer_impl == "inference_optimized"
    )
    should_chunk_mlp_for_training = (
        self.config.mlp_chunks_for_training > 1
        and inference_context is None
        and self.training
        and not isinstance(self.mlp, IdentityOp)
    )

    using_fused_tp_inference_kernel = (
        InferenceMode.is_active() and self.config.inference_fuse_tp_communication
    )

    if self.recompute_mlp:
        if self.config.fp8 or self.config.fp4:
            # import here to avoid circular import
            from megatron.core.extensions.transformer_engine import te_checkpoint

            mlp_output_with_bias = te_checkpoint(
                apply_module(self.mlp),
                False,
                tensor_parallel.random.get_cuda_rng_tracker,
                self.pg_collection.tp,
                pre_mlp_layernorm_output,
                padding_mask=padding_mask,
                **moe_kwargs,
            )
        else:
            mlp_output_with_bias = tensor_parallel.checkpoint(
                functools.partial(
                    apply_module(self.mlp), padding_mask=padding_mask, **moe_kwargs
                ),
                False,
                pre_mlp_layernorm_output,
            )
    elif should_chunk_mlp_for_prefill or should_chunk_mlp_for_training:
        # Chunk input along sequence dimension
        num_chunks = min(
            (
                self.config.mlp_chunks_for_prefill
                if should_chunk_mlp_for_prefill
                else self.config.mlp_chunks_for_training
            ),
            pre_mlp_layernorm_output.shape[0],
        )

        chunks = pre_mlp_layernorm_output.chunk(num_chunks, dim=0)

        # Compute outputs for each chunk
        if moe_kwargs:  # the [b, s] modality mask splits along s like the [s, b, h] input
            modality_chunks = moe_kwargs["modality_mask"].chunk(num_chunks, dim=1)
            outputs = [
                apply_module(self.mlp)(chunk, modality_mask=modality_chunk)
                for chunk, modality_chunk in zip(chunks, modality_chunks)
            ]
        else:
            outputs = [apply_module(self.mlp)(chunk) for chunk in chunks]

        # Aggregate chunk outputs
        mlp_output = torch.cat([out for out, _ in outputs], dim=0)
        bias_chunks = [bias for _, bias in outputs if bias is not None]
        # elements in bias_chunks are the same for all chunks, so we can just use the first one
        bias_output = bias_chunks[0] if bias_chunks else None
        mlp_output_with_bias = (mlp_output, bias_output)
    else:
        if using_fused_tp_inference_kernel:
            # Set the residual for fused reduce-scatter + add + layer-norm + all-gather
            # operation in MLP's fc2.
            self._set_fc2_residual(residual)
        mlp_output_with_bias = apply_module(self.mlp)(
            pre_mlp_layernorm_output, padding_mask=padding_mask, **moe_kwargs
        )

    if moe_unflatten_mbs is not None:
        mlp_output, mlp_bias = mlp_output_with_bias
        mlp_output = self._maybe_reflatten_from_moe(
            mlp_output, packed_seq_params, moe_unflatten_mbs
        )
        mlp_output_with_bias = (mlp_output, mlp_bias)

    nvtx_range_pop(suffix="mlp")

    if (
        self.is_moe_layer
        and self.config.cuda_graph_impl == "transformer_engine"
        and self.training
        and is_graph_capturing()
        and CudaGraphModule.moe_router in self.config.cuda_graph_modules
    ):
        if self.recompute_pre_mlp_layernorm:
            # Register the recompute hooks to all the cudagraph output tensors, because some
            # tensors are in parallel execution paths and they all need pre_mlp_layernorm to be
            # recomputed in backward pass. For example, the router path and the shared expert
            # path. So only register in one path is risky.
            for tensor in mlp_output_with_bias:
                self.pre_mlp_norm_checkpoint.discard_output_and_register_recompute(tensor)
        return list(mlp_output_with_bias) + [residual]
    else:
        return self._forward_post_mlp(mlp_output_with_bias, residual)


def _moe_layer_forward_mlp(original):
    """`MoETransformerLayer._forward_mlp` taking `modality_mask` (refused with partial CUDA graphs)."""

    @functools.wraps(original)
    def _forward_mlp(self, hidden_states, inference_context=None, padding_mask=None, packed_seq_params=None,
                     modality_mask=None):
        if modality_mask is None:
            return original(self, hidden_states, inference_context, padding_mask, packed_seq_params)
        if self.use_partial_cudagraphs:
            raise NotImplementedError(
                "modality_mask is not captured by the partial MoE CUDA graphs "
                "(cuda_graph_modules moe_router / moe_preprocess); route without them"
            )
        return layer_forward_mlp(self, hidden_states, padding_mask=padding_mask,
                                 packed_seq_params=packed_seq_params, modality_mask=modality_mask)

    return _forward_mlp


def _hyper_connection_forward(original):
    """`HyperConnectionTransformerLayer.forward` handing `modality_mask` to its MoE layer for the call."""

    @functools.wraps(original)
    def forward(self, *args, modality_mask=None, **kwargs):
        if modality_mask is None or not self.is_moe_layer:
            return original(self, *args, **kwargs)
        with _called_with([self.mlp], modality_mask=modality_mask):
            return original(self, *args, **kwargs)

    return forward


def upstream_threads_modality_mask() -> bool:
    """Probe: does a 3-token mask passed to GPTModel.forward reach an MoE layer's MLP through the block?"""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # Bare modules (no parallel state, no weights): upstream's own GPTModel.forward, TransformerBlock.forward,
    # TransformerLayer.forward and _forward_mlp run; only the leaves around them are stand-ins.
    config = SimpleNamespace(fine_grained_activation_offloading=False, moe_paged_stash=False, sequence_parallel=False,
                             pipeline_model_parallel_size=1, fp8=False, fp4=False, recompute_granularity=None,
                             cpu_offloading=False, fp32_residual_connection=False, mlp_chunks_for_prefill=1,
                             mlp_chunks_for_training=1, transformer_impl="local", inference_fuse_tp_communication=False,
                             cuda_graph_impl="none", cuda_graph_modules=[])

    class Router(torch.nn.Module):  # the MoE layer's side: adds the mask it was handed to its input
        def forward(self, hidden_states, padding_mask=None, modality_mask=None):
            if modality_mask is None:
                return hidden_states, None
            return hidden_states + modality_mask.transpose(0, 1).unsqueeze(-1), None

    class Layer(TransformerLayer):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.config, self.layer_number, self.is_moe_layer, self.recompute_mlp = config, 1, True, False
            self.mlp = Router()

        def __call__(self, *args, **kwargs):  # skip TransformerLayer's CUDA-graph __call__
            return self.forward(*args, **kwargs)

        def _forward_attention(self, hidden_states=None, context=None, **kwargs):
            return hidden_states, context

        def _forward_pre_mlp_layernorm(self, hidden_states):
            return hidden_states

        def _maybe_unflatten_for_moe(self, hidden_states, padding_mask, packed_seq_params):
            return hidden_states, padding_mask, None

        def _forward_post_mlp(self, mlp_output_with_bias, residual):
            return mlp_output_with_bias[0]

    class Block(TransformerBlock):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.config, self.pg_collection, self.vp_stage, self.pre_process = config, SimpleNamespace(), None, True
            self.offload_context, self.final_layernorm = nullcontext(), None
            self.layers = torch.nn.ModuleList([Layer()])

        def __call__(self, *args, **kwargs):
            return self.forward(*args, **kwargs)

    class Model(GPTModel):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.config, self.mtp_process, self.decoder = config, False, Block()

        def _preprocess(self, input_ids, padding_mask=None, **kwargs):
            return input_ids.transpose(0, 1).unsqueeze(-1).float(), None, None, None, None, padding_mask

        def _postprocess(self, hidden_states, **kwargs):
            return hidden_states

    mask = torch.tensor([[False, True, False]])
    try:
        out = Model().forward(torch.zeros(1, 3, dtype=torch.long), None, None, modality_mask=mask)
    except TypeError:  # 0.19.x: GPTModel.forward takes no modality_mask
        return False
    return out.flatten().tolist() == [0.0, 1.0, 0.0]


@mcore_twin(
    patch_id="DSV41-MCORE-012",
    versions=">=0.19.2,<0.20.0",
    touches=TOUCHES,
    gate="DSV4FLASH_MCORE_MODALITY_MASK",
    tests=("tests/patches/test_mcore_modality_mask.py",),
    depends_on=("DSV41-MCORE-004", "DSV41-MCORE-007", "DSV41-MCORE-010"),
    upstream_has_it=upstream_threads_modality_mask,
)
def install(patcher: Patcher) -> None:
    """Thread `modality_mask` from GPTModel through the block and layers (and recompute) to MoELayer."""
    from megatron.core import recompute
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.hyper_connection import HyperConnectionTransformerLayer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

    patcher.add(GPTModel, "_preprocess_modality_mask", preprocess_modality_mask)
    patcher.replace(GPTModel, "forward", _gpt_forward(GPTModel.forward))
    patcher.replace(TransformerBlock, "forward", _block_forward(TransformerBlock.forward))
    patcher.replace(recompute, "checkpointed_forward", checkpointed_forward)
    patcher.replace(transformer_block, "checkpointed_forward", checkpointed_forward)
    patcher.replace(TransformerLayer, "forward", layer_forward)
    patcher.replace(TransformerLayer, "_forward_mlp", layer_forward_mlp)
    patcher.replace(MoETransformerLayer, "_forward_mlp", _moe_layer_forward_mlp(MoETransformerLayer._forward_mlp))
    patcher.replace(HyperConnectionTransformerLayer, "forward",
                    _hyper_connection_forward(HyperConnectionTransformerLayer.forward))
