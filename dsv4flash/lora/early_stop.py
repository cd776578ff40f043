"""Backward that stops at the first trainable block: everything below it runs under `torch.no_grad()`.

With the ViT and the encoder frozen (e.g. `decoder_half`), the embedding, vision tower, Engram hashing
and the frozen blocks build no autograd graph: none of their activations are kept and no backward runs
through them. The CSA2 state they publish (compressed KV, index keys, top-k) is handed to the trainable
blocks as plain tensors, exactly as the full forward would see them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dsv4flash.model.state import CSA2State

_INPUT_MODULES = ("embed", "vision", "aligner")
_INPUT_PARAMS = ("image_start", "image_end", "image_newline")


def inputs_trainable(model: nn.Module) -> bool:
    """Whether anything before the first block (embedding, ViT, aligner, image delimiters) trains."""
    for name in _INPUT_MODULES:
        module = getattr(model, name, None)
        if module is not None and any(p.requires_grad for p in module.parameters()):
            return True
    return any(getattr(model, n, None) is not None and getattr(model, n).requires_grad for n in _INPUT_PARAMS)


def first_trainable_layer(model: nn.Module) -> int:
    """Index of the first block with a trainable parameter (0 if the inputs train, len(layers) if none)."""
    if inputs_trainable(model):
        return 0
    for i, block in enumerate(model.layers):
        if any(p.requires_grad for p in block.parameters()):
            return i
    return len(model.layers)


def forward_with_early_stop(model: nn.Module, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                            images: Sequence | None = None) -> torch.Tensor:
    """Same logits as `model(input_ids, token_types, images)`; the frozen prefix runs without autograd."""
    start = first_trainable_layer(model)
    grad_inputs = inputs_trainable(model) and torch.is_grad_enabled()
    with torch.set_grad_enabled(grad_inputs):
        streams, pre_mix, context = model.embed_inputs(input_ids, token_types, images)
        streams, pre_mix, state = model.run_layers(streams, pre_mix, CSA2State(), context, 0, start)
    streams, pre_mix, state = model.run_layers(streams, pre_mix, state, context, start, None)  # [B,S,hc,D]
    return model.logits(streams, pre_mix)  # [B,S,vocab] fp32
