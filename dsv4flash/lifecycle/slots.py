"""Device tier: a fixed number of adapter slots, preallocated once, on CUDA when present.

Each tensor name of the slot layout owns one buffer `[num_slots, *shape]`; loading adapter X into slot
s copies X's tensors into `buffer[s]` — no allocation on the hot path, exactly like vLLM's
`lora_a_stacked[slot]`. Adapters of lower rank are zero-padded along the rank dimension (rows of
`lora_A`, columns of `lora_B`), which leaves `B @ A` unchanged; the per-slot `scaling` (alpha / r of the
adapter) is kept alongside. On CPU the "device" is host memory and the pool is the same code path.

`ExactSlots` is the serving tier's variant: each slot holds its adapter's tensors at their own shapes (copied
to the device on load), so adapters of different ranks and target sets share the slots, and a batch computes
each delta at its adapter's own rank: the same ops, bit for bit, as that adapter alone (padding the rank
changes a GEMM's K and with it the rounding). It allocates per load instead of reusing fixed buffers.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch

from dsv4flash.lifecycle.errors import AdapterFormatError

__all__ = ["ExactSlots", "SlotPool", "default_device"]


def default_device() -> torch.device:
    """CUDA if available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rank_dim(name: str) -> int | None:
    if name.endswith("lora_A.weight"):
        return -2
    if name.endswith("lora_B.weight"):
        return -1
    return None


class SlotPool:
    """`num_slots` preallocated copies of one adapter layout on one device."""

    def __init__(self, layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], num_slots: int, device: torch.device | str | None = None):
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device) if device is not None else default_device()
        self.layout = {name: (tuple(shape), dtype) for name, (shape, dtype) in layout.items()}
        self.buffers = {name: torch.zeros((num_slots, *shape), dtype=dtype, device=self.device) for name, (shape, dtype) in self.layout.items()}
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=self.device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def for_adapter(cls, tensors: Mapping[str, torch.Tensor], num_slots: int, *, device=None, max_rank: int | None = None) -> "SlotPool":
        """A pool shaped like `tensors`, optionally widened to `max_rank`."""
        layout = {}
        for name, t in tensors.items():
            shape = list(t.shape)
            dim = _rank_dim(name)
            if max_rank is not None and dim is not None:
                if shape[dim] > max_rank:
                    raise AdapterFormatError(f"{name}: rank {shape[dim]} exceeds the pool's max_rank {max_rank}")
                shape[dim] = max_rank
            layout[name] = (tuple(shape), t.dtype)
        return cls(layout, num_slots, device)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the pool."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def write(self, slot: int, tensors: Mapping[str, torch.Tensor], scaling: float = 1.0, *, source: str = "adapter") -> int:
        """Copy an adapter into `slot` (blocking until it is on the device); returns bytes copied."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        unexpected = sorted(tensors.keys() - self.buffers.keys())
        if unexpected:
            raise AdapterFormatError(f"{source}: tensors {unexpected[:3]} are not in this slot pool's layout (built for another adapter family)")
        copied = 0
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with ctx:
            for name, buf in self.buffers.items():
                dst = buf[slot]
                src = tensors.get(name)
                if src is None:
                    dst.zero_()  # module without LoRA in this adapter: contributes nothing
                    continue
                if src.dtype != dst.dtype:
                    raise AdapterFormatError(f"{source}: {name} is {src.dtype}, the slot pool holds {dst.dtype}")
                if tuple(src.shape) == tuple(dst.shape):
                    dst.copy_(src, non_blocking=True)
                else:
                    dim = _rank_dim(name)
                    if dim is None or src.dim() != dst.dim() or any(
                        s != d for i, (s, d) in enumerate(zip(src.shape, dst.shape)) if i != src.dim() + dim) or src.shape[dim] > dst.shape[dim]:
                        raise AdapterFormatError(f"{source}: {name} has shape {list(src.shape)}, the slot holds {list(dst.shape)} (only lower ranks are padded)")
                    dst.zero_()
                    dst.narrow(dim, 0, src.shape[dim]).copy_(src, non_blocking=True)
                copied += src.numel() * src.element_size()
            self.scaling[slot] = float(scaling)
        if self._stream is not None:
            self._stream.synchronize()
        return copied

    def clear(self, slot: int) -> None:
        """Zero a slot (an empty slot adds nothing)."""
        for buf in self.buffers.values():
            buf[slot].zero_()
        self.scaling[slot] = 0.0

    def view(self, slot: int) -> dict[str, torch.Tensor]:
        """The tensors of one slot (views into the pool)."""
        return {name: buf[slot] for name, buf in self.buffers.items()}



class ExactSlots:
    """`num_slots` device slots, each holding one adapter's tensors as they are (no padding, no fixed layout)."""

    def __init__(self, num_slots: int, device: torch.device | str | None = None):
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.device = torch.device(device) if device is not None else default_device()
        self._tensors: list[dict[str, torch.Tensor] | None] = [None] * num_slots
        self.scaling = [0.0] * num_slots

    @property
    def nbytes(self) -> int:
        """Device bytes held by the filled slots."""
        return sum(t.numel() * t.element_size() for held in self._tensors if held for t in held.values())

    def write(self, slot: int, tensors: Mapping[str, torch.Tensor], scaling: float = 1.0, *, source: str = "adapter") -> int:
        """Put an adapter's tensors in `slot` (a device copy; host tensors on a CPU pool are kept as they are)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        held = {name: t if t.device == self.device else t.to(self.device) for name, t in tensors.items()}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._tensors[slot], self.scaling[slot] = held, float(scaling)
        return sum(t.numel() * t.element_size() for t in held.values())

    def clear(self, slot: int) -> None:
        """Empty a slot."""
        self._tensors[slot], self.scaling[slot] = None, 0.0

    def view(self, slot: int) -> dict[str, torch.Tensor]:
        """The tensors of one slot."""
        held = self._tensors[slot]
        if held is None:
            raise KeyError(f"slot {slot} is empty")
        return held
