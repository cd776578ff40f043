"""Export a packed adapter to the layouts engines load, and import them back (lossless).

* **PEFT / vLLM / Megatron / packed** (`export_peft(adapter, dir, layout=...)`): an adapter directory in one of
  `dsv4flash.lora.layouts`' layouts (`peft`, the default: what stock PEFT and vLLM load, routed experts as
  `base_model.model.layers.{i}.ffn.experts.{e}.{w1|w2|w3}.lora_{A|B}.weight` — vLLM's 2-D MoE LoRA layout,
  what DeepSeek V4/V4.1 load by default, `is_3d_moe_weight=False`); `import_peft` reads any of them.
* **vLLM 3-D** (`export_vllm_3d`): per MoE layer four tensors, PEFT `target_parameters` style:
  `…ffn.experts.base_layer.lora_A/B.weight` (fused gate_up = [w1; w3]) and `…ffn.experts.lora_A/B.weight`
  (down = w2). lora_A is `[E·R, in]` with the expert index slowest, lora_B is `[out, E·R]` with the
  expert index *fastest* (vLLM 0.33 `_convert_3d_to_2d_moe_lora` reshapes B as `[out, R, E]`).
  The fused gate_up shares one A, so separate w1/w3 factors of rank r become one rank-2r factor:
  A = [A1; A3], B = [[B1, 0], [0, B3]] — exact — with `rank_pattern`/`alpha_pattern` on
  `ffn.experts.gate_up_proj` (2r, 2·alpha) so alpha/rank is unchanged. Load it in vLLM with
  `enable_mixed_moe_lora_format=True` and `LoRARequest(..., is_3d_lora_weight=True)`.
Both write into a temp directory, fsync, then rename: a crash leaves the old directory or the new one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from dsv4flash.lifecycle.errors import AdapterFormatError
from dsv4flash.lifecycle.export_formats import FORMATS, VLLM_3D
from dsv4flash.lifecycle.faults import crashpoint
from dsv4flash.lifecycle.packed import EXPERT_PROJECTIONS, PackedMoELoRA
from dsv4flash.lifecycle.safetensors_io import write_safetensors
from dsv4flash.lora.layouts import detect_modes
from dsv4flash.lora.peft_io import (CONFIG_NAME, WEIGHTS_NAME, adapter_files, read_adapter_config, read_adapter_tensors,
                                    read_adapter_weights, write_adapter_dir)
from dsv4flash.lora.state import PEFT_PREFIX

__all__ = ["export_peft", "import_peft", "export_vllm_3d", "import_vllm_3d", "export_adapter_dir", "read_adapter_dir",
           "adapter_source", "recorded_base_config", "FORMATS", "PEFT_PREFIX", "CONFIG_NAME", "WEIGHTS_NAME"]

_GATE_UP, _DOWN = "ffn.experts.gate_up_proj", "ffn.experts.down_proj"


def _write_dir(directory: str | os.PathLike, overwrite: bool, config: dict[str, Any],
               tensors: dict[str, torch.Tensor]) -> Path:
    """peft_io's directory writer with the lifecycle's streaming safetensors writer and its crash points."""
    return write_adapter_dir(directory, config, tensors, overwrite=overwrite, what="export",
                             write_weights=_write_weights, before_rename=lambda: crashpoint("export.before_rename"))


def _write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    half = [False]

    def progress(done: int, _total: int) -> None:
        if not half[0] and done >= size // 2:
            half[0] = True
            crashpoint("export.mid_write")

    with open(path, "wb") as f:
        write_safetensors(f, tensors, {"format": "pt"}, on_progress=progress)


# ---- PEFT / vLLM 2-D / Megatron / packed: the layouts of dsv4flash.lora.layouts ----
def export_peft(adapter: PackedMoELoRA, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                overwrite: bool = False, layout: str = "peft") -> Path:
    """Write `adapter` as an adapter directory in `layout` (default `peft`: per-expert routed LoRA)."""
    config, tensors = adapter_files(adapter.to_packed_tensors(), layout, rank=adapter.rank, alpha=adapter.alpha,
                                  base_model_name_or_path=base_model_name_or_path)
    return _write_dir(directory, overwrite, config, tensors)


def import_peft(directory: str | os.PathLike) -> PackedMoELoRA:
    """Read an adapter directory of any of those layouts back into packed form (bit-exact)."""
    config, canonical = read_adapter_tensors(directory)
    return PackedMoELoRA.from_packed_tensors(canonical, alpha=float(config["lora_alpha"]),
                                             source=str(Path(directory) / WEIGHTS_NAME))


# ---- vLLM 3-D ----
def export_vllm_3d(adapter: PackedMoELoRA, directory: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                   overwrite: bool = False, section: dict[str, Any] | None = None) -> Path:
    """Write vLLM's 3-D fused MoE LoRA directory (gate_up at rank 2r, block-diagonal; down at rank r); `section`
    adds what a source directory recorded (its `lora_config`, base geometry) to the dsv4flash section."""
    r, tensors = adapter.rank, {}
    for layer in adapter.moe_layers():
        missing = [p for p in EXPERT_PROJECTIONS if (layer, p) not in adapter.experts]
        if missing:
            raise AdapterFormatError(f"layer {layer}: the 3-D layout fuses w1/w3 and needs w2 too; this adapter has no {missing} LoRA there")
        (a1, b1), (a2, b2), (a3, b3) = (adapter.experts[(layer, p)] for p in EXPERT_PROJECTIONS)
        e, _, hidden = a1.shape
        inter = b1.shape[1]
        gate_up_a = torch.cat([a1, a3], dim=1)  # [E, 2r, H]
        gate_up_b = torch.zeros(e, 2 * inter, 2 * r, dtype=b1.dtype)  # [E, 2I, 2r], block-diagonal
        gate_up_b[:, :inter, :r] = b1
        gate_up_b[:, inter:, r:] = b3
        stem = f"layers.{layer}.ffn.experts"
        tensors[f"{stem}.base_layer.lora_A.weight"] = gate_up_a.reshape(e * 2 * r, hidden)
        tensors[f"{stem}.base_layer.lora_B.weight"] = gate_up_b.permute(1, 2, 0).reshape(2 * inter, 2 * r * e)  # col = k·E + e
        tensors[f"{stem}.lora_A.weight"] = a2.reshape(e * r, inter)
        tensors[f"{stem}.lora_B.weight"] = b2.permute(1, 2, 0).reshape(hidden, r * e)
    for name, (a, b) in adapter.dense.items():
        tensors[f"{name}.lora_A.weight"] = a
        tensors[f"{name}.lora_B.weight"] = b
    dense = {k: v for k, v in adapter.to_packed_tensors().items() if ".ffn.experts." not in k}
    config, _ = adapter_files(dense, "vllm", rank=r, alpha=adapter.alpha, base_model_name_or_path=base_model_name_or_path)
    ours = config["dsv4flash"]
    config["dsv4flash"] = {"format": ours["format"], "layout": VLLM_3D, "num_experts": adapter.num_experts,
                           "moe_layers": adapter.moe_layers(), "grouped_modules": ours["grouped_modules"], **(section or {})}
    if adapter.experts:
        config["target_parameters"] = [_GATE_UP, _DOWN]
        config["rank_pattern"] = {_GATE_UP: 2 * r}
        config["alpha_pattern"] = {_GATE_UP: 2 * adapter.alpha}
        config["dsv4flash"]["gate_up"] = "block_diagonal_rank_2r"
    return _write_dir(directory, overwrite, config, tensors)


def import_vllm_3d(directory: str | os.PathLike) -> PackedMoELoRA:
    """Read a 3-D fused MoE LoRA directory into packed form (exact for our exports and shared-A adapters)."""
    config, tensors = read_adapter_config(directory), read_adapter_weights(directory)
    weights = Path(directory) / WEIGHTS_NAME
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    gu_rank = int(config.get("rank_pattern", {}).get(_GATE_UP, r))
    gu_alpha = float(config.get("alpha_pattern", {}).get(_GATE_UP, alpha))
    experts, dense = {}, {}
    layers = sorted({int(k.split(".")[1]) for k in tensors if ".ffn.experts.base_layer." in k})
    for layer in layers:
        stem = f"layers.{layer}.ffn.experts"
        try:
            gu_a, gu_b = tensors.pop(f"{stem}.base_layer.lora_A.weight"), tensors.pop(f"{stem}.base_layer.lora_B.weight")
            dn_a, dn_b = tensors.pop(f"{stem}.lora_A.weight"), tensors.pop(f"{stem}.lora_B.weight")
        except KeyError as exc:
            raise AdapterFormatError(f"{weights}: layer {layer} lacks {PEFT_PREFIX}{exc.args[0]}") from None
        e = gu_a.shape[0] // gu_rank
        inter, hidden = gu_b.shape[0] // 2, gu_a.shape[1]
        a13 = gu_a.reshape(e, gu_rank, hidden)
        b13 = gu_b.reshape(2 * inter, gu_rank, e).permute(2, 0, 1)  # [E, 2I, R]
        a2 = dn_a.reshape(e, r, inter).contiguous()
        b2 = dn_b.reshape(hidden, r, e).permute(2, 0, 1).contiguous()
        if gu_rank == 2 * r and gu_alpha / gu_rank == alpha / r and not b13[:, :inter, r:].any() and not b13[:, inter:, :r].any():
            pairs = {"w1": (a13[:, :r], b13[:, :inter, :r]), "w3": (a13[:, r:], b13[:, inter:, r:])}
        elif gu_rank == r and gu_alpha == alpha:  # a shared-A 3-D adapter: w1 and w3 both use A
            pairs = {"w1": (a13, b13[:, :inter]), "w3": (a13, b13[:, inter:])}
        else:
            raise AdapterFormatError(f"{weights}: layer {layer} gate_up has rank {gu_rank}/alpha {gu_alpha} that does not map onto "
                                     f"separate w1/w3 factors of rank {r}/alpha {alpha} without changing the adapter")
        pairs["w2"] = (a2, b2)
        for proj, (a, b) in pairs.items():
            experts[(layer, proj)] = (a.contiguous().clone(), b.contiguous().clone())
    for key in list(tensors):
        if key.endswith(".lora_B.weight") and key.replace(".lora_B.", ".lora_A.") not in tensors:
            raise AdapterFormatError(f"{weights}: {PEFT_PREFIX}{key} has no matching lora_A")
        if key.endswith(".lora_A.weight"):
            name = key.removesuffix(".lora_A.weight")
            if f"{name}.lora_B.weight" not in tensors:
                raise AdapterFormatError(f"{weights}: {PEFT_PREFIX}{name} has lora_A but no lora_B")
            dense[name] = (tensors[key], tensors[f"{name}.lora_B.weight"])
    return PackedMoELoRA(rank=r, alpha=alpha, num_experts=len(experts) and next(iter(experts.values()))[0].shape[0],
                         experts=experts, dense=dense)


# ---- directories: a training output or an adapter directory, in any layout, to any other ----


def adapter_source(path: str | os.PathLike) -> Path:
    """The adapter directory of `path`: itself, or `<path>/adapter` of a `python -m dsv4flash.train` output."""
    path = Path(path)
    for candidate in (path, path / "adapter"):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise FileNotFoundError(f"{path}: neither an adapter directory ({CONFIG_NAME}) nor a training output "
                            f"(adapter/{CONFIG_NAME})")


def read_adapter_dir(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter config with its dsv4flash section, canonical tensors) of a directory in any layout, 3-D included."""
    directory = adapter_source(path)
    data = read_adapter_config(directory)
    if (data.get("dsv4flash") or {}).get("layout") == VLLM_3D:
        return data, import_vllm_3d(directory).to_packed_tensors()
    return read_adapter_tensors(directory)


