"""CSA2 attention of one block (§2.3): sliding window + sink, plus compressed keys picked by the indexer.

Every layer computes its own query and window KV. What it adds from the compressed stream depends on its
plan: a Full layer compresses and publishes KV and index keys; index sources (Full, Reindex) pick their own
top-k; Reuse layers attend to the top-k published below them. The output goes through the grouped
low-rank projection `wo_a` (one block per group) and `wo_b` (§3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv4flash.config import LayerPlan, TextConfig
from dsv4flash.model.compressor import Compressor
from dsv4flash.model.indexer import Indexer
from dsv4flash.model.norm import RMSNorm
from dsv4flash.model.quant import fake_quant_compressed_kv, fake_quant_window_kv
from dsv4flash.model.rope import apply_rope, rope_angles, rope_frequencies
from dsv4flash.model.state import CSA2State

if TYPE_CHECKING:
    from dsv4flash.model.cache import CacheStep


class GroupedOutputProjection(nn.Module):
    """`wo_a`: per group g, z_g = W_g · o_g with W viewed as [groups, rank, in_per_group] (rows group-major)."""

    def __init__(self, groups: int, in_per_group: int, rank: int, dtype, device) -> None:
        super().__init__()
        self.groups, self.rank, self.in_per_group = groups, rank, in_per_group
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group, dtype=dtype, device=device))

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o: [B,S,G,in_per_group] -> [B,S,G·rank]."""
        w = self.weight.view(self.groups, self.rank, self.in_per_group)
        return torch.einsum("bsgd,grd->bsgr", o, w.to(o.dtype)).flatten(-2)


