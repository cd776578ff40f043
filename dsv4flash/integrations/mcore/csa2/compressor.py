"""KV compressor of a CSA2 Full layer as a Megatron module (docs/architecture.md §2.4), packing- and CP-aware.

The work splits in two so that a group may straddle a context-parallel boundary: `token_inputs` is
per token (values and gate scores for ratio > 1, the normalised latent for ratio 1) and can travel in the
halo; `pool` turns the groups this rank owns into latents, reading members off the extended axis. A group
is always `ratio` consecutive tokens of one sequence, so padding never enters it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch
from megatron.core.transformer.experimental_attention_variant.csa2_layout import CSA2GroupTable as GroupTable
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from dsv4flash.integrations.mcore.csa2.modules import KeepFP32, build_linear, linear_forward

__all__ = ["CompressorSubmodules", "CSA2Compressor"]


@dataclass
class CompressorSubmodules:
    """Linear class for `linear_kv` / `linear_gate` (replicated) and the norm builder."""

    linear: Union[ModuleSpec, type, None] = None
    norm: Any = None


class CSA2Compressor(KeepFP32, MegatronModule):
    """`compressor.{linear_kv, linear_gate, norm}` (release: `attn.compressor.{wkv, wgate, norm}`)."""

    def __init__(self, config: Any, submodules: CompressorSubmodules, ratio: int) -> None:
        super().__init__(config)
        text = config.dsv4.text
        self.ratio = ratio
        # REF keeps the ratio > 1 compressor in fp32; ratio 1 runs in the activation dtype.
        dtype = torch.float32 if ratio > 1 else None
        self.linear_kv = build_linear(submodules.linear, text.hidden_size, text.head_dim, config, "replicated",
                                      name="compressor_kv", dtype=dtype)
        self.linear_gate = (build_linear(submodules.linear, text.hidden_size, text.head_dim, config, "replicated",
                                         name="compressor_gate", dtype=dtype) if ratio > 1 else None)
        self.norm = submodules.norm(config=config, hidden_size=text.head_dim, eps=text.rms_norm_eps)
        if ratio > 1:
            self._fp32_params = ("linear_kv.weight", "linear_gate.weight")

    def token_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """x [B,S,D] -> ratio 1: latents [B,S,hd]; ratio > 1: fp32 (values, gate scores) [B,S,2,hd]."""
        if self.ratio == 1:
            weight_dtype = self.linear_kv.weight.dtype
            return self.norm(linear_forward(self.linear_kv, x.to(weight_dtype)).to(x.dtype))
        x32 = x.float()
        return torch.stack([linear_forward(self.linear_kv, x32), linear_forward(self.linear_gate, x32)], dim=2)

    def pool(self, inputs: torch.Tensor, table: GroupTable, dtype: torch.dtype) -> torch.Tensor:
        """Extended-axis token inputs [B,E,...] -> latents of the owned groups [B,N,hd] in `dtype` (unrotated)."""
        batch = inputs.shape[0]
        if self.ratio == 1:
            idx = table.members[..., -1:].expand(-1, -1, inputs.shape[-1])  # the group's one token
            return inputs.gather(1, idx)
        members = table.members  # [B,N,r]
        n = members.shape[1]
        flat = members.reshape(batch, n * self.ratio)
        idx = flat.view(batch, -1, 1, 1).expand(-1, -1, 2, inputs.shape[-1])
        grouped = inputs.gather(1, idx).view(batch, n, self.ratio, 2, inputs.shape[-1])  # [B,N,r,2,hd]
        values, scores = grouped[..., 0, :], grouped[..., 1, :]
        pooled = (torch.softmax(scores, dim=2) * values).sum(dim=2)  # channel-wise softmax over the group
        return self.norm(pooled.to(dtype))
