"""Shared-encoder multi-adapter scoring: encoder half + the CED source's compressed KV once, decoder per adapter.

A decoder-only adapter (layers ≥ `cfg.decoder_start`) whose KV write is frozen (`freeze_kv_write`: no LoRA on
layer decoder_start's `attn.wkv` and compressor) sees exactly the base's encoder output and the base's
compressed KV. So for one prompt batch we run `embed_inputs` + `run_layers(0, decoder_start)` once, compute
the source compressor's latent once, and run only `run_layers(decoder_start, end)` + `logits` per adapter.
Every op sees the same shapes and values as the separate full forward, so the logits are bit-equal. An
adapter that is not decoder-only, or whose KV write trains, is refused for sharing (with the reason) and run
separately.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from dsv4flash.model.state import CSA2State


def sharing_refusal(resident, placement) -> str | None:
    """Why `placement` cannot share the encoder (None if it can)."""
    from dsv4flash.lora import get_handle

    start = resident.cfg.decoder_start
    handle = get_handle(resident.shell(placement))
    early = [l for l in handle.layers() if l < start]
    if early:
        return (f"adapter is not decoder-only: it has LoRA on encoder layers {list(early)} "
                f"(decoder_start = {start}; preset {placement.preset!r}, layers={placement.layers!r})")
    if not placement.freeze_kv_write:
        return (f"adapter trains the KV write of layer {start} (freeze_kv_write=False): its compressed KV differs "
                f"from the base's, so it cannot share it")
    return None


@dataclass
class MultiAdapterResult:
    """Logits per adapter ([B,S,V] fp32, in input order) and which adapters were refused sharing, and why."""

    logits: list[torch.Tensor]
    refused: dict[int, str] = field(default_factory=dict)
    shared: list[int] = field(default_factory=list)
    compressor_reuses: int = 0  # adapters that took the source compressor's latent from the shared pass


@contextmanager
def _cached_compressor(model, latent_cache: dict):
    """Layer decoder_start's compressor returns the latent computed once (input checked bit-equal)."""
    comp = model.layers[model.cfg.decoder_start].attn.compressor
    if comp is None:
        yield
        return

    def forward(x):
        if "x" in latent_cache and torch.equal(latent_cache["x"], x):
            latent_cache["hits"] = latent_cache.get("hits", 0) + 1
            return latent_cache["latent"]
        out = type(comp).forward(comp, x)
        latent_cache.update(x=x, latent=out)
        return out

    comp.forward = forward
    try:
        yield
    finally:
        del comp.forward


@torch.no_grad()
def multi_adapter_logits(resident, input_ids: torch.Tensor, adapters: list[tuple], share: bool = True) -> MultiAdapterResult:
    """input_ids [B,S]; adapters: [(placement, tensors)] -> logits per adapter (shared encoder where allowed)."""
    result = MultiAdapterResult([None] * len(adapters))
    start = resident.cfg.decoder_start
    with resident.lock:
        if share:
            for i, (pc, _) in enumerate(adapters):
                reason = sharing_refusal(resident, pc)
                if reason is None:
                    result.shared.append(i)
                else:
                    result.refused[i] = reason
        enc = None
        cache: dict = {}
        if result.shared:
            base = resident.model
            streams, pre_mix, ctx = base.embed_inputs(input_ids)  # [B,S,hc,D]
            enc = base.run_layers(streams, pre_mix, CSA2State(), ctx, 0, start) + (ctx,)
        for i, (pc, tensors) in enumerate(adapters):
            with resident.bind(pc, tensors) as model:
                if i in result.shared:
                    streams, pre_mix, state, ctx = enc
                    with _cached_compressor(model, cache):
                        streams, pre_mix, _ = model.run_layers(streams, pre_mix, state, ctx, start, None)
                    result.logits[i] = model.logits(streams, pre_mix)  # [B,S,V]
                else:
                    result.logits[i] = model(input_ids)
    result.compressor_reuses = cache.get("hits", 0)
    return result
