# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""Manifold-constrained hyper-connections (mHC): a transformer layer over several residual streams.

Each layer keeps ``hc_mult`` residual streams. At every site (attention, MLP) a small projection of
all streams yields three coefficient sets: ``pre`` (how the streams collapse into the sublayer input),
``post`` (how the sublayer output is written back to each stream) and ``comb`` (a doubly stochastic
stream-mixing matrix from Sinkhorn iterations). The ``pre`` of one site collapses the input of the next
site, so a layer hands the next one its MLP-site ``pre`` in the context slot together with whatever
state its attention carries (an explicit per-layer state, carried through full recompute by
``recompute.checkpointed_forward``). Streams travel between layers packed as [s, b, hc_mult * h]; the
first layer expands the embeddings into the streams and the last layer collapses them back to [s, b, h],
so a stock ``TransformerBlock`` runs the stack unchanged.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


@dataclass
class HyperConnectionTransformerConfig(TransformerConfig):
    """TransformerConfig with the mHC options."""

    hc_mult: int = 4
    """Number of residual streams per layer."""

    hc_sinkhorn_iters: int = 20
    """Sinkhorn iterations (column + row normalisation each) that make ``comb`` doubly stochastic."""

    hc_eps: float = 1e-6
    """Added to ``pre`` and inside the Sinkhorn normalisation."""

    def __post_init__(self):
        super().__post_init__()
        if self.hc_mult < 1:
            raise ValueError(f"hc_mult must be at least 1, got {self.hc_mult}")
        if self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be at least 1, got {self.hc_sinkhorn_iters}")


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] logits -> doubly stochastic matrix: row softmax, then `iters` column/row passes."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def unpack_streams(hidden_states: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Packed streams [s, b, n * h] -> [s, b, n, h] (a view)."""
    s, b, width = hidden_states.shape
    return hidden_states.view(s, b, hc_mult, width // hc_mult)


def pack_streams(streams: torch.Tensor) -> torch.Tensor:
    """Streams [s, b, n, h] -> the packed [s, b, n * h] that travels between layers."""
    return streams.flatten(2)


STAGE_PAYLOAD_DTYPE = torch.float32
STAGE_PAYLOAD_ALIGN = 16
"""Elements (64 bytes of fp32) every payload section starts on."""
_PAYLOAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)


