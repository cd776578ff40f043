# Copyright (c) 2026, NVIDIA CORPORATION. All rights reserved.

"""CSA2: sliding-window attention with a sink plus compressed keys picked by a lightning indexer.

Every layer attends to its own sliding window of keys (keys double as values) and to a per-head
attention sink. Layers listed in ``csa2_layer_pattern`` add compressed keys:

* ``F`` (full): a compressor pools every ``ratio`` consecutive tokens into one compressed key
  (channel-wise softmax gate); the indexer scores the compressed keys for every query and picks the
  top-k visible ones. The layer publishes the compressed keys, index keys and its top-k;
* ``P`` (pool): re-runs the indexer query on the published keys and also publishes a hierarchical
  candidate pool (the best ``csa2_candidate_topk_blocks`` blocks of ``csa2_candidate_block_size``
  entries, the newest visible block always kept);
* ``C`` (compress and pool): an ``F`` layer that also publishes the candidate pool of its own
  scores, as ``P`` does; its own top-k still picks among all visible compressed keys;
* ``I`` (reindex): re-runs the indexer query, restricted to the published pool when there is one;
* ``R`` (reuse): attends to the top-k published below without an indexer of its own;
* ``S``: sliding window only.

Layers that read compressed keys rotate with ``csa2_compressed_rope_theta`` and, when
``csa2_yarn_factor`` is not 1, YaRN-interpolated frequencies (frequencies only: the attention scale
is unchanged); window-only layers use plain RoPE with ``csa2_rope_theta``.

What one layer publishes for the next ones, ``(compressed_kv, index_keys, topk, candidates)``, is an
explicit layer state returned next to the output, so it travels through full recompute as checkpoint
inputs and outputs, and a full layer's compressor is trained by every later layer that reads it. The
output goes through a grouped low-rank projection (one [rank, heads_per_group * head_dim] block per
head group) and a row-parallel projection back to the hidden size.

Tensor parallelism splits query heads, the sink and whole output groups; the latent side (window keys,
compressor, indexer) is replicated. Activations are [s, b, h] at the module boundary.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_find_correction_range,
    _yarn_linear_ramp_mask,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.experimental_attention_variant.csa2_layout import (
    CSA2GroupTable,
    CSA2TokenLayout,
)
from megatron.core.transformer.hyper_connection import HyperConnectionTransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import divide

LAYER_KINDS = "SFCPIR"

# (compressed_kv [b, T, d], index_keys [b, T, d_index], topk [b, s, k], candidates [b, s, T])
CSA2LayerState = Tuple[Optional[torch.Tensor], ...]


@dataclass
class CSA2TransformerConfig(HyperConnectionTransformerConfig):
    """HyperConnectionTransformerConfig with the CSA2 attention options (head_dim is kv_channels)."""

    csa2_layer_pattern: str = ""
    """One character per layer: S (window only), F (full), C (compress and pool), P (pool),
    I (reindex), R (reuse)."""

    csa2_compress_ratios: List[int] = field(default_factory=list)
    """Compress ratio of each layer; only entries of F and C layers are read (default: 4 for all)."""

    csa2_q_lora_rank: int = 64
    """Rank of the low-rank query projection (also the indexer query input)."""

    csa2_rope_dim: int = 16
    """Rotary lanes at the end of each head (interleaved pairs)."""

    csa2_rope_theta: float = 10000.0
    """RoPE base of window-only layers."""

    csa2_compressed_rope_theta: float = 160000.0
    """RoPE base of layers that read compressed keys."""

    csa2_yarn_factor: float = 1.0
    """YaRN frequency scale of layers that read compressed keys (1.0 = plain RoPE)."""

    csa2_yarn_original_max_position_embeddings: int = 0
    """Context length the RoPE was trained at before YaRN (required when csa2_yarn_factor != 1)."""

    csa2_yarn_beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept (extrapolated)."""

    csa2_yarn_beta_slow: float = 1.0
    """Rotations over the original context below which a frequency is divided by the factor."""

    csa2_sliding_window: int = 128
    """Keys each query sees in its window (itself included)."""

    csa2_output_groups: int = 8
    """Head groups of the grouped low-rank output projection."""

    csa2_output_rank: int = 64
    """Rank of each output group."""

    csa2_index_heads: int = 4
    csa2_index_head_dim: int = 32
    csa2_index_topk: int = 16
    """Compressed keys each query attends to."""

    csa2_candidate_block_size: int = 8
    csa2_candidate_topk_blocks: int = 4

    def __post_init__(self):
        super().__post_init__()
        pattern = self.csa2_layer_pattern
        if len(pattern) != self.num_layers or set(pattern) - set(LAYER_KINDS):
            raise ValueError(
                f"csa2_layer_pattern must have one of {LAYER_KINDS!r} per layer "
                f"({self.num_layers}), got {pattern!r}"
            )
        if not self.csa2_compress_ratios:
            self.csa2_compress_ratios = [4] * self.num_layers
        if len(self.csa2_compress_ratios) != self.num_layers:
            raise ValueError(
                f"csa2_compress_ratios must have one entry per layer ({self.num_layers}), "
                f"got {len(self.csa2_compress_ratios)}"
            )
        if pattern.lstrip("S")[:1] not in ("", "F", "C"):
            raise ValueError(
                f"csa2_layer_pattern {pattern!r}: P/I/R layers need an F or C layer before them"
            )
        for i, kind in enumerate(pattern):
            if kind in "FC" and self.csa2_compress_ratios[i] < 1:
                raise ValueError(f"csa2_compress_ratios[{i}] of {kind} layer must be >= 1")
        if self.csa2_yarn_factor < 1.0:
            raise ValueError(
                f"csa2_yarn_factor must be >= 1 (1 = off), got {self.csa2_yarn_factor}"
            )
        if self.csa2_yarn_factor != 1.0:
            if self.csa2_yarn_original_max_position_embeddings < 1:
                raise ValueError(
                    "csa2_yarn_original_max_position_embeddings must be set (>= 1) when "
                    f"csa2_yarn_factor is {self.csa2_yarn_factor}"
                )
            if not self.csa2_yarn_beta_fast > self.csa2_yarn_beta_slow > 0:
                raise ValueError(
                    "csa2_yarn_beta_fast must exceed csa2_yarn_beta_slow > 0, got "
                    f"{self.csa2_yarn_beta_fast} and {self.csa2_yarn_beta_slow}"
                )
        if self.num_attention_heads % self.csa2_output_groups:
            raise ValueError("num_attention_heads must be a multiple of csa2_output_groups")
        if self.csa2_rope_dim % 2 or self.csa2_rope_dim > min(self.kv_channels, self.csa2_index_head_dim):
            raise ValueError("csa2_rope_dim must be even and fit kv_channels and csa2_index_head_dim")
        if self.csa2_sliding_window < 1:
            raise ValueError("csa2_sliding_window must be at least 1")


