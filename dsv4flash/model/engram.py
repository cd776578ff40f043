"""Engram: n-gram hash lookups written into the mHC streams through a gated value (docs/architecture.md §6).

Two pieces, kept apart because they scale differently:

- `EngramHasher` turns token ids into table row ids for *every* Engram layer at once (integer work, no
  parameters; runs once per forward, before the embedding).
- `Engram` is one layer's table + `wkv` projection + gate. `lookup_rows` is the only place that touches the
  table, so a distributed port can swap it for a host-pinned or row-sharded gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsv4flash.config import DSV41FlashConfig

__all__ = ["DEAD", "EngramHasher", "Engram", "EngramTable", "engram_gate", "build_compressed_token_map"]

DEAD = -1  # compressed id of a token that may not take part in an n-gram (image-span positions)

# Literal floor of |dot| before the signed square root (REF `clamp_value`); not an rms eps.
_GATE_CLAMP = 1e-6


def engram_gate(dot: torch.Tensor) -> torch.Tensor:
    """sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)): a signed square root; ±0 gives sigmoid(±1e-3), not 0.5."""
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(_GATE_CLAMP).sqrt(), dot))


class EngramHasher(nn.Module):
    """Row ids of every Engram layer from `input_ids`: rolling XOR n-gram hash, one prime modulus per head.

    Buffers (non-persistent, never in a checkpoint): `primes` [L, n_orders, n_heads], `offsets`
    [L, n_orders*n_heads], `multipliers` [L, max_ngram] and `token_map` [vocab] (raw id -> compressed id).
    The values also live in CPU copies, and are rewritten whenever the module is moved or materialised
    (`.to()`, `.cuda()`, `.to_empty()`), so a model built on the meta device hashes correctly afterwards.
    """

    def __init__(self, cfg: DSV41FlashConfig) -> None:
        super().__init__()
        text = cfg.text
        self.layer_ids = tuple(text.engram_layer_ids)
        self.max_ngram = text.engram_max_ngram_size
        self.n_orders = text.engram_max_ngram_size - 1
        self.n_heads = text.engram_n_heads
        self.vocab_size = text.vocab_size
        self.compressed_vocab_size = text.engram_compressed_vocab_size
        self.raw_pad_id = text.engram_pad_token_id
        layouts = cfg.engram_layouts
        # Explicit CPU device: these copies must hold real values even under `with torch.device("meta")`.
        cpu = torch.device("cpu")
        primes = torch.tensor([lay.primes for lay in layouts], dtype=torch.int64, device=cpu)
        primes = primes.reshape(len(layouts), self.n_orders, self.n_heads)
        offsets = torch.tensor([lay.offsets for lay in layouts], dtype=torch.int64, device=cpu)
        offsets = offsets.reshape(len(layouts), self.n_orders * self.n_heads)
        mults = torch.tensor([lay.multipliers for lay in layouts], dtype=torch.int64, device=cpu)
        mults = mults.reshape(len(layouts), self.max_ngram)
        self._host: dict[str, torch.Tensor] = {"primes": primes, "offsets": offsets, "multipliers": mults}
        # No device argument: the buffers follow the ambient device (meta under `with torch.device("meta")`).
        for name, host in self._host.items():
            self.register_buffer(name, torch.empty(host.shape, dtype=torch.int64), persistent=False)
        self.register_buffer("token_map", None, persistent=False)
        self.pad_id: int | None = None
        if self.compressed_vocab_size == self.vocab_size:
            # No normalisation needed when the hash space is the vocabulary itself (tiny configs).
            self.set_token_map(torch.arange(self.vocab_size, dtype=torch.int64, device=cpu))
        self.reset_buffers()

    # ---- constants ------------------------------------------------------------------------------
    @property
    def has_token_map(self) -> bool:
        """Whether a raw-id -> compressed-id map is attached (always true for identity configs)."""
        return "token_map" in self._host

    def set_token_map(self, token_map: Any) -> None:
        """Attach the compressed-token map (tensor/list of [vocab] ints; see `build_compressed_token_map`)."""
        tmap = torch.as_tensor(token_map, device="cpu")
        if tmap.is_floating_point() or tmap.is_complex() or tmap.dtype == torch.bool:
            raise ValueError(f"Engram token map: expected an integer tensor, got dtype {tmap.dtype}")
        tmap = tmap.to(torch.int64)
        if tmap.ndim != 1 or not 0 < tmap.numel() <= self.vocab_size:
            raise ValueError(f"Engram token map: expected shape [n] with 0 < n <= vocab_size={self.vocab_size}, "
                             f"got {list(tmap.shape)}")
        lo, hi = int(tmap.min()), int(tmap.max())
        if lo < 0 or hi >= self.compressed_vocab_size:
            raise ValueError(f"Engram token map: compressed ids must lie in [0, engram_compressed_vocab_size="
                             f"{self.compressed_vocab_size}), got range [{lo}, {hi}]")
        distinct = int(torch.unique(tmap).numel())
        if distinct != self.compressed_vocab_size:
            # Every hash multiplier is derived from this size: a different map would silently rehash everything.
            raise ValueError(f"Engram token map yields {distinct} distinct compressed ids, but "
                             f"text_config.engram_compressed_vocab_size is {self.compressed_vocab_size}")
        if self.raw_pad_id >= tmap.numel():
            raise ValueError(f"Engram token map has {tmap.numel()} entries; it must cover engram_pad_token_id="
                             f"{self.raw_pad_id}")
        self._host["token_map"] = tmap.clone()
        self.pad_id = int(tmap[self.raw_pad_id])
        self.token_map = torch.empty(tmap.shape, dtype=torch.int64, device=self.primes.device)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Rewrite every buffer from the CPU copies (a no-op on the meta device)."""
        for name, host in self._host.items():
            buf = getattr(self, name)
            if buf is None or buf.is_meta:
                continue
            if buf.shape != host.shape or buf.dtype != host.dtype:
                setattr(self, name, host.to(buf.device))
            else:
                buf.copy_(host)

    def _apply(self, fn, recurse: bool = True):  # noqa: D401 - torch hook
        """Move/materialise buffers as nn.Module does, then restore their exact integer values."""
        out = super()._apply(fn, recurse)
        self.reset_buffers()
        return out

    # ---- hashing --------------------------------------------------------------------------------
    def compressed_ids(self, input_ids: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        """Raw ids [B,S] -> compressed ids [B,S] int64, with DEAD (-1) on image-span positions."""
        if not self.has_token_map:
            raise RuntimeError(
                "EngramHasher has no compressed-token map: engram_compressed_vocab_size="
                f"{self.compressed_vocab_size} differs from vocab_size={self.vocab_size}, so the map must be "
                "attached with set_token_map(build_compressed_token_map(tokenizer)) before the first forward")
        if self.primes.is_meta:
            raise RuntimeError("EngramHasher buffers are on the meta device; move the module to a real device "
                               "(.to()/.to_empty()) before hashing")
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"EngramHasher: input_ids must be int32/int64 [B, S], got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        n_map = self.token_map.numel()
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= n_map):
            raise ValueError(f"EngramHasher: input_ids must lie in [0, {n_map}), got range "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        comp = self.token_map[input_ids.long()]
        if token_types is not None:
            if token_types.shape != input_ids.shape:
                raise ValueError(f"EngramHasher: token_types shape {list(token_types.shape)} != input_ids shape "
                                 f"{list(input_ids.shape)}")
            comp = comp.masked_fill(token_types >= 0, DEAD)
        return comp

    def lookback(self, comp: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Compressed ids [B,S] -> look-back values t_s [B,S,max_ngram] (s = 0 is the token itself).

        Once the look-back crosses the sequence (or packed-segment) start or a DEAD token, that value and
        everything further back is `pad_id`; the DEAD check includes s = 0.
        """
        bsz, seqlen = comp.shape
        pos = torch.arange(seqlen, device=comp.device).expand(bsz, seqlen)
        if position_ids is None:
            seg_start = torch.zeros_like(pos)
        else:
            if position_ids.shape != comp.shape:
                raise ValueError(f"EngramHasher: position_ids shape {list(position_ids.shape)} != input_ids shape "
                                 f"{list(comp.shape)}")
            # A position that does not increase starts a new packed document.
            new_doc = torch.ones_like(pos, dtype=torch.bool)
            new_doc[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
            seg_start = torch.cummax(torch.where(new_doc, pos, torch.zeros_like(pos)), dim=1).values
        values = []
        blocked = torch.zeros_like(comp, dtype=torch.bool)
        for s in range(self.max_ngram):  # loop over look-back distance (4), never over tokens
            src_pos = pos - s
            src = comp.gather(1, src_pos.clamp_min(0))
            blocked = blocked | (src_pos < seg_start) | (src == DEAD)
            values.append(torch.where(blocked, torch.full_like(src, self.pad_id), src))
        return torch.stack(values, dim=-1)  # [B, S, max_ngram]

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor | None = None, *,
                position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """input_ids [B,S] (+ token_types [B,S], TEXT=-1) -> per Engram layer, row ids [B,S,n_orders*n_heads].

        `position_ids` [B,S] (optional) marks packed documents: a non-increasing position starts a new one,
        and no n-gram crosses that boundary. Columns are ordered [order n = 2..max][head].
        """
        comp = self.compressed_ids(input_ids, token_types)  # [B, S]
        tokens = self.lookback(comp, position_ids)  # [B, S, max_ngram]
        out = []
        for layer in range(len(self.layer_ids)):
            # No wrap: t_s < compressed vocab and m_s <= (2^63-1)//compressed vocab, so every product is >= 0.
            prods = tokens * self.multipliers[layer]  # [B, S, max_ngram]
            rolling = prods[..., 0]
            cols = []
            for order in range(self.n_orders):  # the (order+2)-gram folds in look-back order+1
                rolling = torch.bitwise_xor(rolling, prods[..., order + 1])
                cols.append(rolling.unsqueeze(-1) % self.primes[layer, order])  # [B, S, n_heads]
            out.append(torch.cat(cols, dim=-1) + self.offsets[layer])  # [B, S, n_orders*n_heads]
        return out

    def extra_repr(self) -> str:
        """Layers, orders and heads; whether a token map is attached."""
        tmap = "set" if self.has_token_map else "missing"
        return (f"layers={self.layer_ids}, orders=2..{self.max_ngram}, heads={self.n_heads}, "
                f"compressed_vocab={self.compressed_vocab_size}, token_map={tmap}")


class EngramTable(nn.Module):
    """One layer's prime-bucketed table `weight` [rows, head_dim] (the release stores it FP8 + per-row E8M0)."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype, device=device))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [...] -> rows [..., head_dim]."""
        return F.embedding(row_ids, self.weight)

    def extra_repr(self) -> str:
        """Table shape."""
        return f"rows={self.weight.shape[0]}, dim={self.weight.shape[1]}"


class Engram(nn.Module):
    """One Engram layer: table rows -> `wkv` -> per-stream keys + one shared value, added through a gate.

    Parameters (release names): `embed.weight` [rows, head_dim], `wkv.weight` [(hc+1)*D, n_cols*head_dim]
    (rows: hc keys of D, stream-major, then the value), `q_weight` and `k_weight` [hc, D].

    Fresh init (the release ships no init code; these follow the NeMo V4.1 port): table and `wkv` ~
    N(0, initializer_range), `q_weight` = `k_weight` = 1. With 0.02 the looked-up value starts at ≈ 1.6 × 0.02
    per lane, comparable to the token embedding, so a fresh Engram perturbs but does not dominate the stream.
    """

    def __init__(self, cfg: DSV41FlashConfig, engram_index: int, dtype: torch.dtype = torch.float32,
                 device=None) -> None:
        super().__init__()
        text = cfg.text
        if not 0 <= engram_index < len(text.engram_layer_ids):
            raise ValueError(f"Engram: engram_index {engram_index} outside [0, {len(text.engram_layer_ids)}) "
                             f"(text_config.engram_layer_ids={list(text.engram_layer_ids)})")
        self.engram_index = engram_index
        self.layer_id = text.engram_layer_ids[engram_index]
        self.dim = text.hidden_size
        self.hc_mult = text.hc_mult
        self.n_cols = (text.engram_max_ngram_size - 1) * text.engram_n_heads
        self.head_dim = text.engram_head_dim
        self.num_rows = text.engram_num_embeddings[engram_index]
        self.eps = text.rms_norm_eps
        self.init_std = text.initializer_range
        self.embed = EngramTable(self.num_rows, self.head_dim, dtype, device)
        self.wkv = nn.Linear(self.n_cols * self.head_dim, (self.hc_mult + 1) * self.dim, bias=False,
                             dtype=dtype, device=device)
        self.q_weight = nn.Parameter(torch.empty(self.hc_mult, self.dim, dtype=dtype, device=device))
        self.k_weight = nn.Parameter(torch.empty(self.hc_mult, self.dim, dtype=dtype, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh init: table and wkv ~ N(0, initializer_range); q/k weights 1 (no-op on the meta device)."""
        nn.init.normal_(self.embed.weight, mean=0.0, std=self.init_std)
        nn.init.normal_(self.wkv.weight, mean=0.0, std=self.init_std)
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)

    def lookup_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [B,S,n_cols] int -> table rows [B,S,n_cols,head_dim] (the one table access)."""
        if row_ids.numel() and not row_ids.is_meta:
            lo, hi = int(row_ids.min()), int(row_ids.max())
            if lo < 0 or hi >= self.num_rows:
                raise ValueError(f"Engram layer {self.layer_id}: row ids must lie in [0, {self.num_rows}), "
                                 f"got range [{lo}, {hi}]")
        return self.embed(row_ids)

    def forward(self, x: torch.Tensor, row_ids: torch.Tensor, token_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [B,S,hc,D], row_ids [B,S,n_cols], token_mask [B,S] bool (False: no delta) -> [B,S,hc,D]."""
        bsz, seqlen = x.shape[:2]
        if x.ndim != 4 or tuple(x.shape[2:]) != (self.hc_mult, self.dim):
            raise ValueError(f"Engram layer {self.layer_id}: x must be [B, S, {self.hc_mult}, {self.dim}], "
                             f"got {list(x.shape)}")
        if tuple(row_ids.shape) != (bsz, seqlen, self.n_cols):
            raise ValueError(f"Engram layer {self.layer_id}: row_ids must be [{bsz}, {seqlen}, {self.n_cols}], "
                             f"got {list(row_ids.shape)}")
        if token_mask is not None and (tuple(token_mask.shape) != (bsz, seqlen) or token_mask.dtype != torch.bool):
            raise ValueError(f"Engram layer {self.layer_id}: token_mask must be bool [{bsz}, {seqlen}], got "
                             f"{token_mask.dtype} {list(token_mask.shape)}")
        rows = self.lookup_rows(row_ids)  # [B, S, n_cols, head_dim]
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # [B, S, (hc+1)*D]
        keys, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        k = keys.float().unflatten(-1, (self.hc_mult, self.dim))  # [B, S, hc, D]
        w = self.q_weight.float() * self.k_weight.float()  # [hc, D]; only the product is ever used
        h = x.float()
        # Normalised per (token, stream) over D, not jointly over the streams.
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(k.square().mean(-1) + self.eps)
        dot = (h * w * k).sum(-1) * rstd * self.dim ** -0.5  # [B, S, hc]
        gate = engram_gate(dot)  # [B, S, hc]
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0.0)
        out = h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)  # same value into every stream
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        """Layer id and sizes."""
        return (f"layer={self.layer_id}, rows={self.num_rows}, cols={self.n_cols}x{self.head_dim}, "
                f"hc={self.hc_mult}, dim={self.dim}")


def build_compressed_token_map(tokenizer: Any) -> torch.Tensor:
    """Raw id -> compressed id [len(tokenizer)] int64, normalising each decoded token as REF-ENG does (§6).

    `tokenizer` is a Hugging Face fast tokenizer (or a `tokenizers.Tokenizer`). Ids whose normalised text
    is equal share a compressed id, numbered in order of first appearance.
    """
    from tokenizers import Regex, Tokenizer, normalizers  # lazy: only needed with a real tokenizer

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"build_compressed_token_map: need a fast (Rust-backed) tokenizer, got "
                        f"{type(tokenizer).__name__}")
    size = len(tokenizer) if not isinstance(tokenizer, Tokenizer) else tokenizer.get_vocab_size(with_added_tokens=True)
    # A private-use sentinel keeps a token that is exactly one space from stripping to "" and merging
    # with unrelated empty-normalising tokens.
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(),
        normalizers.Replace(sentinel, " "),
    ])
    ids: dict[str, int] = {}
    out = torch.empty(size, dtype=torch.int64)
    for token_id in range(size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte: key it by its raw token string
            key = backend.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out[token_id] = ids.setdefault(key, len(ids))
    return out

