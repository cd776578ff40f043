# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""DeepSeek-V4.1 Engram: n-gram hash lookups added to the mHC residual streams through a gated value.

``EngramHasher`` turns token ids into table row ids for every Engram layer at once: compressed ids, a look-back
of ``engram_max_ngram_size`` tokens (padded at the sequence start), odd int64 multipliers drawn from
``numpy.random.default_rng(10007 * layer)``, a rolling XOR per n-gram order and one prime modulus per head
(the primes are the smallest unused primes above ``engram_vocab_size - 1``; each (order, head) owns a disjoint
row range). ``Engram`` is one layer's table, ``wkv`` projection and gate; ``EngramHyperConnectionTransformerLayer``
applies it to the streams before the layer's attention site, so it changes that layer's mHC coefficients.
``attach_engram`` installs the hasher on a ``GPTModel``: every forward hashes its ``input_ids`` once and hands
each Engram layer its row ids.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.hyper_connection import (
    HyperConnectionTransformerLayer,
    HyperConnectionTransformerLayerSubmodules,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, int(value**0.5) + 1, 2))


def engram_hash_layout(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int, compressed_vocab_size: int
) -> List[Tuple[List[List[int]], List[int], List[int]]]:
    """Per Engram layer: (primes [orders][heads], row offsets [orders * heads], multipliers [max_ngram_size])."""
    import numpy as np  # the release draws the multipliers from numpy's PCG64 stream

    seen, layouts = set(), []
    bound = ((2**63 - 1) // compressed_vocab_size) // 2  # t * m stays below 2**63: no int64 wrap
    for layer in layer_ids:
        primes = []
        for _order in range(2, max_ngram_size + 1):
            current, heads = vocab_size - 1, []
            for _head in range(n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                heads.append(current)
            primes.append(heads)
        flat = [p for order in primes for p in order]
        offsets = [sum(flat[:i]) for i in range(len(flat))]
        rng = np.random.default_rng(10007 * layer)
        multipliers = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1
        layouts.append((primes, offsets, [int(m) for m in multipliers]))
    return layouts


def engram_gate(dot: torch.Tensor) -> torch.Tensor:
    """sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)): a signed square root (+-0 gives sigmoid(+-1e-3))."""
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))


class EngramHasher(nn.Module):
    """Row ids of every Engram layer from ``input_ids`` [b, s] (integer buffers, no parameters)."""

    def __init__(self, config):
        super().__init__()
        self.max_ngram = config.engram_max_ngram_size
        self.compressed_vocab_size = config.engram_compressed_vocab_size
        self.pad_token_id = config.engram_pad_token_id
        layouts = engram_hash_layout(
            config.engram_layer_ids,
            config.engram_max_ngram_size,
            config.engram_n_heads,
            config.engram_vocab_size,
            config.engram_compressed_vocab_size,
        )
        # Non-persistent: derived from the config, never part of a checkpoint.
        as_long = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        self.register_buffer("primes", as_long([p for p, _, _ in layouts]), persistent=False)  # [L, orders, heads]
        self.register_buffer("offsets", as_long([o for _, o, _ in layouts]), persistent=False)  # [L, orders*heads]
        self.register_buffer("multipliers", as_long([m for _, _, m in layouts]), persistent=False)  # [L, ngram]
        self.register_buffer("token_map", None, persistent=False)
        if config.engram_compressed_vocab_size == config.vocab_size:  # the hash space is the vocabulary
            self.set_token_map(torch.arange(config.vocab_size))

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """Attach the raw id -> compressed id map [vocab] (the release normalises decoded tokens)."""
        token_map = torch.as_tensor(token_map).to(torch.int64)
        distinct = int(torch.unique(token_map).numel())
        if token_map.ndim != 1 or distinct != self.compressed_vocab_size or int(token_map.min()) < 0:
            raise ValueError(
                f"Engram token map: expected [vocab] ids 0..{self.compressed_vocab_size - 1} "
                f"(engram_compressed_vocab_size), got shape {list(token_map.shape)} with {distinct} distinct ids"
            )
        self.token_map = token_map.to(self.primes.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        image_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> List[torch.Tensor]:
        """input_ids [b, s] (+ image_mask [b, s]: positions outside n-grams) -> per layer [s, b, orders*heads].

        ``position_ids`` [b, s] marks packed documents: a position that does not increase starts a new one, and
        no n-gram reaches back across it.
        """
        if self.token_map is None:
            raise RuntimeError(
                "EngramHasher has no token map: engram_compressed_vocab_size differs from vocab_size, "
                "attach one with set_token_map()"
            )
        ids = self.token_map[input_ids.long()]  # [b, s]
        pad = self.token_map[self.pad_token_id]
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device).expand(b, s)
        doc_start = torch.zeros_like(pos)
        if position_ids is not None and s > 1:
            new_doc = torch.ones_like(pos, dtype=torch.bool)
            new_doc[:, 1:] = position_ids[:, 1:] <= position_ids[:, :-1]
            doc_start = torch.cummax(torch.where(new_doc, pos, doc_start), dim=1).values
        dead = torch.zeros_like(ids, dtype=torch.bool) if image_mask is None else image_mask.bool()
        blocked = torch.zeros_like(dead)
        lookback = []
        for back in range(self.max_ngram):  # once the look-back crosses a document start or image token: pad
            src = (pos - back).clamp_min(0)
            blocked = blocked | (pos - back < doc_start) | dead.gather(1, src)
            lookback.append(torch.where(blocked, pad, ids.gather(1, src)))
        tokens = torch.stack(lookback, dim=-1)  # [b, s, ngram]
        rows = []
        for layer in range(self.primes.shape[0]):
            products = tokens * self.multipliers[layer]  # [b, s, ngram], non-negative by the bound
            rolling, cols = products[..., 0], []
            for order in range(self.primes.shape[1]):  # the (order + 2)-gram folds in look-back order + 1
                rolling = torch.bitwise_xor(rolling, products[..., order + 1])
                cols.append(rolling.unsqueeze(-1) % self.primes[layer, order])  # [b, s, heads]
            rows.append((torch.cat(cols, dim=-1) + self.offsets[layer]).transpose(0, 1).contiguous())
        return rows


