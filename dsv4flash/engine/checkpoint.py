"""Resumable training state of the local engine: trainable tensors, optimizer state, step and history.

One file, written to a temp name and renamed: a crash leaves the previous checkpoint or the new one. A
resumed run is bit-identical to an uninterrupted one because every batch, sampling seed and dropout seed
is a function of (seed, step) and the optimizer state is restored exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

STATE_FILE = "state.pt"


class CheckpointMismatch(RuntimeError):
    """A checkpoint written by a run with a different config or model."""


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter that trains, by name (cloned)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(directory: str | os.PathLike, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    history: list[dict[str, Any]], fingerprint: str) -> Path:
    """Write `state.pt` atomically under `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"step": step, "fingerprint": fingerprint, "trainable": trainable_state(model),
                "optimizer": optimizer.state_dict(), "history": history}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    fingerprint: str) -> tuple[int, list[dict[str, Any]]] | None:
    """Restore a checkpoint if one exists -> (next step, history); None when there is none."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        return None
    data = torch.load(path, map_location="cpu", weights_only=False)
    if data.get("fingerprint") != fingerprint:
        raise CheckpointMismatch(f"{path}: written by a run with another config (fingerprint "
                                 f"{data.get('fingerprint')!r}, this run {fingerprint!r}); use a fresh output_dir "
                                 "or engine.resume=false")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved = data["trainable"]
    if set(saved) != set(params):
        diff = sorted(set(saved) ^ set(params))
        raise CheckpointMismatch(f"{path}: trainable tensors differ from the model's: {diff[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if saved[name].shape != p.shape:
                raise CheckpointMismatch(f"{path}: tensor {name} has shape {list(saved[name].shape)}, "
                                         f"the model expects {list(p.shape)}")
            p.copy_(saved[name])
    optimizer.load_state_dict(data["optimizer"])
    return int(data["step"]), list(data["history"])
