"""The whole V4.1-Flash reference model (§2.1): embed → image spans → 4 streams → blocks → collapse → head.

Parameter names are the release names (no `model.` prefix), so `state_dict()` keys are checkpoint keys.
The forward is split into `embed_inputs` / `run_layers` / `logits` so that callers (LoRA early stop,
shared-encoder sampling, Megatron parity) can run a slice of the stack with the same explicit state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dsv4flash.config import DSV41FlashConfig, load_config
from dsv4flash.model.block import Block, TokenContext
from dsv4flash.model.dspark import DSparkBlock
from dsv4flash.model.hyper_connection import collapse
from dsv4flash.model.init import init_weights
from dsv4flash.model.norm import RMSNorm
from dsv4flash.model.state import CSA2State


class Transformer(nn.Module):
    """Single-device reference of DeepSeek-V4.1-Flash; builds on `meta` without allocating."""

    def __init__(self, cfg: DSV41FlashConfig | str = "tiny", dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, seed: int | None = 0) -> None:
        super().__init__()
        cfg = load_config(cfg)
        self.cfg = cfg
        text, vision = cfg.text, cfg.vision
        dim = text.hidden_size
        self.embed = nn.Embedding(text.vocab_size, dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Block(cfg, plan, text.n_routed_experts, text.num_experts_per_tok, dtype, device)
            for plan in cfg.backbone_plan
        )
        self.norm = RMSNorm(dim, text.rms_norm_eps, dtype=dtype, device=device)
        # REF holds the head in fp32 and computes fp32 logits.
        self.head = nn.Linear(dim, text.vocab_size, bias=False, dtype=torch.float32, device=device)
        if vision.enabled:
            from dsv4flash.model.vision import Aligner, VisionTower

            self.vision = VisionTower(cfg, dtype=dtype, device=device)
            self.aligner = Aligner(cfg, dtype=dtype, device=device)
            for name in ("image_start", "image_end", "image_newline"):
                self.register_parameter(name, nn.Parameter(torch.empty(dim, dtype=dtype, device=device)))
        else:
            self.vision = self.aligner = None
        if text.engram_layer_ids:
            from dsv4flash.model.engram import EngramHasher

            self.engram_hasher = EngramHasher(cfg)
            if device is not None:
                self.engram_hasher.to(device)
        else:
            self.engram_hasher = None
        self.mtp = nn.ModuleList(
            DSparkBlock(cfg, plan, stage, dtype, device) for stage, plan in enumerate(cfg.draft_plan)
        )
        if seed is not None and torch.device(device or "cpu").type != "meta":
            init_weights(self, cfg, seed)

    # ---- pieces of the forward ------------------------------------------------------------------
    def embed_inputs(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                     images: Sequence | None = None, history: tuple[torch.Tensor, torch.Tensor] | None = None):
        """-> (streams [B,S,hc,D], pre_mix [B,S,hc], TokenContext). token_types: −1 text, ≥0 image span.

        history: (ids, types) [B,H] of the tokens just before these (incremental decode's Engram look-back).
        """
        batch, seq = input_ids.shape
        if token_types is None:
            token_types = torch.full_like(input_ids, -1)
        image_mask = token_types >= 0
        h = self.embed(input_ids)  # [B,S,D]
        if images:
            h = self._fill_images(h, token_types, images)
        elif bool(image_mask.any()):
            raise ValueError("token_types mark image-span positions but no images were given")
        row_ids = ()
        if self.engram_hasher is not None:
            if history is None:
                row_ids = tuple(self.engram_hasher(input_ids, token_types))
            else:
                looked = self.engram_hasher(torch.cat([history[0], input_ids], 1),
                                            torch.cat([history[1], token_types], 1))
                row_ids = tuple(r[:, history[0].shape[1]:] for r in looked)
        hc = self.cfg.text.hc_mult
        streams = h.unsqueeze(2).expand(batch, seq, hc, h.shape[-1]).contiguous()  # [B,S,hc,D]
        pre_mix = torch.zeros(batch, seq, hc, dtype=torch.float32, device=h.device)
        pre_mix[..., 0] = 1.0  # the first collapse reads stream 0
        return streams, pre_mix, TokenContext(image_mask=image_mask, engram_row_ids=row_ids)

    def run_layers(self, streams: torch.Tensor, pre_mix: torch.Tensor, state: CSA2State, context: TokenContext,
                   start: int = 0, end: int | None = None):
        """Blocks [start, end) -> (streams, pre_mix, state); the CSA2 state is threaded explicitly."""
        for block in self.layers[start:end]:
            streams, pre_mix, state = block(streams, pre_mix, state, context)
        return streams, pre_mix, state

    def logits(self, streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """Final collapse with the last FFN-site pre, norm, fp32 head. -> [B,S,vocab] fp32."""
        h = self.norm(collapse(streams, pre_mix))
        return self.head(h.float())

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                images: Sequence | None = None) -> torch.Tensor:
        """input_ids: [B,S] (image spans expanded), token_types: [B,S] -> logits [B,S,vocab] fp32."""
        streams, pre_mix, context = self.embed_inputs(input_ids, token_types, images)
        streams, pre_mix, _ = self.run_layers(streams, pre_mix, CSA2State(), context)
        return self.logits(streams, pre_mix)

    def prefill(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None,
                images: Sequence | None = None):
        """Prompt [B,S] -> (logits [B,S,vocab] fp32, DecodeCache); see dsv4flash/model/decode.py."""
        from dsv4flash.model.decode import prefill

        return prefill(self, input_ids, token_types, images)

    def decode(self, cache, next_ids: torch.Tensor, token_types: torch.Tensor | None = None):
        """(DecodeCache, next_ids [B] or [B,n]) -> (logits [B,vocab] or [B,n,vocab], the extended cache)."""
        from dsv4flash.model.decode import decode

        return decode(self, cache, next_ids, token_types)

    def _fill_images(self, h: torch.Tensor, token_types: torch.Tensor, images: Sequence) -> torch.Tensor:
        if self.vision is None:
            raise ValueError("this config has no vision tower (vision_config.num_hidden_layers == 0)")
        from dsv4flash.model.image import fill_image_embeddings

        rows = [self.aligner(self.vision(img.patches.to(h.dtype), img.grid_hw), img.grid_hw) for img in images]
        return fill_image_embeddings(h, token_types, rows, self.image_start, self.image_newline, self.image_end)
