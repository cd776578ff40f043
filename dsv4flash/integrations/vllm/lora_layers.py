"""vLLM LoRA layer classes for the two V4.1 projections whose kernels read `.weight` directly.

Stock vLLM wraps `attn.wo_a` (a `ColumnParallelLinear` tagged `is_bmm`) and the compressor's
`fused_wkv_wgate` in generic LoRA layers, but the kernels that use them never call the wrapper, so the
adapter silently does nothing (docs/upstream.md §3.2). These classes hold the adapter stacks in the
layout our pure-torch math expects (`dsv4flash.lora.serving`) and expose the delta; the patched call sites
(`patches/grouped_wo_a.py`, `patches/compressor.py`) add it where the base GEMM runs.

Importing this module imports vLLM; `dsv4flash.integrations.vllm.register()` does it lazily.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.lora.layers.column_parallel_linear import ColumnParallelLinearWithLoRA, MergedColumnParallelLinearWithLoRA
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear

from dsv4flash.lora.serving import SlotStacks, compressor_lora_delta, grouped_factors, o_proj_lora_delta, slice_groups

COMPRESSOR_SUFFIX = "compressor.fused_wkv_wgate"


def token_slots(punica_wrapper, tokens: int) -> torch.Tensor:
    """Adapter slot of each of the first `tokens` rows (−1 = base), from the punica wrapper's metadata.

    Reads the preallocated buffer (not the `token_lora_indices` view) so CUDA-graph padded batches index rows
    that exist; padded rows carry stale slots but their outputs are discarded.
    """
    return punica_wrapper._token_lora_indices[:tokens]


class GroupedOutputProjectionWithLoRA(ColumnParallelLinearWithLoRA):
    """LoRA for `attn.wo_a`: block-diagonal per output group, BF16 or FP8 base (the base GEMM is vLLM's own).

    Stacks: `lora_a_stacked[0]` [max_loras, G_local, r, in_g], `lora_b_stacked[0]` [max_loras, 1, G_local·out_g, r]
    (scaling folded in, as vLLM's manager does). Accepts per-group adapters (A [G, r, in_g], B [G, out_g, r]) and
    shared-A ones (A [r, in_g], B [G·out_g, r]); tensor parallelism keeps each rank's own groups.
    """

    grouped_output_projection = True  # what the DSV41-VLLM-002 probe looks for (upstream form has it too)

    def __init__(self, base_layer: ColumnParallelLinear) -> None:
        super().__init__(base_layer)
        self.n_groups = int(base_layer.bmm_batch_size)  # groups on this rank
        if self.output_size % self.n_groups:
            raise ValueError(f"{base_layer.prefix}: {self.output_size} output rows do not split into "
                             f"{self.n_groups} groups")
        self.out_per_group = self.output_size // self.n_groups

    @classmethod
    def can_replace_layer(cls, source_layer: nn.Module, lora_config, packed_modules_list: list,
                          model_config=None) -> bool:
        """Any ColumnParallelLinear vLLM marks as a batched (grouped) GEMM: V4/V4.1 `wo_a`."""
        return type(source_layer) is ColumnParallelLinear and bool(getattr(source_layer, "is_bmm", False))

    def create_lora_weights(self, max_loras: int, lora_config, model_config=None) -> None:
        """Allocate zeroed per-group stacks for `max_loras` slots at `max_lora_rank`."""
        self.lora_config = lora_config
        rank = lora_config.max_lora_rank
        kw = dict(dtype=lora_config.lora_dtype, device=self.device)
        self.lora_a_stacked = (torch.zeros(max_loras, self.n_groups, rank, self.input_size, **kw),)
        self.lora_b_stacked = (torch.zeros(max_loras, 1, self.output_size, rank, **kw),)
        self.output_slices = (self.output_size,)

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """Copy one adapter (either grouped layout, full or already rank-local) into slot `index`."""
        if isinstance(lora_a, (list, tuple)) or isinstance(lora_b, (list, tuple)):
            raise TypeError(f"{self.base_layer.prefix}: wo_a takes one LoRA, not a packed list")
        self.reset_lora(index)
        total = self.n_groups * self.tp_size
        groups = lora_a.shape[0] if lora_a.dim() == 3 else lora_b.shape[0] // self.out_per_group
        if groups not in (total, self.n_groups):
            raise ValueError(f"{self.base_layer.prefix}: LoRA covers {groups} groups, the layer has {total} "
                             f"({self.n_groups} on this rank); A {list(lora_a.shape)}, B {list(lora_b.shape)}")
        a, b = grouped_factors(lora_a, lora_b, groups, self.out_per_group, name=self.base_layer.prefix)
        if groups != self.n_groups:
            a, b = slice_groups(a, b, self.tp_rank, self.tp_size, name=self.base_layer.prefix)
        rank = a.shape[1]
        if rank > self.lora_a_stacked[0].shape[2]:
            raise ValueError(f"{self.base_layer.prefix}: LoRA rank {rank} exceeds max_lora_rank "
                             f"{self.lora_a_stacked[0].shape[2]}")
        self.lora_a_stacked[0][index, :, :rank].copy_(a, non_blocking=True)
        self.lora_b_stacked[0][index, 0, :, :rank].copy_(b.reshape(self.output_size, rank), non_blocking=True)

    def stacks(self) -> SlotStacks:
        """All slots as per-group stacks: A [S, G, r, in_g], B [S, G, out_g, r] (views)."""
        a = self.lora_a_stacked[0]
        b = self.lora_b_stacked[0].view(a.shape[0], self.n_groups, self.out_per_group, a.shape[2])
        return SlotStacks(a, b)

    def lora_delta(self, attn_out: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   n_heads: int) -> torch.Tensor:
        """Delta for `z` of an attention output [T, H_pad, hd] (pre inverse RoPE) -> [T, G·out_g] fp32."""
        slots = token_slots(self.punica_wrapper, attn_out.shape[0])
        return o_proj_lora_delta(attn_out, positions, cos_sin_cache, n_heads, self.n_groups, slots, self.stacks())

    def forward(self, input_):
        """`wo_a` is never called as a module: its GEMM (and the LoRA delta) run in the o-projection."""
        raise RuntimeError(f"{self.base_layer.prefix}: the grouped wo_a projection is applied by the attention "
                           "layer's o-projection (dsv41_o_proj), not by calling the module")


class CompressorProjectionWithLoRA(MergedColumnParallelLinearWithLoRA):
    """LoRA for the compressor's fused `[wkv ‖ wgate]` (ratio 2) or `[wkv]` (ratio 1), fp32 score output.

    Stacks per slice as vLLM's merged-column layer ([max_loras, 1, r, D] / [max_loras, 1, hd, r]); the packed
    adapter list is `[wkv, wgate]` (vLLM's `packed_modules_mapping`), whose `wgate` entry must be absent for
    the gate-less ratio-1 compressor.
    """

    compressor_projection = True  # what the DSV41-VLLM-003 probe looks for (upstream form has it too)

    def __init__(self, base_layer: MergedColumnParallelLinear) -> None:
        ColumnParallelLinearWithLoRA.__init__(self, base_layer)
        self.output_sizes = tuple(base_layer.output_sizes)
        self.output_slices = self.output_sizes  # replicated (disable_tp): nothing to shard
        self.n_slices = len(self.output_slices)
        self.output_ids = (0,) * self.n_slices

    @classmethod
    def can_replace_layer(cls, source_layer: nn.Module, lora_config, packed_modules_list: list,
                          model_config=None) -> bool:
        """The V4/V4.1 compressor projection (by its vLLM prefix), replicated across TP."""
        return (type(source_layer) is MergedColumnParallelLinear
                and getattr(source_layer, "prefix", "").endswith(COMPRESSOR_SUFFIX))

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        """Accept `[wkv, wgate]` packs (a ratio-1 compressor has no gate, so its `wgate` entry must be None)."""
        if isinstance(lora_b, (list, tuple)) and len(lora_b) != self.n_slices:
            extra = list(lora_b[self.n_slices:])
            if any(t is not None for t in extra):
                raise ValueError(f"{self.base_layer.prefix}: this compressor has {self.n_slices} projection(s) "
                                 "(ratio 1 has no wgate) but the adapter carries a wgate LoRA")
            lora_a, lora_b = list(lora_a[: self.n_slices]), list(lora_b[: self.n_slices])
        elif isinstance(lora_b, torch.Tensor):
            lora_a, lora_b = [lora_a], [lora_b]
        for i, (a_i, b_i) in enumerate(zip(lora_a, lora_b)):
            if b_i is not None and (b_i.shape[0] != self.output_sizes[i] or b_i.shape[1] > self.lora_b_stacked[i].shape[3]):
                raise ValueError(f"{self.base_layer.prefix}: slice {i} LoRA B is {list(b_i.shape)}, expected "
                                 f"[{self.output_sizes[i]}, r <= {self.lora_b_stacked[i].shape[3]}]")
            if a_i is not None and a_i.shape[1] != self.input_size:
                raise ValueError(f"{self.base_layer.prefix}: slice {i} LoRA A is {list(a_i.shape)}, expected "
                                 f"[r, {self.input_size}]")
        super().set_lora(index, list(lora_a), list(lora_b))

    def slice_stacks(self) -> list[SlotStacks]:
        """One `SlotStacks` per output slice: A [S, r, D], B [S, hd, r] (views)."""
        return [SlotStacks(a[:, 0], b[:, 0]) for a, b in zip(self.lora_a_stacked, self.lora_b_stacked)]

    def lora_delta(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Delta of the fp32 `kv_score`: hidden_states [T, D] -> [T, Σ slices] fp32."""
        slots = token_slots(self.punica_wrapper, hidden_states.shape[0])
        return compressor_lora_delta(hidden_states, slots, self.slice_stacks(), self.output_slices)

    def forward(self, input_):
        """Module call (not used by V4.1's raw GEMM path): base output plus the delta, in the base dtype."""
        output = self.base_layer.quant_method.apply(self.base_layer, input_, None)
        return output + self.lora_delta(input_.reshape(-1, input_.shape[-1])).reshape(output.shape).to(output.dtype)


LORA_CLASSES = (GroupedOutputProjectionWithLoRA, CompressorProjectionWithLoRA)
