"""PEFT-format adapter directories: `adapter_config.json` + `adapter_model.safetensors`, written atomically.

Tensor keys are `base_model.model.<canonical key>` (see `state.py`). Plain linears are listed in PEFT's
`target_modules`; the two layouts stock PEFT cannot express — block-diagonal `wo_a` (3-D per-group
factors) and packed routed experts (3-D per-expert stacks) — are described in the `dsv4flash` section,
which also carries the full `LoraConfig` so a directory alone rebuilds the placement.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dsv4flash.atomic_io import publish_directory
from dsv4flash.lora.apply import LoraHandle, apply_lora, get_handle, require_handle
from dsv4flash.lora.config import LoraConfig
from dsv4flash.lora.state import PEFT_PREFIX, load_lora_state_dict, lora_state_dict

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
FORMAT = "dsv4flash-lora/1"


def adapter_config(model: nn.Module, handle: LoraHandle, base_model_name_or_path: str | None = None) -> dict:
    """The `adapter_config.json` content for `model`'s adapters."""
    cfg = handle.config
    plain = sorted(a.name for a in handle.adapters if a.kind in ("linear", "router"))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": plain,
        "dsv4flash": {
            "format": FORMAT,
            "lora_config": cfg.to_dict(),
            "grouped_modules": sorted(a.name for a in handle.adapters if a.kind == "grouped"),
            "packed_experts": sorted(a.name for a in handle.adapters if a.kind == "packed_experts"),
            "base": {"config": model.cfg.name, "num_hidden_layers": model.cfg.text.num_hidden_layers,
                     "hidden_size": model.cfg.text.hidden_size, "decoder_start": model.cfg.decoder_start},
            "trainable_params": handle.trainable_params,
        },
    }


def save_peft_adapter(model: nn.Module, handle: LoraHandle | None, directory: str | os.PathLike, *,
                      base_model_name_or_path: str | None = None, overwrite: bool = False) -> Path:
    """Write the adapter as a PEFT directory (temp dir, fsync, rename: never half-written) -> its path."""
    handle = handle or require_handle(model, "save_peft_adapter")

    def write(tmp: Path) -> None:
        tensors = {PEFT_PREFIX + k: v.contiguous().cpu() for k, v in lora_state_dict(model).items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        text = json.dumps(adapter_config(model, handle, base_model_name_or_path), indent=2, sort_keys=True)
        (tmp / CONFIG_NAME).write_text(text + "\n")

    return publish_directory(directory, write, overwrite=overwrite, what="save_peft_adapter")


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """Parse and check `adapter_config.json` of a PEFT directory (clear errors naming the file)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME} (not a PEFT adapter directory)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if data.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {data.get('peft_type')!r}, expected 'LORA'")
    return data


def load_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> LoraHandle:
    """Load a PEFT directory into `model`; applies the stored placement first if the model has none."""
    directory = Path(directory)
    data = read_adapter_config(directory)
    handle = get_handle(model)
    ours = data.get("dsv4flash")
    if handle is None:
        if not ours or ours.get("format") != FORMAT:
            raise ValueError(f"{directory / CONFIG_NAME}: no '{FORMAT}' section, so the placement cannot be "
                             "rebuilt; apply_lora with the matching LoraConfig before loading")
        _check_base(model, ours.get("base", {}), directory / CONFIG_NAME)
        handle = apply_lora(model, LoraConfig.from_dict(ours["lora_config"]))
    elif (data.get("r"), float(data.get("lora_alpha", 0))) != (handle.config.rank, float(handle.config.alpha)):
        raise ValueError(f"{directory / CONFIG_NAME}: r={data.get('r')} lora_alpha={data.get('lora_alpha')} but the "
                         f"model's adapters have rank {handle.config.rank}, alpha {handle.config.alpha}")
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing adapter weights")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{weights}: unreadable safetensors file ({exc})") from None
    bad = [k for k in tensors if not k.startswith(PEFT_PREFIX)]
    if bad:
        raise ValueError(f"{weights}: tensor {bad[0]!r} lacks the PEFT prefix {PEFT_PREFIX!r}")
    load_lora_state_dict(model, tensors, strict=True, source=str(weights))
    return handle


def _check_base(model: nn.Module, base: dict, where: Path) -> None:
    text = model.cfg.text
    mine = {"num_hidden_layers": text.num_hidden_layers, "hidden_size": text.hidden_size,
            "decoder_start": model.cfg.decoder_start}
    for key, value in mine.items():
        if key in base and base[key] != value:
            raise ValueError(f"{where}: adapter was trained on a base with {key}={base[key]}, this model has {value}")