class EngramTable(nn.Module):
    """One layer's prime-bucketed table ``weight`` [rows, engram_head_dim]."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=dtype))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [...] -> rows [..., dim]."""
        return nn.functional.embedding(row_ids, self.weight)


class Engram(MegatronModule):
    """One Engram layer: looked-up rows -> ``wkv`` -> a key per stream and one value, added through a gate.

    Parameters (release names): ``embed.weight`` [rows, head_dim], ``wkv.weight`` [(n + 1) * h, cols * head_dim]
    (n keys of h, stream-major, then the value), ``q_weight`` / ``k_weight`` [n, h]. Replicated on every rank.
    With ``engram_host_resident_table`` the table is megatron-core's ``HostRowLookupTable`` (pinned host memory,
    deduplicated row gather to the device, sparse host gradient, left alone by DDP and ``.cuda()``).
    """

    def __init__(self, config, engram_index: int, **kwargs):
        super().__init__(config=config)
        self.n, self.h = config.hc_mult, config.hidden_size
        self.cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.num_rows = config.engram_num_embeddings[engram_index]
        self.eps = config.layernorm_epsilon
        dtype = config.params_dtype
        if config.engram_host_resident_table:  # ~100 GB per table at release size: pinned host rows
            from megatron.core.models.common.embeddings.host_embedding import HostRowLookupTable

            init = config.init_method if config.perform_initialization else (lambda weight: None)
            self.embed = HostRowLookupTable(self.num_rows, config.engram_head_dim, dtype=dtype, init_method=init)
        else:
            self.embed = EngramTable(self.num_rows, config.engram_head_dim, dtype)
        self.wkv = nn.Linear(self.cols * config.engram_head_dim, (self.n + 1) * self.h, bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(self.n, self.h, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(self.n, self.h, dtype=dtype))
        if config.perform_initialization:
            if not config.engram_host_resident_table:
                config.init_method(self.embed.weight)
            config.init_method(self.wkv.weight)

    def forward(
        self, streams: torch.Tensor, row_ids: torch.Tensor, token_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """streams [s, b, n, h], row_ids [s, b, cols], token_mask [s, b] (False: no delta) -> [s, b, n, h]."""
        if row_ids.numel() and (int(row_ids.min()) < 0 or int(row_ids.max()) >= self.num_rows):
            raise ValueError(f"Engram: row ids must lie in [0, {self.num_rows})")
        rows = self.embed(row_ids)  # [s, b, cols, head_dim], on the device of row_ids
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))  # [s, b, (n + 1) * h]
        keys, value = kv.split([self.n * self.h, self.h], dim=-1)
        k = keys.float().unflatten(-1, (self.n, self.h))  # [s, b, n, h]
        x = streams.float()
        # Normalised per (token, stream) over h; only the product of q_weight and k_weight is used.
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(k.square().mean(-1) + self.eps)
        dot = (x * (self.q_weight.float() * self.k_weight.float()) * k).sum(-1) * rstd * self.h**-0.5
        gate = engram_gate(dot)  # [s, b, n]
        if token_mask is not None:
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0.0)
        return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)  # one value, every stream


