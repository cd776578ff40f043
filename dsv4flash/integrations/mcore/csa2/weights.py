"""Reference (release) parameter names ↔ the Megatron model's names, and loading by name.

The reference model (`dsv4flash.model`) uses the release names (`layers.3.attn.wq_a.weight`); the Megatron
model uses megatron-core's module names (`decoder.layers.3.self_attention.linear_q_down.weight`).
`name_map(cfg)` lists every pair with how the tensor is laid out on a tensor-/expert-parallel rank; the pairs
come from the checkpoint bridge's name table (`dsv4flash_bridge.mapping`), the single truth shared with the
converter's Megatron naming and the Megatron-Bridge registration:

- `copy`: replicated (norms, mHC, router, Engram);
- `rows` / `cols`: split along dim 0 / dim 1 over tensor-parallel ranks (column- / row-parallel linears);
- `glu`: `linear_fc1` = [w1 (gate) ; w3 (up)] (or one stored [gate ; up], the ViT's), each half split
  along dim 0;
- the ViT's fused `wqkv` is reordered per head into [q_h ; k_h ; v_h] (`transform` "qkv"), then split;
- experts are placed on expert-parallel ranks by megatron-core's contiguous expert split.

`load_reference_state(model, state)` fills a Megatron model from a reference state dict and checks that
every Megatron parameter and persistent buffer was written exactly once.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Mapping

import torch

from dsv4flash.config import DSV41FlashConfig

__all__ = ["NamePair", "name_map", "load_reference_state", "shard"]

# State-dict entries with no reference tensor of their own: TE's per-module extra state, and the E8M0 row
# scales a host-pinned FP8 Engram table derives when its values are loaded.
_DERIVED = ("._extra_state", ".engram.embed.scale")


@dataclass(frozen=True)
class NamePair:
    """One Megatron tensor and the reference tensor(s) it is made of."""

    megatron: str
    reference: tuple[str, ...]
    layout: str  # copy | rows | cols | glu
    expert: int | None = None  # global expert id (routed experts only)
    transform: str = "concat"  # concat | qkv (fused [q ; k ; v] reordered per head)


def name_map(cfg: DSV41FlashConfig, parts: tuple[str, ...] = ("text",)) -> list[NamePair]:
    """Every Megatron tensor of the text model (and of the ViT + aligner with `parts=("text", "vision")`) with
    its reference source(s), in model order: the bridge's name table (`dsv4flash_bridge.mapping`, one truth for
    the converter, Megatron-Bridge and this loader) applied to the reference model's tensors."""
    from dsv4flash.release.census import logical_shapes
    from dsv4flash_bridge.mapping import resolve

    return [NamePair(m.megatron, m.reference, m.layout, m.expert, m.transform)
            for m in resolve(logical_shapes(cfg)) if m.part in parts]


def qkv_per_head(fused: torch.Tensor, heads: int) -> torch.Tensor:
    """A fused [q ; k ; v] weight or bias -> Megatron's per-head [q_h ; k_h ; v_h] rows."""
    rest = fused.shape[1:]
    return fused.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(fused.shape)


def shard(tensor: torch.Tensor, layout: str, rank: int, size: int) -> torch.Tensor:
    """This tensor-parallel rank's part of a full tensor (`glu`: pass each half separately)."""
    if layout == "copy" or size == 1:
        return tensor
    dim = 0 if layout in ("rows", "glu") else 1
    if tensor.shape[dim] % size:
        raise ValueError(f"cannot split a {list(tensor.shape)} tensor {size} ways along dim {dim}")
    return tensor.chunk(size, dim=dim)[rank]


def _megatron_name(pair: NamePair, ep_rank: int, local_experts: int, names) -> str | None:
    """The name on this expert-parallel rank (None if the expert lives elsewhere).

    Sequential experts are `experts.local_experts.{e}.linear_fc1.weight`; Transformer Engine grouped-GEMM
    experts (`TEGroupedMLP`) hold the same tensor as `experts.linear_fc1.weight{e}`.
    """
    if pair.expert is None:
        return pair.megatron
    if not ep_rank * local_experts <= pair.expert < (ep_rank + 1) * local_experts:
        return None
    local = pair.expert - ep_rank * local_experts
    sequential = pair.megatron.replace(f"local_experts.{pair.expert}.", f"local_experts.{local}.")
    if sequential in names:
        return sequential
    head, _, tail = pair.megatron.partition(f"local_experts.{pair.expert}.")
    return f"{head}{tail}{local}"