def window_mask(seq: int, window: int, device, past: int = 0) -> torch.Tensor:
    """[S, past+S] bool: query i (key past+i) sees keys max(0, past+i−window+1) … past+i.

    `past` cached window keys of earlier tokens precede the chunk's own (incremental decode).
    """
    i = torch.arange(past, past + seq, device=device)[:, None]
    j = torch.arange(past + seq, device=device)[None, :]
    return (j <= i) & (i - j < window)


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Σ_t e^{s_t}·v_t / (Σ_t e^{s_t} + e^{sink_h}) over allowed slots; keys double as values.

    q: [B,S,H,hd]; keys: [B,K,hd]; allowed: [B,S,K] bool; sink: [H] -> [B,S,H,hd].
    """
    # Scores in fp32 as the release kernel keeps them: a bf16 QK product would round before the softmax.
    logits = torch.einsum("bshd,bkd->bhsk", q.float(), keys.float()) * scale  # [B,H,S,K] fp32
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink_logits = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink_logits], dim=-1), dim=-1)[..., :-1]  # fp32 denominator
    return torch.einsum("bhsk,bkd->bshd", probs.to(q.dtype), keys.to(q.dtype))


class Attention(nn.Module):
    """One block's CSA2 attention; parameter names follow the release (`attn.*`)."""

    def __init__(self, text: TextConfig, plan: LayerPlan, dtype, device) -> None:
        super().__init__()
        self.text, self.plan = text, plan
        d, hd, heads = text.hidden_size, text.head_dim, text.num_attention_heads
        self.heads, self.head_dim, self.window = heads, hd, text.sliding_window
        self.groups = text.o_groups
        self.wq_a = nn.Linear(d, text.q_lora_rank, bias=False, dtype=dtype, device=device)
        self.q_norm = RMSNorm(text.q_lora_rank, text.rms_norm_eps, dtype=dtype, device=device)
        self.wq_b = nn.Linear(text.q_lora_rank, heads * hd, bias=False, dtype=dtype, device=device)
        self.wkv = nn.Linear(d, hd, bias=False, dtype=dtype, device=device)
        self.kv_norm = RMSNorm(hd, text.rms_norm_eps, dtype=dtype, device=device)
        self.wo_a = GroupedOutputProjection(self.groups, heads // self.groups * hd, text.o_lora_rank, dtype, device)
        self.wo_b = nn.Linear(self.groups * text.o_lora_rank, d, bias=False, dtype=dtype, device=device)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32, device=device))
        self.compressor = Compressor(text, plan.ratio, dtype, device) if plan.has_compressor else None
        self.indexer = Indexer(text, plan.has_compressor, dtype, device) if plan.has_indexer else None

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """Complex rotations for integer positions with this layer's RoPE base (and YaRN if compressed)."""
        freqs = rope_frequencies(self.text, self.plan.rope_theta, self.plan.yarn)
        return rope_angles(freqs, positions)

    def forward(self, x: torch.Tensor, state: CSA2State,
                cache: CacheStep | None = None) -> tuple[torch.Tensor, CSA2State]:
        """x: [B,S,D] (attn_norm'd) -> (out [B,S,D], state with whatever this layer publishes).

        `cache` (incremental decode): x holds tokens cache.start … start+S−1; earlier tokens' window KV and
        compressed segments come from it, and this chunk's are recorded into it.
        """
        batch, seq, _ = x.shape
        plan = self.plan
        start = cache.start if cache is not None else 0
        rot = self.rotation(torch.arange(start, start + seq, device=x.device))  # [S, rope/2]
        qr = self.q_norm(self.wq_a(x))  # [B,S,q_lora]
        q = apply_rope(self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim)), rot)  # [B,S,H,hd]
        kv = fake_quant_window_kv(apply_rope(self.kv_norm(self.wkv(x)), rot))  # [B,S,hd], key = value
        keys = kv if cache is None else cache.window_keys(plan.layer_id, kv, self.window)  # [B,W+S,hd]
        past = keys.shape[1] - seq
        allowed = window_mask(seq, self.window, x.device, past).expand(batch, seq, past + seq)
        if plan.ratio:
            state = self._csa2(x, qr, rot, state, cache, start)
            compressed = state.compress_kv  # [B,T,hd]
            picked = torch.zeros(batch, seq, compressed.shape[1] + 1, dtype=torch.bool, device=x.device)
            picked.scatter_(-1, state.topk % (compressed.shape[1] + 1), True)  # −1 -> dump slot
            keys = torch.cat([keys, compressed], dim=1)  # [B,W+S+T,hd]
            allowed = torch.cat([allowed, picked[..., :-1]], dim=-1)
        o = sparse_attention(q, keys, allowed, self.attn_sink, self.head_dim**-0.5)  # [B,S,H,hd]
        o = apply_rope(o, rot, inverse=True)
        z = self.wo_a(o.reshape(batch, seq, self.groups, -1))  # [B,S,G·o_lora]
        return self.wo_b(z), state

    def _csa2(self, x, qr, rot, state: CSA2State, cache: CacheStep | None = None, start: int = 0) -> CSA2State:
        plan = self.plan
        if plan.has_compressor:
            past = cache.source(plan.layer_id) if cache is not None else None
            grouped = x if past is None else torch.cat([past.pending, x], dim=1)  # the open group resumes
            first = 0 if past is None else past.groups
            latent = self.compressor(grouped)  # [B,T,hd], unrotated
            group_rot = self.rotation(torch.arange(first, first + latent.shape[1], device=x.device) * plan.ratio)
            index_k = self.indexer.index_keys(latent, group_rot)  # needs the unrotated latent
            compress_kv = fake_quant_compressed_kv(apply_rope(latent, group_rot))
            if cache is not None:
                compress_kv, index_k = cache.keep_source(plan.layer_id, compress_kv, index_k,
                                                         grouped[:, latent.shape[1] * plan.ratio:].clone())
            state = state.publish(compress_kv=compress_kv, index_k=index_k, ratio=plan.ratio, kv_layer=plan.layer_id)
        if state.kv_layer != plan.kv_source:
            raise RuntimeError(f"layer {plan.layer_id}: expected compressed KV of layer {plan.kv_source}, "
                               f"the state holds layer {state.kv_layer}'s")
        if plan.has_indexer:
            scores = self.indexer.scores(qr, x, state.index_k, rot, plan.ratio, start)  # [B,S,T]
            if plan.is_candidate_source:
                pool = self.indexer.candidate_pool(scores, plan.ratio, start)
                state = state.publish(candidates=pool, candidate_layer=plan.layer_id)
            elif plan.uses_candidates:
                scores = scores.masked_fill(~state.candidates, float("-inf"))
            state = state.publish(topk=self.indexer.select(scores, plan.ratio, start), topk_layer=plan.layer_id)
        if state.topk_layer != plan.index_source:
            raise RuntimeError(f"layer {plan.layer_id}: expected top-k of layer {plan.index_source}, "
                               f"the state holds layer {state.topk_layer}'s")
        return state
