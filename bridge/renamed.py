"""Output naming of a converted checkpoint: which release rows make each output tensor, and the way back.

An import writes either the release names (each tensor as it is, decoded) or the Megatron names of the name
table (`mapping.py`), where one output tensor may be several release tensors stacked along dim 0 (`glu`:
[w1 ; w3]) or a fused tensor's rows reordered (`qkv`: per-head [q_h ; k_h ; v_h]). Both cases are a list of
`Piece`s: release rows [start, stop) in output-row order. `ReleaseView` reads such a checkpoint back under
release names (for `--verify` and for export), so the exporter and the checks stay name-agnostic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsv4flash_bridge.convert_common import ConvertError
from dsv4flash_bridge.mapping import Mapped, MappingError, resolve
from dsv4flash_bridge.safetensors_io import TensorInfo

__all__ = ["NAMINGS", "Piece", "OutTensor", "pieces", "output_tensors", "ReleaseView", "vision_heads"]

NAMINGS = ("release", "megatron")


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one release tensor."""

    release: str
    start: int
    stop: int


@dataclass(frozen=True)
class OutTensor:
    """One output tensor: its name and the release rows it is made of, in order."""

    name: str
    pieces: tuple[Piece, ...]

    @property
    def sources(self) -> list[str]:
        """Distinct release tensors, in order."""
        return list(dict.fromkeys(p.release for p in self.pieces))


def vision_heads(config_text: str | None) -> int | None:
    """The ViT's attention heads from a release `config.json` text (None without one)."""
    if config_text is None:
        return None
    heads = json.loads(config_text).get("vision_config", {}).get("num_attention_heads")
    return int(heads) if heads else None


def pieces(m: Mapped, rows: Callable[[str], int], heads: int | None) -> tuple[Piece, ...]:
    """The release rows of a Megatron tensor, in its row order."""
    if m.transform == "concat":
        return tuple(Piece(r, 0, rows(r)) for r in m.release)
    (name,) = m.release  # qkv: a fused [q ; k ; v] -> per head [q_h ; k_h ; v_h]
    total = rows(name)
    if not heads or total % (3 * heads):
        raise MappingError(f"{name}: {total} rows cannot be split into q, k, v of {heads} heads (config.json "
                           "vision_config.num_attention_heads is needed for Megatron naming)")
    width = total // (3 * heads)
    return tuple(Piece(name, (part * heads + h) * width, (part * heads + h + 1) * width)
                 for h in range(heads) for part in range(3))


def output_tensors(names: Sequence[str], rows: Callable[[str], int], naming: str, heads: int | None) -> list[OutTensor]:
    """The output tensors of a checkpoint holding `names` (scales excluded by the caller), in source order."""
    if naming not in NAMINGS:
        raise ConvertError(f"naming must be one of {NAMINGS}, got {naming!r}")
    if naming == "release":
        return [OutTensor(n, (Piece(n, 0, rows(n)),)) for n in names]
    try:
        return [OutTensor(m.megatron, pieces(m, rows, heads)) for m in resolve(names)]
    except MappingError as exc:
        raise ConvertError(str(exc)) from None


class ReleaseView:
    """Release-named, read-only view of a checkpoint written with `OutTensor`s (a `CheckpointReader` subset)."""

    def __init__(self, reader, outs: Sequence[OutTensor]) -> None:
        self.reader = reader
        self._parts: dict[str, list[tuple[int, int, str, int]]] = {}  # release -> (r0, r1, out name, out row)
        for out in outs:
            at = 0
            for p in out.pieces:
                self._parts.setdefault(p.release, []).append((p.start, p.stop, out.name, at))
                at += p.stop - p.start
        for out in outs:
            want = sum(p.stop - p.start for p in out.pieces)
            if reader.info(out.name).rows != want:
                raise ConvertError(f"{out.name}: shape {list(reader.info(out.name).shape)} but its release sources "
                                   f"{out.sources} need {want} rows")
        for name, parts in self._parts.items():
            parts.sort()
            if [a for a, _, _, _ in parts] != [0] + [b for _, b, _, _ in parts[:-1]]:
                raise ConvertError(f"{name}: the output naming does not cover its rows exactly once")

    def names(self) -> list[str]:
        """Release names present."""
        return list(self._parts)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def info(self, name: str) -> TensorInfo:
        """A header-like entry: the output tensor's dtype, the release tensor's (logical) shape."""
        parts = self._parts[name]
        out = self.reader.info(parts[0][2])
        return TensorInfo(name, out.dtype, (parts[-1][1], *out.shape[1:]))

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of a release tensor, gathered from the output tensors that hold them."""
        chunks = [self.reader.read_rows(o, at + max(start, a) - a, at + min(stop, b) - a)
                  for a, b, o, at in self._parts[name] if a < stop and b > start]
        value = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        if out is not None:
            out.copy_(value)
            return out
        return value

    def read(self, name: str) -> torch.Tensor:
        """A whole release tensor."""
        return self.read_rows(name, 0, self._parts[name][-1][1])