def _first_layer(model: torch.nn.Module) -> int:
    """Global index of the stage's first layer (0 without pipeline parallelism)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _stage_name(name: str, model: torch.nn.Module) -> str | None:
    """A full-stack Megatron name on this pipeline stage (local layer index), or None if it lives elsewhere."""
    layers = model.decoder.layers
    if name.startswith("decoder.layers."):
        index, _, rest = name[len("decoder.layers."):].partition(".")
        local = int(index) - _first_layer(model)
        return f"decoder.layers.{local}.{rest}" if 0 <= local < len(layers) else None
    if name.startswith(("embedding.", "vision_model.", "vision_projection.")) and not getattr(
            model, "pre_process", True):
        return None
    if (name.startswith("output_layer.") or name.startswith("decoder.final_layernorm.")) and not getattr(
            model, "post_process", True):
        return None
    return name


def global_name(name: str, model: torch.nn.Module) -> str:
    """A parameter name of this pipeline stage with the layer index of the whole stack (the names of
    `name_map` and of distributed checkpoints); any prefix before `decoder.layers.` is kept."""
    head, sep, tail = name.partition("decoder.layers.")
    if not sep:
        return name
    index, _, rest = tail.partition(".")
    return f"{head}decoder.layers.{int(index) + _first_layer(model)}.{rest}"


@torch.no_grad()
def load_reference_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, tp_rank: int = 0,
                         tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Copy a reference (release-named) state dict into a `DSV41MegatronModel` on one TP/EP rank and
    pipeline stage (a stage takes its own layers, the first the embedding, the last the norm and head)."""
    cfg = model.config.dsv4
    targets = dict(model.named_parameters())
    targets.update({n: b for n, b in model.named_buffers() if b is not None})
    persistent = set(model.state_dict().keys())
    local_experts = cfg.text.n_routed_experts // ep_size
    written: set[str] = set()
    through_state_dict: dict[str, torch.Tensor] = {}  # tensors held outside parameters()/buffers() (host tables)
    parts = ("text", "vision") if getattr(model, "vision_model", None) is not None else ("text",)
    for pair in name_map(cfg, parts):
        name = _stage_name(pair.megatron, model)
        if name is None:
            continue
        name = _megatron_name(dataclasses.replace(pair, megatron=name), ep_rank, local_experts, targets)
        if name is None:
            continue
        missing = [r for r in pair.reference if r not in state]
        if missing:
            raise KeyError(f"reference state has no `{missing[0]}` (needed for Megatron `{name}`)")
        sources = [state[r] for r in pair.reference]
        if pair.transform == "qkv":
            sources = [qkv_per_head(sources[0], cfg.vision.num_attention_heads)]
        if pair.layout == "glu" and len(sources) == 1:  # one stored [gate ; up]
            sources = list(sources[0].chunk(2, dim=0))
        pieces = [shard(t, pair.layout, tp_rank, tp_size) for t in sources]
        value = torch.cat(pieces, dim=0) if pair.layout == "glu" else pieces[0]
        if name not in targets:
            if name in persistent:  # e.g. a host-pinned Engram table: its own load_state_dict hook copies it
                through_state_dict[name] = value
                written.add(name)
                continue
            raise KeyError(f"Megatron model has no `{name}` (source `{pair.reference[0]}`); was it built from "
                           "the same config?")
        target = targets[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"`{pair.reference[0]}` gives {list(value.shape)} for Megatron `{name}`, which is "
                             f"{list(target.shape)}")
        target.copy_(value.to(dtype=target.dtype, device=target.device))
        written.add(name)
    if through_state_dict:
        result = model.load_state_dict(through_state_dict, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"Megatron model did not accept `{result.unexpected_keys[0]}`")
    left = sorted(n for n in persistent if n not in written and not n.endswith(_DERIVED))
    if left:
        raise KeyError(f"{len(left)} Megatron tensors have no reference source, e.g. `{left[0]}`")
