"""The mHC parameters of one V4.1 block as a Megatron module (architecture.md §4), and the stream packing.

Streams travel between layers packed into the hidden dimension, [s, b, hc·D] (the layout megatron-core main
uses for its hyper-connections), so the block stays a plain tensor in, tensor out for megatron-core; the
coefficient math is the reference's (`dsv4flash.model.hyper_connection`), all in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from dsv4flash.integrations.mcore.csa2.modules import KeepFP32
from dsv4flash.model.hyper_connection import HyperConnectionSite

__all__ = ["CSA2HyperConnection", "pack_streams", "unpack_streams"]

SITES = ("attn", "ffn")


def unpack_streams(hidden_states: torch.Tensor, hc: int) -> torch.Tensor:
    """[s, b, hc·D] -> [s, b, hc, D] (a view)."""
    s, b, width = hidden_states.shape
    return hidden_states.view(s, b, hc, width // hc)


def pack_streams(streams: torch.Tensor) -> torch.Tensor:
    """[s, b, hc, D] -> [s, b, hc·D]."""
    return streams.reshape(*streams.shape[:2], -1)


class CSA2HyperConnection(KeepFP32, MegatronModule):
    """`hyper_connection.{attn,ffn}_{fn,base,scale}` (release: `hc_{attn,ffn}_{fn,base,scale}`), fp32."""

    _fp32_params = tuple(f"{site}_{part}" for site in SITES for part in ("fn", "base", "scale"))

    def __init__(self, config: Any, **_unused: Any) -> None:
        super().__init__(config)
        text = config.dsv4.text
        self.hc = text.hc_mult
        n_coeff = (2 + self.hc) * self.hc  # pre, post and the hc×hc comb
        for site in SITES:
            fn = torch.nn.Parameter(torch.empty(n_coeff, self.hc * text.hidden_size, dtype=torch.float32))
            if config.perform_initialization:
                torch.nn.init.normal_(fn, mean=0.0, std=text.initializer_range)
            self.register_parameter(f"{site}_fn", fn)
            self.register_parameter(f"{site}_base", torch.nn.Parameter(torch.zeros(n_coeff, dtype=torch.float32)))
            self.register_parameter(f"{site}_scale", torch.nn.Parameter(torch.ones(3, dtype=torch.float32)))
        for param in self.parameters():
            setattr(param, "sequence_parallel", False)
        self.site = HyperConnectionSite(text)

    def forward(self, site: str, streams: torch.Tensor):
        """streams [s,b,hc,D] -> (pre [s,b,hc], post [s,b,hc], comb [s,b,hc,hc]) for site 'attn' or 'ffn'."""
        return self.site(streams, getattr(self, f"{site}_fn"), getattr(self, f"{site}_base"),
                         getattr(self, f"{site}_scale"))