def export_adapter_dir(source: str | os.PathLike, directory: str | os.PathLike, fmt: str = "peft", *,
                       overwrite: bool = False) -> Path:
    """Rewrite the adapter at `source` (training output or adapter directory, any layout) in `fmt`; tensors are
    moved bit-exactly, the placement and base recorded in the source carry over."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown adapter format {fmt!r}; expected one of {FORMATS}")
    data, canonical = read_adapter_dir(source)
    check_against_base(data, canonical, str(adapter_source(source)))
    rank, alpha, base = int(data["r"]), float(data["lora_alpha"]), data.get("base_model_name_or_path")
    ours = data.get("dsv4flash") or {}
    section = {k: ours[k] for k in ("lora_config", "base", "trainable_params", "lora_dropout") if k in ours}
    if fmt == VLLM_3D:
        if detect_modes(canonical)[1] == "shared_outer":
            raise AdapterFormatError(f"{source}: vllm_3d fuses every expert's own w1/w3 factors; this adapter shares "
                                     "factors across experts (expert_lora='shared_outer'): export it as peft or vllm")
        adapter = PackedMoELoRA.from_packed_tensors(canonical, alpha=alpha, source=str(source))
        return export_vllm_3d(adapter, directory, base_model_name_or_path=base, overwrite=overwrite, section=section)
    config, tensors = adapter_files(canonical, fmt, rank=rank, alpha=alpha,
                                  dropout=float(ours.get("lora_dropout", data.get("lora_dropout", 0.0))),
                                  base_model_name_or_path=base, section=section)
    return _write_dir(directory, overwrite, config, tensors)


def recorded_base_config(data: dict[str, Any]):
    """The model config of the base an adapter directory records (its `base_model_name_or_path` directory, else
    the flavour of its dsv4flash section), or None when neither loads."""
    from dsv4flash.config import ConfigError, load_config

    ours = data.get("dsv4flash") or {}
    for spec in (data.get("base_model_name_or_path"), (ours.get("base") or {}).get("config")):
        try:
            cfg = load_config(spec) if spec else None
        except (ConfigError, OSError, ValueError):
            cfg = None
        if cfg is not None:
            return cfg
    return None


def check_against_base(data: dict[str, Any], canonical: dict[str, torch.Tensor], source: str) -> bool:
    """Check canonical tensors against the placement the directory records, on a meta model of its base (the
    `base_model_name_or_path` directory, else the recorded flavour); False when neither is known."""
    from dsv4flash.lora import LoraConfig, apply_lora
    from dsv4flash.lora.state import check_lora_state_dict
    from dsv4flash.model.transformer import Transformer

    ours = data.get("dsv4flash") or {}
    if not ours.get("lora_config"):
        return False
    cfg = recorded_base_config(data)
    if cfg is None:
        return False
    model = Transformer(cfg, device="meta", seed=None)
    apply_lora(model, LoraConfig.from_dict(ours["lora_config"]))
    check_lora_state_dict(model, canonical, source=source)
    return True
