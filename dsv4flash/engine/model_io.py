"""Base checkpoints of the local engine: `model.safetensors` in reference (= release) tensor names, fp32,
plus `config.json`, `tokenizer.json` and `base.json` (fingerprint and provenance).

NOTE on the release format: the checkpoint bridge (`dsv4flash_bridge`) converts release-layout checkpoints
to BF16/FP32 (`import_release`) and back (`export_release`), but export needs the layout recorded by an
import (`release/layout.json`), and there is no writer from a reference state dict to the release layout
yet. Storing this fp32-trained base in the release layout would also quantize it (FP8 dense, MXFP4
experts) without the quantization-aware training the release had, changing the model. So bases are stored
unquantized in reference (= release) names; with such a writer, `save_base`/`load_base_weights` could go
through `export_release`/`import_release` for bases trained with weight fake-quant.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsv4flash.config import DSV41FlashConfig, load_config
from dsv4flash.engine.fingerprint import MANIFEST

WEIGHTS = "model.safetensors"


class BaseCheckpointError(ValueError):
    """A base directory that is missing files or does not fit the model (names the file and tensor)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def tensor_digest(path: str | os.PathLike) -> str:
    """sha256 over a safetensors file's tensors (names, dtypes, shapes, bytes in name order), not its header."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), "pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_base(model: nn.Module, cfg: DSV41FlashConfig, tokenizer, directory: str | os.PathLike,
              provenance: dict[str, Any]) -> Path:
    """Write a complete base directory atomically (temp dir in the same parent, then rename)."""
    from safetensors.torch import save_file

    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
                 if k in dict(model.named_parameters())}
        # One metadata key only: safetensors writes the metadata map in hash order, so two keys could
        # make identical weights hash differently.
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        cfg.save(tmp / "config.json")
        tokenizer.save(tmp)
        manifest = {"weights_sha256": _sha256(tmp / WEIGHTS), "naming": "dsv4flash-reference", "tensors": len(state),
                    "parameters": int(sum(v.numel() for v in state.values())), **provenance}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """`base.json` of a base directory."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise BaseCheckpointError(f"{path}: missing (not a dsv4flash base directory)")
    return json.loads(path.read_text())


def base_config(directory: str | os.PathLike) -> DSV41FlashConfig:
    """The model config stored with a base."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise BaseCheckpointError(f"{path}: missing (not a dsv4flash base directory)")
    return load_config(path)


def load_base_weights(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load `model.safetensors` into `model`; every parameter must be present with its exact shape."""
    from safetensors.torch import load_file

    path = Path(directory) / WEIGHTS
    if not path.is_file():
        raise BaseCheckpointError(f"{path}: missing")
    state = load_file(str(path))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise BaseCheckpointError(f"{path}: tensors do not match the model: missing {missing[:5]}"
                                  f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                                  f"{'...' if len(unexpected) > 5 else ''}")
    with torch.no_grad():
        for name, param in params.items():
            src = state[name]
            if tuple(src.shape) != tuple(param.shape):
                raise BaseCheckpointError(f"{path}: tensor {name} has shape {list(src.shape)}, the model expects "
                                          f"{list(param.shape)}")
            param.copy_(src.to(param.dtype))