def _aligned(n: int) -> int:
    return -(-n // STAGE_PAYLOAD_ALIGN) * STAGE_PAYLOAD_ALIGN


def encode_stage_payload(parts: Sequence[Optional[torch.Tensor]], meta: Sequence[int] = ()) -> torch.Tensor:
    """The stream state at a pipeline-stage boundary as the one tensor the schedule sends: [N, 1, 1] fp32.

    ``parts`` are the packed streams and the context tuple (the next collapse weights and any attention
    layer state), each a 3-d tensor or None; ``meta`` are small integers that travel with them. A header
    of exact fp32 integers (the counts, ``meta``, each part's dtype and shape) comes first, so the
    receiver rebuilds every part without knowing its shape (the schedule's ``variable_seq_lengths``
    mode exchanges the payload's size). Integers are exact in fp32 up to 2**24; bf16 parts travel
    exactly. The float parts stay differentiable: the gradient the next stage sends back reaches them.

    The header and every part start on a ``STAGE_PAYLOAD_ALIGN`` boundary (zero filled), so the parts the
    receiver views in the payload, and the gradients the sender views in the returned gradient, are as
    aligned as freshly allocated tensors: a BLAS may pick its kernel, and with it its summation order, by
    operand alignment, and a stage must compute bit for bit what the same layers compute without pipelining.
    """
    header = [len(meta), len(parts), *meta]
    flat = []
    device = next((p.device for p in parts if p is not None), None)
    for part in parts:
        if part is None:
            header += [-1, 0, 0, 0]
            continue
        if part.dim() != 3:
            raise ValueError(f"stage payload: parts must be 3-d, got {list(part.shape)}")
        header += [_PAYLOAD_DTYPES.index(part.dtype), *part.shape]
        flat.append(part.reshape(-1).to(STAGE_PAYLOAD_DTYPE))
        pad = _aligned(part.numel()) - part.numel()
        if pad:
            flat.append(torch.zeros(pad, dtype=STAGE_PAYLOAD_DTYPE, device=device))
    head = torch.zeros(_aligned(len(header)), dtype=STAGE_PAYLOAD_DTYPE, device=device)
    head[: len(header)] = torch.tensor(header, dtype=STAGE_PAYLOAD_DTYPE)
    return torch.cat([head, *flat]).view(-1, 1, 1)


def decode_stage_payload(
    payload: torch.Tensor, detach: Sequence[int] = ()
) -> Tuple[List[Optional[torch.Tensor]], Tuple[int, ...]]:
    """Inverse of ``encode_stage_payload``: (parts as views of the payload, meta).

    Integer and bool parts carry no gradient; float parts whose index is in ``detach`` leave the graph.
    """
    flat = payload.reshape(-1)
    if flat.numel() < 2:
        raise ValueError(f"stage payload of {flat.numel()} values is shorter than its header")
    n_meta, n_parts = (int(v) for v in flat[:2].detach().tolist())
    size = 2 + n_meta + 4 * n_parts
    if n_meta < 0 or n_parts < 0 or flat.numel() < _aligned(size):
        raise ValueError(
            f"stage payload of {flat.numel()} values is shorter than its {size}-value header "
            "(was the previous stage built with the same layers?)"
        )
    header = [int(v) for v in flat[:size].detach().tolist()]
    meta, offset = tuple(header[2 : 2 + n_meta]), _aligned(size)
    parts: List[Optional[torch.Tensor]] = []
    for i in range(n_parts):
        code, *shape = header[2 + n_meta + 4 * i : 6 + n_meta + 4 * i]
        if code < 0:
            parts.append(None)
            continue
        n = shape[0] * shape[1] * shape[2]
        if offset + n > flat.numel():
            raise ValueError(f"stage payload: part {i} needs {n} values past {offset}, {flat.numel()} sent")
        value = flat[offset : offset + n].view(shape)
        dtype = _PAYLOAD_DTYPES[code]
        if dtype == torch.bool:
            value = value.detach() > 0.5
        elif dtype == torch.int64:
            value = value.detach().round().to(torch.int64)
        elif i in detach:
            value = value.detach().to(dtype)
        else:
            value = value.to(dtype)
        parts.append(value)
        offset += _aligned(n)
    if offset != flat.numel():
        raise ValueError(f"stage payload: {flat.numel() - offset} values left over after the header's parts")
    return parts, meta


def collapse_streams(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """streams [s, b, n, h], weights [s, b, n] -> sum_i w_i * X_i [s, b, h] (accumulated in fp32)."""
    return torch.einsum("sbnh,sbn->sbh", streams.float(), weights.float()).to(streams.dtype)


def expand_streams(
    output: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """out_j = post_j * y + sum_i comb[i, j] * X_i in fp32.

    output [s, b, h], residual [s, b, n, h], post [s, b, n], comb [s, b, n, n] -> [s, b, n, h].
    """
    mixed = torch.einsum("sbih,sbij->sbjh", residual.float(), comb.float())
    return (post.float().unsqueeze(-1) * output.float().unsqueeze(-2) + mixed).to(residual.dtype)


class HyperConnection(MegatronModule):
    """The mHC coefficients of one site: ``pre`` [s, b, n], ``post`` [s, b, n], ``comb`` [s, b, n, n].

    Parameters: ``fn`` [(2 + n) * n, n * h] projects the RMS-normalised streams, ``base`` [(2 + n) * n]
    is added, ``scale`` [3] scales the pre / post / comb parts. The coefficients are computed in fp32.
    Parameters are replicated over tensor-parallel ranks (every rank holds whole streams) and stay fp32
    when the model is cast to half precision (``Float16Module`` calls ``.bfloat16()`` / ``.half()``).
    """

    def __init__(self, config: HyperConnectionTransformerConfig, **kwargs):
        super().__init__(config)
        n = config.hc_mult
        self.hc_mult = n
        coefficients = (2 + n) * n
        self.fn = torch.nn.Parameter(
            torch.empty(coefficients, n * config.hidden_size, dtype=torch.float32)
        )
        if config.perform_initialization:
            config.init_method(self.fn)
        self.base = torch.nn.Parameter(torch.zeros(coefficients, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        """nn.Module._apply, keeping the exact fp32 values of the coefficient parameters across a cast."""
        saved = {name: param.data for name, param in self.named_parameters(recurse=False)}
        out = super()._apply(fn, recurse)
        for name, param in self.named_parameters(recurse=False):
            if param.dtype != torch.float32 and not param.is_meta:
                param.data = saved[name].to(device=param.device)
        return out

    def forward(self, streams: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [s, b, n, h] -> (pre [s, b, n], post [s, b, n], comb [s, b, n, n] as [in, out])."""
        n = self.hc_mult
        flat = streams.float().flatten(2)  # [s, b, n * h]
        rms = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.config.layernorm_epsilon)
        mix = (flat @ self.fn.float().t()) * rms  # [s, b, (2 + n) * n]
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + self.config.hc_eps
        post = 2 * torch.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
        comb_logits = (mix[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
        return pre, post, sinkhorn(comb_logits, self.config.hc_sinkhorn_iters, self.config.hc_eps)


@dataclass
class HyperConnectionTransformerLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus the mHC coefficients of the attention and MLP sites."""

    self_attn_hyper_connection: Union[ModuleSpec, type] = HyperConnection
    mlp_hyper_connection: Union[ModuleSpec, type] = HyperConnection


class HyperConnectionTransformerLayer(TransformerLayer):
    """A transformer layer on ``hc_mult`` residual streams (see the module docstring).

    Calling convention: ``layer(hidden_states, context=...) -> (hidden_states, context)`` where, between
    layers, hidden_states are the packed streams [s, b, n * h] and context is the tuple
    ``(pre, *attention_state)``. The first layer (context None) takes the embeddings [s, b, h]; the
    layer numbered ``config.num_layers`` returns the collapsed [s, b, h] and no context.

    A self-attention module that sets ``carries_layer_state = True`` is called as
    ``self_attention(x, layer_state, attention_mask=..., packed_seq_params=...) -> (out, layer_state)``
    and its state travels in the context tuple; any other attention module is called the stock way.
    """

    def __init__(
        self,
        config: HyperConnectionTransformerConfig,
        submodules: HyperConnectionTransformerLayerSubmodules,
        layer_number: int = 1,
        **kwargs,
    ):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        if config.pipeline_model_parallel_size > 1:
            raise NotImplementedError(
                "HyperConnectionTransformerLayer: the stream state does not cross pipeline stages yet "
                "(pipeline_model_parallel_size must be 1)"
            )
        if config.sequence_parallel:
            raise NotImplementedError(
                "HyperConnectionTransformerLayer needs whole sequences on every rank "
                "(sequence_parallel must be False)"
            )
        self.self_attn_hyper_connection = build_module(
            submodules.self_attn_hyper_connection, config=config
        )
        self.mlp_hyper_connection = build_module(submodules.mlp_hyper_connection, config=config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        context: Optional[Tuple[Optional[torch.Tensor], ...]] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        padding_mask: Optional[torch.Tensor] = None,
        inference_context=None,
        **kwargs,
    ):
        """hidden_states [s, b, h] (first layer) or [s, b, n * h] -> (streams or [s, b, h], context)."""
        if inference_context is not None:
            raise NotImplementedError("HyperConnectionTransformerLayer has no inference path yet")
        n = self.config.hc_mult
        if context is None:  # first layer: every stream starts as the embedding
            s, b, h = hidden_states.shape
            streams = hidden_states.unsqueeze(2).expand(s, b, n, h)
            pre = torch.zeros(s, b, n, dtype=torch.float32, device=hidden_states.device)
            pre[..., 0] = 1.0
            attention_state: Tuple[Optional[torch.Tensor], ...] = ()
        else:
            streams = unpack_streams(hidden_states, n)
            pre, *rest = context
            attention_state = tuple(rest)

        # Attention site.
        attn_pre, attn_post, attn_comb = self.self_attn_hyper_connection(streams)
        x = self.input_layernorm(collapse_streams(streams, pre))  # [s, b, h]
        if getattr(self.self_attention, "carries_layer_state", False):
            out, attention_state = self.self_attention(
                x,
                attention_state,
                attention_mask=attention_mask,
                packed_seq_params=packed_seq_params,
            )
        else:
            out, bias = self.self_attention(
                x,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params,
            )
            out = out if bias is None else out + bias
        streams = expand_streams(out, streams, attn_post, attn_comb)  # [s, b, n, h]

        # MLP site: collapsed with the attention site's pre.
        mlp_pre, mlp_post, mlp_comb = self.mlp_hyper_connection(streams)
        x = self.pre_mlp_layernorm(collapse_streams(streams, attn_pre))
        if self.is_moe_layer:
            out, bias = self.mlp(x, padding_mask=padding_mask)
        else:
            out, bias = self.mlp(x)
        out = out if bias is None else out + bias
        streams = expand_streams(out, streams, mlp_post, mlp_comb)

        if self.layer_number == self.config.num_layers:  # last layer: back to one hidden state
            return collapse_streams(streams, mlp_pre), None
        return pack_streams(streams), (mlp_pre, *attention_state)
