"""Trainer-state capture for any `nn.Module` + torch optimizer: everything a bit-exact resume needs.

A resume reproduces the next step's loss and weights bit for bit only if *all* of these come back:
  * the trainable weights (the adapter; the frozen base is resident and fingerprinted),
  * the optimizer state (moments, step counts, param-group hyper-parameters),
  * the LR scheduler position,
  * every RNG the step consumes: python `random`, numpy's global generator, torch CPU and CUDA,
  * the data position (which samples come next).
The state blob is a `torch.save` of plain containers and tensors only, so it loads with
`weights_only=True` (no pickled code).
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from dsv4flash.lifecycle.errors import AdapterFormatError

__all__ = [
    "capture_rng",
    "restore_rng",
    "trainable_state",
    "load_weights",
    "capture_trainer_state",
    "restore_trainer_state",
    "DataCursor",
]

STATE_VERSION = 1


def capture_rng() -> dict[str, Any]:
    """The state of every global RNG a training step may draw from."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put every global RNG back where `capture_rng` found it."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if not torch.cuda.is_available():
            raise RuntimeError("this trainer state carries CUDA RNG states but no CUDA device is available to restore them")
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the optimizer updates (name -> detached tensor, no copy)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, source: str = "checkpoint") -> None:
    """Copy saved trainable weights into `model` exactly; names/shapes/dtypes must match."""
    params = dict(model.named_parameters())
    expected = {n for n, p in params.items() if p.requires_grad}
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise AdapterFormatError(f"{source}: trainable parameters do not match the model — missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name in expected:
            src, dst = tensors[name], params[name]
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise AdapterFormatError(f"{source}: {name} is {src.dtype}{list(src.shape)}, the model has {dst.dtype}{list(dst.shape)}")
            dst.copy_(src)


def capture_trainer_state(optimizer: torch.optim.Optimizer, scheduler: Any = None, extra: Mapping[str, Any] | None = None) -> bytes:
    """Serialize optimizer, scheduler and RNG state (+ plain `extra` data) to bytes."""
    payload = {
        "version": STATE_VERSION,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": capture_rng(),
        "extra": dict(extra or {}),
    }
    buf = io.BytesIO()
    torch.save(payload, buf)
    return buf.getvalue()


def restore_trainer_state(blob: bytes, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> dict[str, Any]:
    """Inverse of `capture_trainer_state` (RNGs included); returns the `extra` data."""
    payload = torch.load(io.BytesIO(blob), weights_only=True)
    if payload.get("version") != STATE_VERSION:
        raise AdapterFormatError(f"trainer state version {payload.get('version')} is not {STATE_VERSION}")
    optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None:
        if payload["scheduler"] is None:
            raise AdapterFormatError("the trainer state has no LR scheduler state but a scheduler was given")
        scheduler.load_state_dict(payload["scheduler"])
    restore_rng(payload["rng"])
    return payload["extra"]


@dataclass
class DataCursor:
    """A resumable position in a shuffled dataset: epoch `e` visits `permutation(seed, e)` in order."""

    size: int
    seed: int
    epoch: int = 0
    index: int = 0

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.size)

    def take(self, n: int) -> list[int]:
        """The next `n` sample indices, rolling over epochs."""
        out: list[int] = []
        while len(out) < n:
            perm = self._perm(self.epoch)
            k = min(n - len(out), self.size - self.index)
            out.extend(int(i) for i in perm[self.index:self.index + k])
            self.index += k
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def position(self) -> dict[str, int]:
        """JSON-able position (stored in the policy record)."""
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "index": self.index}

    @classmethod
    def from_position(cls, pos: Mapping[str, Any]) -> "DataCursor":
        """Inverse of `position`."""
        return cls(int(pos["size"]), int(pos["seed"]), int(pos["epoch"]), int(pos["index"]))