@dataclass
class EngramHyperConnectionTransformerLayerSubmodules(HyperConnectionTransformerLayerSubmodules):
    """HyperConnectionTransformerLayerSubmodules plus the layer's Engram lookup."""

    engram: Union[ModuleSpec, type] = Engram


class EngramHyperConnectionTransformerLayer(HyperConnectionTransformerLayer):
    """An mHC layer that first adds its Engram lookup to the streams (row ids set by ``attach_engram``)."""

    def __init__(self, config, submodules: EngramHyperConnectionTransformerLayerSubmodules, layer_number=1, **kw):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kw)
        layer_id = self.layer_number - 1
        if layer_id not in config.engram_layer_ids:
            raise ValueError(f"layer {layer_id} is not in engram_layer_ids {list(config.engram_layer_ids)}")
        self.engram_index = list(config.engram_layer_ids).index(layer_id)
        self.engram = build_module(submodules.engram, config=config, engram_index=self.engram_index)
        self.engram_inputs: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None

    def forward(self, hidden_states, attention_mask=None, context=None, **kwargs):
        """As ``HyperConnectionTransformerLayer.forward``, on the streams after the Engram delta."""
        if self.engram_inputs is None:
            raise RuntimeError(
                f"Engram layer {self.layer_number - 1} has no row ids: build the model with attach_engram and "
                "call it with input_ids"
            )
        row_ids, token_mask = self.engram_inputs
        n = self.config.hc_mult
        if context is None:  # first layer: expand the embedding here, with the stock first-layer pre
            s, b, h = hidden_states.shape
            streams = hidden_states.unsqueeze(2).expand(s, b, n, h)
            pre = torch.zeros(s, b, n, dtype=torch.float32, device=hidden_states.device)
            pre[..., 0] = 1.0
            context = (pre,)
        else:
            s, b, width = hidden_states.shape
            streams = hidden_states.view(s, b, n, width // n)
        streams = self.engram(streams, row_ids, token_mask)
        return super().forward(streams.flatten(2), attention_mask=attention_mask, context=context, **kwargs)


def with_engram_layers(layer_specs: Sequence[ModuleSpec], engram_layer_ids: Sequence[int]) -> List[ModuleSpec]:
    """``layer_specs`` with the Engram layers (0-based ids) built as ``EngramHyperConnectionTransformerLayer``."""
    specs = list(layer_specs)
    for layer_id in engram_layer_ids:
        if not 0 <= layer_id < len(specs):
            raise ValueError(f"engram_layer_ids: layer {layer_id} outside the {len(specs)} decoder layers")
        base = specs[layer_id]
        fields = {k: getattr(base.submodules, k) for k in base.submodules.__dataclass_fields__}
        specs[layer_id] = ModuleSpec(
            module=EngramHyperConnectionTransformerLayer,
            submodules=EngramHyperConnectionTransformerLayerSubmodules(**fields),
        )
    return specs


def attach_engram(model: GPTModel) -> EngramHasher:
    """Give ``model`` an ``engram_hasher``; each forward hashes ``input_ids`` for its Engram layers.

    The forward also takes ``token_types`` [b, s] (``>= 0`` marks image-span tokens, which join no n-gram and
    take no Engram delta); its ``position_ids`` mark packed documents, which no n-gram crosses.
    """
    model.engram_hasher = EngramHasher(model.config)
    layers = [layer for layer in model.decoder.layers if isinstance(layer, EngramHyperConnectionTransformerLayer)]

    def hash_input_ids(module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        position_ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        token_types = kwargs.pop("token_types", None)
        image_mask = None if token_types is None else token_types >= 0
        rows = module.engram_hasher(input_ids, image_mask, position_ids)
        token_mask = None if image_mask is None else ~image_mask.transpose(0, 1)
        for layer in layers:
            layer.engram_inputs = (rows[layer.engram_index], token_mask)
        return args, kwargs

    model.register_forward_pre_hook(hash_input_ids, with_kwargs=True)
    return model.engram_hasher
