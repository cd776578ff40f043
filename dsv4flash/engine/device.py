"""Where the embedded engines compute: the device and dtype of `engine=local` runs and of `dsv4flash serve
--trainer local`'s resident base, and the boundary that lets CPU-side code drive a model on another device.

`resolve_compute(device, dtype, release_dtype)` turns the `auto` defaults into a concrete choice: CUDA when torch
sees a CUDA device, else the CPU; on CUDA the release's compute dtype (the config's `dtype`, bfloat16 for
DeepSeek-V4.1-Flash: the model then keeps its own fp32 parts, dsv4flash/model/transformer.py and
docs/architecture.md "In-memory dtypes"), on the CPU float32 — what the embedded engines always ran in, so the
CPU path is the same computation as before. Explicit values override either half.

`DeviceForward` wraps a model living on the chosen device for callers that hold CPU tensors (batches, samplers,
losses): tensor arguments go to the device, tensor results (logits) come back to the CPU, autograd flows
through both copies, and a decode cache stays on the device. On the CPU nothing is wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Compute", "DTYPES", "DeviceForward", "on_device", "resolve_compute"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Compute:
    """A resolved choice: the torch device and the base weights' dtype."""

    device: torch.device
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        """`float32` / `bfloat16` (the spelling of configs and fingerprints)."""
        return _DTYPE_NAMES[self.dtype]

    def describe(self) -> str:
        """`cuda:0 bfloat16 (NVIDIA H100 80GB HBM3)`, `cpu float32`."""
        name = f" ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" else ""
        return f"{self.device} {self.dtype_name}{name}"


def resolve_compute(device: str = "auto", dtype: str = "auto", *, release_dtype: str = "bfloat16",
                    what: str = "device") -> Compute:
    """`device` auto|cpu|cuda|cuda:N and `dtype` auto|float32|bfloat16 -> a `Compute` (ValueError names the field).

    auto device: cuda:<current> when `torch.cuda.is_available()`, else cpu. auto dtype: `release_dtype` on CUDA
    (float32 if the release computes in something else), float32 on the CPU."""
    spec = str(device).strip().lower()
    if spec == "auto":
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            dev = torch.device(spec)
        except RuntimeError:
            raise ValueError(f"{what}={device!r}: expected auto, cpu, cuda or cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"{what}={device!r}: expected auto, cpu, cuda or cuda:N")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"{what}={device!r}: no CUDA device is visible to torch "
                                 f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if index >= torch.cuda.device_count():
                raise ValueError(f"{what}={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
            dev = torch.device("cuda", index)
    name = str(dtype).strip().lower()
    if name == "auto":
        name = release_dtype if dev.type == "cuda" and release_dtype in DTYPES else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected auto, {' or '.join(DTYPES)}")
    return Compute(dev, DTYPES[name])


def _move(obj: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) on `device`; anything else (a decode cache) as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_move(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


_CPU = torch.device("cpu")


class DeviceForward:
    """`model(...)`, `model.prefill(...)` and `model.decode(...)` with CPU tensors in and CPU tensors out."""

    def __init__(self, model: Any, device: torch.device):
        self.model, self.device = model, device
        self.device_type = device.type  # what torch.autocast needs for ops of this model
        if callable(getattr(model, "prefill", None)) and callable(getattr(model, "decode", None)):
            self.prefill = self._wrap(model.prefill)
            self.decode = self._wrap(model.decode)

    def _wrap(self, fn):
        def call(*args, **kwargs):
            return _move(fn(*_move(args, self.device), **_move(kwargs, self.device)), _CPU)

        return call

    def __call__(self, *args, **kwargs):
        return _move(self.model(*_move(args, self.device), **_move(kwargs, self.device)), _CPU)


def on_device(forward: Any, device: torch.device) -> Any:
    """`forward` itself on the CPU (unchanged path), else a `DeviceForward` around it."""
    return forward if device.type == "cpu" else DeviceForward(forward, device)
