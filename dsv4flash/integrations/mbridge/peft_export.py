"""Adapters of a Megatron model -> a PEFT directory in `dsv4flash.lora.peft_io`'s (default: `peft`) layout.

`save_peft_adapter(model, directory)` streams the unmerged adapters through `DSV41Bridge` (release names,
tensor-parallel shards gathered), packs per-expert factors into the stacked layout ([E, r, in] / [E, out, r]),
derives the `LoraConfig` placement they form, and checks every tensor against that placement applied to
the reference model on the meta device — so `dsv4flash.lora.load_peft_adapter(reference_model, directory)`
loads the result strictly, and stock PEFT / vLLM load it too (`dsv4flash.lora.layouts` does the layout).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import torch

from dsv4flash.lora.config import LoraConfig

__all__ = ["save_peft_adapter", "collect_adapters", "adapter_placement"]

_EXPERT = re.compile(r"^(?P<moe>.+\.ffn)\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.lora_(?P<f>[AB])\.weight$")
_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.")


def collect_adapters(bridge, megatron_model) -> tuple[dict[str, torch.Tensor], int, float, str]:
    """Canonical adapter key -> tensor (experts packed), plus the rank, alpha and `wo_a` mode they share."""
    from dsv4flash.integrations.mbridge.grouped_lora import GroupedLoRAProjection

    models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
    ranks, alphas, modes = set(), set(), set()
    for model in models:
        for module in model.modules():
            adapter = getattr(module, "adapter", None)
            if adapter is not None and hasattr(adapter, "alpha") and hasattr(adapter, "rank" if isinstance(
                    module, GroupedLoRAProjection) else "dim"):  # Megatron-Bridge's adapters call the rank `dim`
                ranks.add(int(adapter.rank if isinstance(module, GroupedLoRAProjection) else adapter.dim))
                alphas.add(float(adapter.alpha))
            if isinstance(module, GroupedLoRAProjection):
                modes.add(module.adapter.mode)
    if not ranks:
        raise ValueError("save_peft_adapter: the Megatron model carries no LoRA adapters")
    if len(ranks) > 1 or len(alphas) > 1 or len(modes) > 1:
        raise ValueError(f"save_peft_adapter: one rank/alpha/wo_a mode per adapter set is supported, found ranks "
                         f"{sorted(ranks)}, alphas {sorted(alphas)}, wo_a modes {sorted(modes)}")
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in bridge.stream_adapter_weights_megatron_to_hf(models, cpu=True, show_progress=False):
        hit = _EXPERT.match(name)
        if hit:
            experts[(hit["moe"], hit["w"], hit["f"])][int(hit["e"])] = tensor
        elif name in tensors:
            raise ValueError(f"save_peft_adapter: adapter tensor {name} exported twice")
        else:
            tensors[name] = tensor
    for (moe, w, f), by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"save_peft_adapter: {moe}.experts.*.{w} has adapters on experts {sorted(by_expert)}; "
                             "the packed layout needs every expert of the layer")
        tensors[f"{moe}.experts.{w}.lora_{f}.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors, ranks.pop(), alphas.pop(), (modes.pop() if modes else "per_group")


def _kind(module: str) -> tuple[str, str | None]:
    """`layers.3.ffn.experts.w1` -> (`layers.*.ffn.experts.*.w1`, "3"); the layer index becomes a wildcard."""
    module = re.sub(r"\.experts\.(\d+\.)?(w[123])$", r".experts.*.\2", module)
    hit = _LAYER.match(module)
    return (_LAYER.sub(r"\1.*.", module, count=1), hit[2]) if hit else (module, None)


def _placement(keys, reference) -> list[str]:
    """Include rules selecting exactly the adapted modules: a module kind adapted in every layer that has it is
    one `layers.*` rule, otherwise one rule per adapted layer."""
    present: dict[str, set] = defaultdict(set)
    for name, _ in reference.named_modules():
        kind, layer = _kind(name)
        present[kind].add(layer)
    adapted: dict[str, set] = defaultdict(set)
    for key in keys:
        kind, layer = _kind(re.sub(r"\.lora_[AB]\.weight$", "", key))
        adapted[kind].add(layer)
    rules = []
    for kind, layers in sorted(adapted.items()):
        if None in layers or layers == present[kind]:
            rules.append(kind)
        else:
            rules.extend(kind.replace(".*.", f".{layer}.", 1) for layer in sorted(layers, key=int))
    return rules


def adapter_placement(tensors: dict[str, torch.Tensor], cfg, *, rank: int, alpha: float, wo_a_lora: str):
    """The `LoraConfig` that canonical adapter `tensors` form on the reference model of `cfg`, checked tensor by
    tensor -> (LoraConfig, the meta-device reference model with it applied, its LoraHandle)."""
    from dsv4flash.lora.apply import apply_lora
    from dsv4flash.lora.state import lora_parameters
    from dsv4flash.model.transformer import Transformer

    reference = Transformer(cfg, device="meta", seed=None)
    lora_cfg = LoraConfig(preset="custom", include=_placement(tensors, reference), rank=rank, alpha=alpha,
                          wo_a_lora=wo_a_lora, vit="frozen", layers="all", freeze_kv_write=False)
    handle = apply_lora(reference, lora_cfg)
    expected = {k: tuple(p.shape) for k, p in lora_parameters(reference).items()}
    got = {k: tuple(t.shape) for k, t in tensors.items()}
    if expected != got:
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
        raise ValueError(f"adapter tensors do not form a reference placement: missing {missing[:3]}, unexpected "
                         f"{extra[:3]}, wrong shape {[(k, got[k], expected[k]) for k in wrong[:3]]}")
    return lora_cfg, reference, handle


def save_peft_adapter(megatron_model, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                      overwrite: bool = False) -> Path:
    """Write the Megatron model's adapters as a PEFT directory loadable by `dsv4flash.lora.load_peft_adapter`."""
    from dsv4flash.integrations.mbridge import register
    from dsv4flash.lora.peft_io import model_adapter_files, write_adapter_dir

    bridge = register()()
    models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
    tensors, rank, alpha, mode = collect_adapters(bridge, models)
    try:
        _, reference, handle = adapter_placement(tensors, models[0].config.dsv4, rank=rank, alpha=alpha,
                                                 wo_a_lora=mode)
    except ValueError as exc:
        raise ValueError(f"save_peft_adapter: exported {exc}") from None
    config, files = model_adapter_files(reference, handle, tensors, base_model_name_or_path)
    return write_adapter_dir(Path(directory), config, files, overwrite=overwrite, what="peft export")
