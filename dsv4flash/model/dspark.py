"""DSpark draft blocks (`mtp.{k}.*`, docs/architecture.md §8.4): held, loaded and converted, never run.

Every training port drops the draft blocks, and so do we: they exist so that a checkpoint builds, loads,
converts and round-trips with all 2,401 `mtp.*` tensors. Each block is a window-only V4.1 block with its
own (smaller) expert set; stage 0 adds the projection of the captured target-layer states, the last stage
adds the Markov and confidence heads.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4flash.config import DSV41FlashConfig, LayerPlan
from dsv4flash.model.block import Block
from dsv4flash.model.norm import RMSNorm


class MarkovHead(nn.Module):
    """Low-rank token-to-token head of the last draft stage: `embed` and `head`, both [vocab, markov_rank]."""

    def __init__(self, vocab: int, rank: int, dtype, device) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=dtype, device=device)
        self.head = nn.Linear(rank, vocab, bias=False, dtype=dtype, device=device)


class ConfidenceHead(nn.Module):
    """Scalar acceptance-confidence projection over [hidden ‖ markov state] (no bias)."""

    def __init__(self, in_features: int, dtype, device) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=False, dtype=dtype, device=device)


class DSparkBlock(Block):
    """Draft block `mtp.{stage}`: a window-only block plus the stage-specific extras."""

    def __init__(self, cfg: DSV41FlashConfig, plan: LayerPlan, stage: int, dtype=torch.float32, device=None) -> None:
        text = cfg.text
        super().__init__(cfg, plan, text.dspark_n_routed_experts, text.dspark_num_experts_per_tok, dtype, device)
        dim = text.hidden_size
        if stage == 0:
            captured = len(text.dspark_target_layer_ids) * dim
            self.main_proj = nn.Linear(captured, dim, bias=False, dtype=dtype, device=device)
            self.main_norm = RMSNorm(dim, text.rms_norm_eps, dtype=dtype, device=device)
        if stage == text.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(dim, text.rms_norm_eps, dtype=dtype, device=device)
            self.markov_head = MarkovHead(text.vocab_size, text.dspark_markov_rank, dtype, device)
            self.confidence_head = ConfidenceHead(dim + text.dspark_markov_rank, dtype, device)
