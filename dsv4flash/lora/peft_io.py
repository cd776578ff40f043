"""PEFT adapter directories: `adapter_config.json` + `adapter_model.safetensors`, written atomically.

Tensor keys are `base_model.model.<name>` in one of the layouts of `layouts.py` — by default `peft`, which
stock `PeftModel.from_pretrained(DeepseekV41ForCausalLM, dir)` loads with nothing missing or unexpected and
vLLM's LoRA loader accepts. Our section, `dsv4flash_adapter.json` next to the config (PEFT warns about unknown
config keys), names the layout, the `wo_a` / expert parameterisations and (when written from a model) the full
`LoraConfig` and base geometry, so the directory alone rebuilds the placement. Older directories carry it
inline as `adapter_config.json["dsv4flash"]`; `dsv4flash-lora/1` ones (packed layout) still load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from dsv4flash.atomic_io import publish_directory
from dsv4flash.lora.apply import LoraHandle, apply_lora, get_handle, require_handle
from dsv4flash.lora.config import LoraConfig
from dsv4flash.lora.layouts import LAYOUTS, AdapterLayoutError, detect_modes, from_layout, target_regex, to_layout
from dsv4flash.lora.state import PEFT_PREFIX, load_lora_state_dict, lora_state_dict
from dsv4flash_bridge.safetensors_io import save_file

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
SECTION_NAME = "dsv4flash_adapter.json"  # our section, beside (not in) the config: PEFT warns on unknown keys
FORMAT = "dsv4flash-lora/2"
LEGACY_FORMAT = "dsv4flash-lora/1"  # packed layout, the LoraConfig in the section


def adapter_files(canonical: dict[str, torch.Tensor], layout: str, *, rank: int, alpha: float, dropout: float = 0.0,
                base_model_name_or_path: str | None = None, section: dict | None = None) -> tuple[dict, dict]:
    """(`adapter_config.json` content, file tensors without prefix) of canonical tensors in `layout`."""
    files = to_layout(canonical, layout)
    wo_a, experts = detect_modes(canonical)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in canonical})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",  # DeepseekV41ForCausalLM (dsv4flash.hf) is a GenerationMixin causal LM
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        # PEFT's parameter LoRA (wo_a) refuses dropout; it is a training-time setting, kept in the section
        "lora_dropout": 0.0 if files.parameters else dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {key: rank * scale for key, scale in files.rank_scale.items()},
        "alpha_pattern": {key: alpha * scale for key, scale in files.rank_scale.items()},
        "target_modules": target_regex(files.modules) if layout != "packed" else sorted(files.modules),
        "dsv4flash": {
            "format": FORMAT, "layout": layout, "wo_a_lora": wo_a, "expert_lora": experts, "lora_dropout": dropout,
            "grouped_modules": [m for m in modules if m.endswith("attn.wo_a")],
            "packed_experts": [m for m in modules if ".ffn.experts." in m],
            **(section or {}),
        },
    }
    if files.parameters:
        config["target_parameters"] = sorted(files.parameters)
    return config, files.tensors


def adapter_config(model: nn.Module, handle: LoraHandle, base_model_name_or_path: str | None = None,
                   layout: str = "peft") -> dict:
    """The `adapter_config.json` content for `model`'s adapters written in `layout`."""
    return model_adapter_files(model, handle, lora_state_dict(model), base_model_name_or_path, layout)[0]


def write_adapter_dir(directory: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor], *,
                      overwrite: bool = False, what: str = "save_peft_adapter",
                      write_weights: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
                      before_rename: Callable[[], None] | None = None) -> Path:
    """Publish config (its "dsv4flash" section to the sidecar) + file tensors (keys without prefix) as an adapter
    directory: temp dir, fsync, rename. `write_weights(path, prefixed tensors)` replaces the safetensors writer."""
    config = dict(config)
    section = config.pop("dsv4flash", None)
    prefixed = {PEFT_PREFIX + k: v.detach().cpu() for k, v in tensors.items()}

    def write(tmp: Path) -> None:
        if write_weights is None:
            save_file(prefixed, tmp / WEIGHTS_NAME, {"format": "pt"})
        else:
            write_weights(tmp / WEIGHTS_NAME, prefixed)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if section is not None:
            (tmp / SECTION_NAME).write_text(json.dumps(section, indent=2, sort_keys=True) + "\n")

    return publish_directory(directory, write, overwrite=overwrite, what=what, before_rename=before_rename)


def save_peft_adapter(model: nn.Module, handle: LoraHandle | None, directory: str | os.PathLike, *,
                      base_model_name_or_path: str | None = None, overwrite: bool = False,
                      layout: str = "peft") -> Path:
    """Write the adapter as a PEFT directory in `layout` (never half-written) -> its path."""
    handle = handle or require_handle(model, "save_peft_adapter")
    config, tensors = model_adapter_files(model, handle, lora_state_dict(model), base_model_name_or_path, layout)
    return write_adapter_dir(directory, config, tensors, overwrite=overwrite)


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """Parse and check `adapter_config.json` of a PEFT directory, with our section (from `dsv4flash_adapter.json`,
    or inline in older directories) under "dsv4flash"; clear errors naming the file."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (not a PEFT adapter directory)")
    data = _read_json(path)
    if data.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {data.get('peft_type')!r}, expected 'LORA'")
    sidecar = Path(directory) / SECTION_NAME
    if sidecar.is_file():
        data["dsv4flash"] = _read_json(sidecar)
    return data


def _section_path(directory: Path) -> Path:
    """Where a directory's `dsv4flash` section lives (the sidecar, or inline in older directories)."""
    sidecar = Path(directory) / SECTION_NAME
    return sidecar if sidecar.is_file() else Path(directory) / CONFIG_NAME


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def stored_lora_config(data: dict) -> LoraConfig | None:
    """The `LoraConfig` an adapter config's `dsv4flash` section carries, or None."""
    ours = data.get("dsv4flash") or {}
    return LoraConfig.from_dict(ours["lora_config"]) if ours.get("lora_config") else None


