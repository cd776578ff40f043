"""Several adapters of one placement in one forward: the batch is N equal row chunks, chunk i runs adapter i.

The LoRA wrappers (`layers.py`) compute the frozen base op once over all N·R rows and add each adapter's
low-rank delta to its own rows only, so a multi-adapter batch costs one base pass plus N small deltas
instead of N full passes (S-LoRA / punica style, on the reference model). Nothing here touches the model
code: a wrapper asks `active_batch()` and, when a batch is set, hands its rows to `AdapterBatch.add_deltas`.

Row chunks are equal splits of dim 0 (`[N·B, S, …]` and its flattened `[N·B·S, …]` both split that way),
except where a caller sets explicit `segments` (routed experts: the rows an expert got from each chunk).

An entry may be None (a row chunk of the bare base: no delta) and may carry its own `scaling` (alpha / rank of
that adapter), so adapters of one target set but different ranks share a batch: each delta is computed at its
own rank with its own factor tensors, exactly the ops of that adapter alone (`dsv4flash.service.compute.batcher`).

Not bit-exact by itself: a row's result can depend on the batch around it on CPU (GEMM kernel choice by M,
the scalar tail of vectorised transcendental elementwise ops), so a batched pass agrees with separate passes
to fp32 rounding. `dsv4flash.service.compute.batch_invariant` runs those ops once per chunk (`rows` naming one
adapter) and makes the batched decoder bit-equal (tests/service/test_shared_encoder.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

_ACTIVE: contextvars.ContextVar["AdapterBatch | None"] = contextvars.ContextVar("dsv4flash_adapter_batch",
                                                                               default=None)


def active_batch() -> "AdapterBatch | None":
    """The multi-adapter batch the current forward runs under (None: the wrapper's own factors)."""
    return _ACTIVE.get()


class AdapterBatch:
    """N adapters' factor tensors, looked up by (owner module, factor name), and the current row segments."""

    def __init__(self, slots: Mapping[str, tuple[nn.Module, str]],
                 adapters: Sequence[Mapping[str, torch.Tensor] | None], scalings: Sequence[float | None] | None = None):
        if not adapters:
            raise ValueError("an adapter batch needs at least one adapter")
        self.size = len(adapters)
        if scalings is not None and len(scalings) != self.size:
            raise ValueError(f"adapter batch: {len(scalings)} scalings for {self.size} adapters")
        self._scalings = list(scalings) if scalings is not None else [None] * self.size
        self._factors: list[dict[tuple[int, str], torch.Tensor] | None] = []
        for i, tensors in enumerate(adapters):
            if tensors is None:  # a chunk of the bare base: its rows get no delta
                self._factors.append(None)
                continue
            missing = sorted(set(slots) - set(tensors))
            if missing:
                raise KeyError(f"adapter {i} of the batch lacks {missing[:3]} (every adapter must match the placement)")
            self._factors.append({(id(module), attr): tensors[key] for key, (module, attr) in slots.items()})
        self.segments: list[int] | None = None

    def factor(self, index: int, owner: nn.Module, name: str) -> torch.Tensor:
        """Adapter `index`'s tensor for `owner.name` (the wrapper, or a routed expert's packed factors)."""
        return self._factors[index][(id(owner), name)]

    def scaling(self, index: int, default: float) -> float:
        """Adapter `index`'s alpha / rank (`default`, the wrapper's own, when the batch gives none)."""
        own = self._scalings[index]
        return default if own is None else own

    def bounds(self, rows: int) -> list[tuple[int, int]]:
        """[(start, end)] row range of each adapter for a tensor with `rows` rows in dim 0."""
        sizes = self.segments
        if sizes is None:
            if rows % self.size:
                raise ValueError(f"adapter batch of {self.size}: {rows} rows do not split into equal chunks")
            sizes = [rows // self.size] * self.size
        elif sum(sizes) != rows and not (sum(sizes) and rows % sum(sizes) == 0):
            raise ValueError(f"adapter batch segments {sizes} cover {sum(sizes)} rows, the input has {rows}")
        elif sum(sizes) != rows:  # segments in batch rows over a flattened [rows·S, …] input
            sizes = [size * (rows // sum(sizes)) for size in sizes]
        out, start = [], 0
        for size in sizes:
            out.append((start, start + size))
            start += size
        return out

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor,
                   delta: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """out[rows of i] += delta(i, x[rows of i]) for each adapter i (in place; `out` is the base output)."""
        for i, (start, end) in enumerate(self.bounds(x.shape[0])):
            if end > start and self._factors[i] is not None:
                out[start:end] += delta(i, x[start:end]).to(out.dtype)
        return out

    @contextmanager
    def rows(self, sizes: Sequence[int]):
        """Within the block, wrappers split their rows by `sizes` (one entry per adapter) instead of equally."""
        saved, self.segments = self.segments, list(sizes)
        try:
            yield
        finally:
            self.segments = saved


@contextmanager
def adapter_batch(batch: AdapterBatch):
    """Run the block's forwards with `batch` active (thread- and task-local)."""
    token = _ACTIVE.set(batch)
    try:
        yield batch
    finally:
        _ACTIVE.reset(token)