@dataclass(frozen=True)
class CSA2LayerRole:
    """What one layer does with compressed keys (derived from the pattern)."""

    kind: str
    ratio: int  # ratio of the compressed keys it reads (0 for S)
    uses_pool: bool  # an I layer after a P or C layer of the same compressed keys


def csa2_layer_role(config: CSA2TransformerConfig, layer_number: int) -> CSA2LayerRole:
    """The role of 1-based ``layer_number`` in ``config.csa2_layer_pattern``."""
    ratio, pooled = 0, False
    for i, kind in enumerate(config.csa2_layer_pattern[:layer_number]):
        earlier = i < layer_number - 1
        if kind in "FC":
            ratio, pooled = config.csa2_compress_ratios[i], kind == "C" and earlier
        elif kind == "P" and earlier:
            pooled = True
    kind = config.csa2_layer_pattern[layer_number - 1]
    return CSA2LayerRole(kind=kind, ratio=ratio if kind != "S" else 0, uses_pool=kind == "I" and pooled)


def rope_frequencies(
    rope_dim: int,
    theta: float,
    yarn_factor: float = 1.0,
    original_max_position_embeddings: int = 0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Angular frequencies [rope_dim / 2] in fp32; YaRN-interpolated when yarn_factor != 1.

    YaRN keeps the frequencies that turn more than beta_fast times over the original context,
    divides those turning fewer than beta_slow times by the factor and ramps linearly in between.
    Only the frequencies change: unlike YarnRotaryEmbedding, no attention-scale factor is applied.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn_factor == 1.0:
        return freqs
    low, high = _yarn_find_correction_range(
        beta_fast, beta_slow, rope_dim, theta, original_max_position_embeddings
    )
    ramp = _yarn_linear_ramp_mask(low, high, rope_dim // 2, device=freqs.device)
    return freqs / yarn_factor * ramp + freqs * (1 - ramp)


def rope_rotation(positions: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """Integer positions [...] -> unit complex rotations [..., rope_dim / 2] (fp32 angles)."""
    angles = positions.float().unsqueeze(-1) * frequencies.to(positions.device)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2 * rotation.shape[-1] lanes of x [b, t, (heads,) d] as complex pairs, in fp32.

    rotation: [b, t, rope_dim / 2] (broadcast over heads).
    """
    rope_dim = rotation.shape[-1] * 2
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = torch.view_as_complex(tail.float().reshape(*tail.shape[:-1], rope_dim // 2, 2))
    rot = rotation.conj() if inverse else rotation
    if x.dim() == 4:
        rot = rot.unsqueeze(-2)
    rotated = torch.view_as_real(pairs * rot).reshape(tail.shape).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)


def sparse_attention_with_sink(
    query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """sum_t e^{s_t} v_t / (sum_t e^{s_t} + e^{sink_h}) over allowed keys; keys double as values.

    query [b, s, H, d], keys [b, K, d], allowed [b, s, K] bool, sink [H] -> [b, s, H, d].
    """
    # fp32 scores: a bf16 product would round before the softmax.
    logits = torch.einsum("bshd,bkd->bhsk", query.float(), keys.float()) * scale  # [b, H, s, K]
    logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink_logits = sink.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink_logits], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhsk,bkd->bshd", probs.to(query.dtype), keys.to(query.dtype))


def topk_lowest_first(scores: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim; ties go to the lower index.

    Exact ties are common (ReLU'd index scores are often 0), so the order must not depend on a kernel.
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def _linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


def _build_linear(spec, in_features: int, out_features: int, config, parallel_mode: str):
    """A bias-free Megatron linear: 'column' (output split), 'row' (input split), 'replicated'."""
    common = dict(config=config, bias=False, skip_bias_add=False, is_expert=False)
    if parallel_mode == "row":
        return build_module(
            spec,
            in_features,
            out_features,
            init_method=config.output_layer_init_method,
            input_is_parallel=True,
            **common,
        )
    return build_module(
        spec,
        in_features,
        out_features,
        init_method=config.init_method,
        gather_output=parallel_mode == "replicated",
        **common,
    )


@dataclass
class CSA2CompressorSubmodules:
    """Replicated linear (values and gate) and the norm of the compressor."""

    linear: Union[ModuleSpec, type] = None
    norm: Union[ModuleSpec, type] = None


class CSA2Compressor(MegatronModule):
    """Pools every ``ratio`` consecutive tokens into one compressed key (channel-wise softmax gate).

    Ratio 1 is a plain projection and norm (no gate).
    """

    def __init__(self, config: CSA2TransformerConfig, submodules: CSA2CompressorSubmodules, ratio: int):
        super().__init__(config)
        self.ratio = ratio
        d = config.kv_channels
        self.linear_kv = _build_linear(submodules.linear, config.hidden_size, d, config, "replicated")
        self.linear_gate = (
            _build_linear(submodules.linear, config.hidden_size, d, config, "replicated")
            if ratio > 1
            else None
        )
        self.norm = build_module(
            submodules.norm, config=config, hidden_size=d, eps=config.layernorm_epsilon
        )

    def forward(self, x: torch.Tensor, layout: CSA2TokenLayout, table: CSA2GroupTable) -> torch.Tensor:
        """x [b, s, h] local tokens -> latents [b, N, d] of the groups this rank owns (unrotated)."""
        # Per-token projections first: a group may start on the extended axis (tokens of another rank).
        values = layout.extend(_linear(self.linear_kv, x))  # [b, E, d]
        b, n, r = table.members.shape
        index = table.members.reshape(b, n * r, 1).expand(-1, -1, values.shape[-1])
        grouped = values.gather(1, index).view(b, n, r, -1)  # [b, N, r, d]
        if self.linear_gate is None:
            return self.norm(grouped[:, :, -1])
        gates = layout.extend(_linear(self.linear_gate, x)).gather(1, index).view(b, n, r, -1)
        pooled = (torch.softmax(gates.float(), dim=2) * grouped.float()).sum(dim=2)
        return self.norm(pooled.to(x.dtype))


@dataclass
class CSA2IndexerSubmodules:
    """Replicated linear and the norm of the indexer."""

    linear: Union[ModuleSpec, type] = None
    norm: Union[ModuleSpec, type] = None


class CSA2Indexer(MegatronModule):
    """Lightning indexer: score_t = sum_h w_h * ReLU(q_h . k_t), then top-k (and the candidate pool).

    The selection is discrete, so the indexer receives no gradient from the language-model loss.
    Only F and C layers own the index-key projection.
    """

    def __init__(self, config: CSA2TransformerConfig, submodules: CSA2IndexerSubmodules, owns_keys: bool):
        super().__init__(config)
        self.heads, self.head_dim = config.csa2_index_heads, config.csa2_index_head_dim
        self.weight_scale = self.head_dim**-0.5 * self.heads**-0.5
        linear = submodules.linear
        self.linear_q = _build_linear(
            linear, config.csa2_q_lora_rank, self.heads * self.head_dim, config, "replicated"
        )
        self.linear_weights = _build_linear(linear, config.hidden_size, self.heads, config, "replicated")
        self.linear_k = self.k_layernorm = None
        if owns_keys:
            self.linear_k = _build_linear(linear, config.kv_channels, self.head_dim, config, "replicated")
            self.k_layernorm = build_module(
                submodules.norm, config=config, hidden_size=self.head_dim, eps=config.layernorm_epsilon
            )

    def index_keys(self, latents: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """latents [b, T, d] -> index keys [b, T, d_index] at the groups' positions."""
        return apply_rope(self.k_layernorm(_linear(self.linear_k, latents)), rotation)

    def scores(
        self,
        q_latent: torch.Tensor,
        x: torch.Tensor,
        index_keys: torch.Tensor,
        rotation: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """q_latent [b, s, q_lora], x [b, s, h], index_keys [b, T, d_index] -> scores [b, s, T].

        -inf where ``visible`` [b, s, T] is False.
        """
        q = _linear(self.linear_q, q_latent).unflatten(-1, (self.heads, self.head_dim))
        q = apply_rope(q, rotation)  # [b, s, heads, d_index]
        weights = _linear(self.linear_weights, x) * self.weight_scale  # [b, s, heads]
        dots = torch.relu(torch.einsum("bshd,btd->bsht", q, index_keys.to(q.dtype)))
        scores = (dots * weights.unsqueeze(-1)).sum(dim=2)
        return scores.masked_fill(~visible, float("-inf"))

    @torch.no_grad()
    def candidate_pool(self, scores: torch.Tensor, table: CSA2GroupTable) -> torch.Tensor:
        """scores [b, s, T] -> candidates [b, s, T] bool, blocks counted from each sequence's start.

        The best blocks by their max score, the newest visible block always included.
        """
        bs, top = self.config.csa2_candidate_block_size, self.config.csa2_candidate_topk_blocks
        cols = table.own_columns()  # [b, s, W]
        width = cols.shape[-1]
        own = scores.gather(-1, cols).masked_fill(~table.own_valid(width), float("-inf"))
        n_blocks = -(-width // bs)
        padded = own.new_full((*own.shape[:-1], n_blocks * bs), float("-inf"))
        padded[..., :width] = own
        block_scores = padded.unflatten(-1, (n_blocks, bs)).amax(-1)  # [b, s, blocks]
        reach = table.q_reach
        newest = (reach - 1).clamp(min=0) // bs
        blocks = torch.arange(n_blocks, device=scores.device)
        pin = (blocks == newest.unsqueeze(-1)) & (reach.unsqueeze(-1) > 0)
        block_scores = block_scores.masked_fill(pin, float("inf"))
        values, indices = topk_lowest_first(block_scores, min(top, n_blocks))
        chosen = torch.zeros_like(block_scores, dtype=torch.bool)
        chosen.scatter_(-1, indices, values > float("-inf"))
        chosen = chosen.repeat_interleave(bs, dim=-1)[..., :width] & table.own_valid(width)
        out = torch.zeros(scores.shape, dtype=torch.int8, device=scores.device)
        return out.scatter_add(-1, cols, chosen.to(torch.int8)) > 0

    @torch.no_grad()
    def select(self, scores: torch.Tensor, table: CSA2GroupTable) -> torch.Tensor:
        """scores [b, s, T] -> top-k row entries [b, s, k] sorted, -1 where unused.

        Selected among each query's own sequence entries, so packing does not change the choice.
        """
        cols = table.own_columns()  # [b, s, W]
        width = cols.shape[-1]
        own = scores.gather(-1, cols).masked_fill(~table.own_valid(width), float("-inf"))
        k = min(self.config.csa2_index_topk, width)
        values, indices = topk_lowest_first(own, k)
        picked = (indices + table.q_base.unsqueeze(-1)).masked_fill(values == float("-inf"), -1)
        unused = table.num_entries  # sorts after every entry
        picked = picked.masked_fill(picked < 0, unused).sort(dim=-1).values
        return picked.masked_fill(picked == unused, -1)


@dataclass
class CSA2SelfAttentionSubmodules:
    """Linears, norm, and the compressor / indexer specs of CSA2 attention."""

    linear_q_down: Union[ModuleSpec, type] = None
    linear_q_up: Union[ModuleSpec, type] = None
    linear_kv: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    norm: Union[ModuleSpec, type] = None
    compressor: Union[ModuleSpec, type] = None
    indexer: Union[ModuleSpec, type] = None


class GroupedLowRankProjection(MegatronModule):
    """z_g = W_g o_g per head group: weight [groups * rank, heads_per_group * head_dim], group-major.

    Tensor parallelism gives each rank whole groups (partition dim 0), like the head split.
    """

    def __init__(self, config: CSA2TransformerConfig, in_per_group: int):
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        self.groups = divide(config.csa2_output_groups, tp)
        self.rank, self.in_per_group = config.csa2_output_rank, in_per_group
        self.weight = torch.nn.Parameter(
            torch.empty(self.groups * self.rank, in_per_group, dtype=config.params_dtype)
        )
        setattr(self.weight, "tensor_model_parallel", True)
        setattr(self.weight, "partition_dim", 0)
        setattr(self.weight, "partition_stride", 1)
        if config.perform_initialization:
            config.init_method(self.weight)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o [b, s, groups, in_per_group] -> [b, s, groups * rank]."""
        w = self.weight.view(self.groups, self.rank, self.in_per_group)
        return torch.einsum("bsgd,grd->bsgr", o, w.to(o.dtype)).flatten(-2)


class CSA2SelfAttention(MegatronModule):
    """CSA2 attention of one layer (see the module docstring).

    ``forward(hidden_states, layer_state, ...) -> (output, layer_state)`` with hidden_states and output
    [s, b, h] and layer_state the ``CSA2LayerState`` tuple (empty before the first F or C layer).
    """

    carries_layer_state = True

    def __init__(
        self,
        config: CSA2TransformerConfig,
        submodules: CSA2SelfAttentionSubmodules,
        layer_number: int,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = pg_collection
        self.layer_number = layer_number
        self.role = csa2_layer_role(config, layer_number)
        tp = config.tensor_model_parallel_size
        heads, d = config.num_attention_heads, config.kv_channels
        self.heads, self.head_dim = divide(heads, tp), d
        self.linear_q_down = _build_linear(
            submodules.linear_q_down, config.hidden_size, config.csa2_q_lora_rank, config, "replicated"
        )
        self.q_layernorm = build_module(
            submodules.norm, config=config, hidden_size=config.csa2_q_lora_rank,
            eps=config.layernorm_epsilon,
        )
        self.linear_q_up = _build_linear(
            submodules.linear_q_up, config.csa2_q_lora_rank, heads * d, config, "column"
        )
        self.linear_kv = _build_linear(submodules.linear_kv, config.hidden_size, d, config, "replicated")
        self.kv_layernorm = build_module(
            submodules.norm, config=config, hidden_size=d, eps=config.layernorm_epsilon
        )
        in_per_group = heads // config.csa2_output_groups * d
        self.linear_o_group_proj = GroupedLowRankProjection(config, in_per_group)
        self.linear_proj = _build_linear(
            submodules.linear_proj,
            config.csa2_output_groups * config.csa2_output_rank,
            config.hidden_size,
            config,
            "row",
        )
        self.attn_sink = torch.nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        setattr(self.attn_sink, "tensor_model_parallel", True)
        setattr(self.attn_sink, "partition_dim", 0)
        setattr(self.attn_sink, "partition_stride", 1)
        kind = self.role.kind
        self.compressor = (
            build_module(submodules.compressor, config=config, ratio=self.role.ratio)
            if kind in "FC"
            else None
        )
        self.indexer = (
            build_module(submodules.indexer, config=config, owns_keys=kind in "FC")
            if kind in "FCPI"
            else None
        )
        self.rope_theta = (
            config.csa2_rope_theta if kind == "S" else config.csa2_compressed_rope_theta
        )
        self.yarn_factor = 1.0 if kind == "S" else config.csa2_yarn_factor

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """Rotations [..., rope_dim / 2] of this layer for integer positions [...]."""
        config = self.config
        frequencies = rope_frequencies(
            config.csa2_rope_dim,
            self.rope_theta,
            self.yarn_factor,
            config.csa2_yarn_original_max_position_embeddings,
            config.csa2_yarn_beta_fast,
            config.csa2_yarn_beta_slow,
        )
        return rope_rotation(positions, frequencies)

    def token_layout(self, hidden_states: torch.Tensor, packed_seq_params=None) -> CSA2TokenLayout:
        """Where the tokens of hidden_states [s, b, h] sit (one whole sequence per row)."""
        if packed_seq_params is not None:
            raise NotImplementedError("CSA2SelfAttention: packed (THD) sequences are not supported yet")
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("CSA2SelfAttention: context parallelism is not supported yet")
        s, b = hidden_states.shape[:2]
        return CSA2TokenLayout.dense(b, s, hidden_states.device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layer_state: CSA2LayerState = (),
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        **kwargs,
    ) -> Tuple[torch.Tensor, CSA2LayerState]:
        """hidden_states [s, b, h] -> (output [s, b, h], layer_state for the next layers).

        Causality comes from the window and the compressed-key visibility; attention_mask is not read.
        """
        layout = self.token_layout(hidden_states, packed_seq_params)
        state = tuple(layer_state) if layer_state else (None, None, None, None)
        x = hidden_states.transpose(0, 1)  # [b, s, h]
        b, s, _ = x.shape
        rot = self.rotation(layout.pos)  # [b, s, rope_dim / 2]
        q_latent = self.q_layernorm(_linear(self.linear_q_down, x))  # [b, s, q_lora]
        q = _linear(self.linear_q_up, q_latent).unflatten(-1, (self.heads, self.head_dim))
        q = apply_rope(q, rot)  # [b, s, heads, d]
        keys = apply_rope(self.kv_layernorm(_linear(self.linear_kv, x)), rot)  # [b, s, d]
        keys = layout.extend(keys)  # [b, E, d]
        allowed = layout.window_mask(self.config.csa2_sliding_window)  # [b, s, E]
        if self.role.kind != "S":
            state = self._compressed_keys(x, q_latent, rot, layout, state)
            compressed, topk = state[0], state[2]  # [b, T, d], [b, s, k]
            total = compressed.shape[1]
            picked = torch.zeros(b, s, total + 1, dtype=torch.bool, device=x.device)
            picked.scatter_(-1, topk % (total + 1), True)  # -1 lands in the dropped last slot
            keys = torch.cat([keys, compressed], dim=1)
            allowed = torch.cat([allowed, picked[..., :-1]], dim=-1)
        if self.config.tensor_model_parallel_size > 1:
            keys = copy_to_tensor_model_parallel_region(keys)  # all heads read them
        o = sparse_attention_with_sink(q, keys, allowed, self.attn_sink, self.head_dim**-0.5)
        o = apply_rope(o, rot, inverse=True)  # values carry the key rotation
        z = self.linear_o_group_proj(o.reshape(b, s, self.linear_o_group_proj.groups, -1))
        out = _linear(self.linear_proj, z)  # [b, s, h]
        return out.transpose(0, 1).contiguous(), state

    def _compressed_keys(self, x, q_latent, rot, layout: CSA2TokenLayout, state) -> CSA2LayerState:
        compressed, index_keys, topk, candidates = state
        table = layout.groups(self.role.ratio)
        if self.role.kind in "FC":
            latents = self.compressor(x, layout, table)  # [b, N, d] owned groups
            group_rot = self.rotation(table.owner_start)  # RoPE at each group's first token
            compressed = layout.publish(apply_rope(latents, group_rot), table)  # [b, T, d]
            # Index keys only feed the discrete top-k: no language-model gradient.
            index_keys = self.indexer.index_keys(latents.detach(), group_rot).detach()
            index_keys = layout.publish(index_keys, table, differentiable=False)
            candidates = None
        elif compressed is None:
            raise RuntimeError(
                f"CSA2 layer {self.layer_number}: no compressed keys in the layer state "
                "(was the state of the previous layers passed on?)"
            )
        if self.indexer is not None:
            scores = self.indexer.scores(q_latent, x, index_keys, rot, table.visible())  # [b, s, T]
            if self.role.kind in "PC":  # the pool's own top-k is not restricted to it
                candidates = self.indexer.candidate_pool(scores, table)
            elif self.role.uses_pool and candidates is not None:
                scores = scores.masked_fill(~candidates, float("-inf"))
            topk = self.indexer.select(scores, table)
        return compressed, index_keys, topk, candidates