def read_adapter_tensors(directory: str | os.PathLike, hint: LoraConfig | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, canonical tensors) of an adapter directory in any layout; `hint` gives the parameterisations of a
    directory without a `dsv4flash` section (a stock PEFT adapter)."""
    directory = Path(directory)
    data = read_adapter_config(directory)
    layout, wo_a, experts = _layout_of(data, hint, _section_path(directory))
    tensors = read_adapter_weights(directory)
    return data, from_layout(tensors, layout, rank=int(data["r"]), wo_a_lora=wo_a, expert_lora=experts,
                             source=str(directory / WEIGHTS_NAME))


def read_adapter_weights(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The file tensors of an adapter directory, keys without `base_model.model.` (errors name the file)."""
    weights = Path(directory) / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing adapter weights")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights}: unreadable safetensors file ({exc})") from None
    bad = [k for k in tensors if not k.startswith(PEFT_PREFIX)]
    if bad:
        raise ValueError(f"{weights}: tensor {bad[0]!r} lacks the PEFT prefix {PEFT_PREFIX!r}")
    return {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}


def load_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> LoraHandle:
    """Load an adapter directory (any layout) into `model`; applies the stored placement first if it has none."""
    directory = Path(directory)
    data = read_adapter_config(directory)
    handle = get_handle(model)
    if handle is None:
        stored = stored_lora_config(data)
        if stored is None:
            raise ValueError(f"{_section_path(directory)}: no '{FORMAT}' section with a lora_config, so the placement "
                             "cannot be rebuilt; apply_lora with the matching LoraConfig before loading")
        _check_base(model, (data.get("dsv4flash") or {}).get("base", {}), _section_path(directory))
        handle = apply_lora(model, stored)
    elif (data.get("r"), float(data.get("lora_alpha", 0))) != (handle.config.rank, float(handle.config.alpha)):
        raise ValueError(f"{directory / CONFIG_NAME}: r={data.get('r')} lora_alpha={data.get('lora_alpha')} but the "
                         f"model's adapters have rank {handle.config.rank}, alpha {handle.config.alpha}")
    _, canonical = read_adapter_tensors(directory, handle.config)
    load_lora_state_dict(model, canonical, strict=True, source=str(directory / WEIGHTS_NAME))
    return handle


def model_adapter_files(model: nn.Module, handle: LoraHandle, canonical: dict, base_model_name_or_path: str | None,
                        layout: str = "peft") -> tuple[dict, dict]:
    """(config, file tensors) of canonical tensors that fit `model`'s placement `handle` (model may be on meta)."""
    cfg = handle.config
    section = {"lora_config": cfg.to_dict(), "trainable_params": handle.trainable_params,
               "base": {"config": model.cfg.name, "num_hidden_layers": model.cfg.text.num_hidden_layers,
                        "hidden_size": model.cfg.text.hidden_size, "decoder_start": model.cfg.decoder_start}}
    return adapter_files(canonical, layout, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout,
                       base_model_name_or_path=base_model_name_or_path, section=section)


def _layout_of(data: dict, hint: LoraConfig | None, where: Path) -> tuple[str, str, str]:
    """(layout, wo_a_lora, expert_lora) a config declares; a sectionless (stock PEFT) config is the `peft` layout."""
    ours = data.get("dsv4flash") or {}
    fmt = ours.get("format")
    if fmt == LEGACY_FORMAT:
        cfg = LoraConfig.from_dict(ours["lora_config"])
        return "packed", cfg.wo_a_lora, cfg.expert_lora
    if fmt == FORMAT:
        layout = ours.get("layout")
        if layout not in LAYOUTS:
            raise AdapterLayoutError(f"{where}: dsv4flash.layout is {layout!r}, expected one of {LAYOUTS}")
        return layout, ours.get("wo_a_lora", "per_group"), ours.get("expert_lora", "per_expert")
    if fmt is not None:
        raise AdapterLayoutError(f"{where}: dsv4flash.format is {fmt!r}; this version reads {FORMAT} and {LEGACY_FORMAT}")
    # PEFT's own wo_a parameter LoRA is one A for all groups: the shared-A parameterisation
    return "peft", hint.wo_a_lora if hint else "shared_a", hint.expert_lora if hint else "per_expert"


def _check_base(model: nn.Module, base: dict, where: Path) -> None:
    text = model.cfg.text
    mine = {"num_hidden_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
            "decoder_start": model.cfg.decoder_start}
    for key, value in mine.items():
        if key in base and base[key] != value:
            raise ValueError(f"{where}: adapter was trained on a base with {key}={base[key]}, this model has {value}")
