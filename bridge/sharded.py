"""Sharded checkpoints: `model.safetensors.index.json` and a reader over all shards of a directory.

The index is ``{"metadata": {"total_size": N, ...}, "weight_map": {tensor: shard file}}``, with
`total_size` the sum of the tensors' data bytes. Opening a checkpoint validates every shard header and
checks index and shards against each other: a missing shard, a tensor listed but absent from its shard, or
a tensor present in a shard but not listed is an error naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from dsv4flash.atomic_io import write_bytes_atomic
from dsv4flash_bridge.safetensors_io import SafetensorsError, SafetensorsReader, TensorInfo

__all__ = ["INDEX_FILE", "SINGLE_FILE", "ShardIndex", "read_index", "write_index", "CheckpointReader"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class ShardIndex:
    """The parsed index: tensor -> shard file name, plus the metadata object (total_size included)."""

    weight_map: dict[str, str]
    metadata: dict = field(default_factory=dict)

    @property
    def shards(self) -> list[str]:
        """Shard file names in first-mention order."""
        return list(dict.fromkeys(self.weight_map.values()))


def read_index(path: str | os.PathLike) -> ShardIndex:
    """Parse and validate an index file (structure and shard file names only; see CheckpointReader)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SafetensorsError(f"{path}: no such index file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{path}: not valid UTF-8 JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
        raise SafetensorsError(f"{path}: expected an object with a 'weight_map' object")
    metadata = data.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: 'metadata' must be an object")
    for name, shard in data["weight_map"].items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
            raise SafetensorsError(f"{path}: tensor {name!r} maps to {shard!r}, not a plain file name in this directory")
    return ShardIndex(dict(data["weight_map"]), dict(metadata))


def write_index(directory: str | os.PathLike, weight_map: Mapping[str, str], total_size: int,
                metadata: Mapping | None = None) -> Path:
    """Write `model.safetensors.index.json` atomically (temp file, fsync, rename); returns its path."""
    path = Path(directory) / INDEX_FILE
    body = {"metadata": {**(metadata or {}), "total_size": int(total_size)}, "weight_map": dict(weight_map)}
    return write_bytes_atomic(path, (json.dumps(body, indent=2) + "\n").encode())


class CheckpointReader:
    """All tensors of a checkpoint directory (sharded with an index, or one `model.safetensors`)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._readers: dict[str, SafetensorsReader] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """Open every shard and cross-check it with the index."""
        index_path = self.directory / INDEX_FILE
        if index_path.exists():
            self.index = read_index(index_path)
        elif (self.directory / SINGLE_FILE).exists():
            with SafetensorsReader(self.directory / SINGLE_FILE) as single:
                self.index = ShardIndex({name: SINGLE_FILE for name in single.names()})
        else:
            raise SafetensorsError(f"{self.directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        for shard in self.index.shards:
            if not (self.directory / shard).is_file():
                first = next(n for n, s in self.index.weight_map.items() if s == shard)
                raise SafetensorsError(f"{self.directory}: shard {shard!r} (holding {first!r} and others) is missing")
            self._readers[shard] = SafetensorsReader(self.directory / shard)
        for name, shard in self.index.weight_map.items():
            if name not in self._readers[shard]:
                raise SafetensorsError(f"{self.directory / shard}: tensor {name!r} is listed in the index but absent")
        for shard, reader in self._readers.items():
            for name in reader.names():
                if self.index.weight_map.get(name) != shard:
                    raise SafetensorsError(f"{reader.path}: tensor {name!r} is not mapped to this shard by the index")

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every shard."""
        for reader in self._readers.values():
            reader.close()

    def names(self) -> list[str]:
        """Tensor names in index order."""
        return list(self.index.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.index.weight_map

    def shard_of(self, name: str) -> str:
        """The shard file holding a tensor."""
        if name not in self.index.weight_map:
            raise SafetensorsError(f"{self.directory}: no tensor named {name!r}")
        return self.index.weight_map[name]

    def reader(self, shard: str) -> SafetensorsReader:
        """The open reader of one shard."""
        return self._readers[shard]

    def info(self, name: str) -> TensorInfo:
        """Header entry of a tensor."""
        return self._readers[self.shard_of(name)].info(name)

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor."""
        return self._readers[self.shard_of(name)].read(name)

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of a tensor."""
        return self._readers[self.shard_of(name)].read_rows(name, start, stop, out)

    @property
    def total_size(self) -> int:
        """Sum of all tensors' data bytes (what `metadata.total_size` should say)."""
        return sum(r.info(n).nbytes for r in self._readers.values() for n in r.names())
