# Copyright (c) 2025, NVIDIA CORPORATION.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Row-chunked reads and writes of large 2-D (or higher) tensors in safetensors checkpoints.

A tensor such as an embedding or lookup table with hundreds of millions of rows should never be held whole
in host memory during conversion. On import, ``StateSource.load_rows`` reads a row range of one tensor
(``read_safetensors_rows`` for safetensors shards). On export, a weight generator may yield
``TensorRowChunk`` objects in place of a tensor; ``RowChunkSpool`` appends each chunk to a spool file as it
arrives, so only one chunk is held at a time, and ``save_safetensors`` writes a shard whose tensors may be
spooled by copying the spool files block by block behind the header.
"""

import json
import os
import shutil
import struct
import tempfile
import weakref
from pathlib import Path
from typing import Dict, Iterable, Iterator, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file as _save_file


# torch dtype -> safetensors dtype name (the names of the safetensors format specification).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
if hasattr(torch, "float8_e8m0fnu"):
    _SAFETENSORS_DTYPES[torch.float8_e8m0fnu] = "F8_E8M0"

_COPY_BLOCK_BYTES = 64 << 20


class TensorRowChunk(NamedTuple):
    """Rows ``[start, start + rows.shape[0])`` of a tensor with ``total`` rows, yielded in an export stream.

    A generator passed to ``SafeTensorsStateSource.save_generator`` may yield ``(name, TensorRowChunk)``
    pairs instead of ``(name, tensor)``: the chunks of one tensor must come in row order and cover all of
    its rows; chunks of different tensors may interleave.
    """

    rows: torch.Tensor
    start: int
    total: int


class SpooledTensor:
    """A tensor assembled from row chunks in a spool file (what ``save_safetensors`` writes from disk)."""

    def __init__(self, path: Path, dtype: torch.dtype, shape: Tuple[int, ...]):
        self.path = path
        self.dtype = dtype
        self.shape = torch.Size(shape)

    def numel(self) -> int:
        """Number of elements of the assembled tensor."""
        return self.shape.numel()

    def element_size(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def is_contiguous(self) -> bool:
        """Spooled rows are stored densely in row-major order."""
        return True

    def contiguous(self) -> "SpooledTensor":
        """Already contiguous."""
        return self

    def load(self) -> torch.Tensor:
        """Read the assembled tensor into memory (for small tensors and tests)."""
        data = bytearray(self.path.read_bytes())
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).reshape(self.shape)


class RowChunkSpool:
    """Turns a stream of ``(name, tensor | TensorRowChunk)`` into ``(name, tensor | SpooledTensor)``.

    Row chunks are appended to one spool file per tensor under a private directory inside ``directory``;
    a tensor is yielded as a ``SpooledTensor`` once its last row has arrived. The directory is removed when
    the spool is garbage collected (the writer deletes each spool file as it copies it).
    """

    def __init__(self, directory: Union[str, Path]):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=".row-chunks-", dir=directory))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        self._pending: Dict[str, Tuple[Path, torch.dtype, Tuple[int, ...], int]] = {}
        self._done: set = set()

    def stream(self, generator: Iterable[Tuple[str, object]]) -> Iterator[Tuple[str, object]]:
        """Pass whole tensors through; spool row chunks and yield each chunked tensor once complete."""
        for name, tensor in generator:
            if not isinstance(tensor, TensorRowChunk):
                yield name, tensor
                continue
            spooled = self.add(name, tensor)
            if spooled is not None:
                yield name, spooled

    def add(self, name: str, chunk: TensorRowChunk) -> Optional[SpooledTensor]:
        """Append ``chunk`` to its tensor's spool file; return the ``SpooledTensor`` after its last row."""
        rows = chunk.rows.detach().cpu().contiguous()
        if rows.dim() < 1:
            raise ValueError(f"Row chunk of tensor '{name}' must have at least one dimension, got a scalar.")
        if name in self._done:
            raise ValueError(f"Tensor '{name}' received a row chunk after all of its {chunk.total} rows.")
        if rows.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"Row chunk of tensor '{name}' has dtype {rows.dtype}, which safetensors cannot store.")
        if name not in self._pending:
            path = self.directory / f"{len(self._pending) + len(self._done)}.rows"
            path.touch()
            self._pending[name] = (path, rows.dtype, (int(chunk.total), *rows.shape[1:]), 0)
        path, dtype, shape, done = self._pending[name]
        if chunk.start != done or chunk.total != shape[0]:
            raise ValueError(
                f"Row chunk of tensor '{name}' starts at row {chunk.start} of {chunk.total}, expected row {done} "
                f"of {shape[0]} (chunks must arrive in row order with a constant total)."
            )
        if rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:]:
            raise ValueError(
                f"Row chunk of tensor '{name}' is {rows.dtype} {tuple(rows.shape)}, expected {dtype} rows of "
                f"shape {shape[1:]}."
            )
        if done + rows.shape[0] > shape[0]:
            raise ValueError(f"Row chunk of tensor '{name}' ends at row {done + rows.shape[0]}, past its {shape[0]} rows.")
        with open(path, "ab") as f:
            f.write(rows.reshape(-1).view(torch.uint8).numpy().data)
        done += rows.shape[0]
        if done < shape[0]:
            self._pending[name] = (path, dtype, shape, done)
            return None
        del self._pending[name]
        self._done.add(name)
        return SpooledTensor(path, dtype, shape)

    def incomplete(self) -> Dict[str, Tuple[int, int]]:
        """Tensors whose chunks stopped early: name -> (rows received, total rows)."""
        return {name: (done, shape[0]) for name, (_, _, shape, done) in self._pending.items()}


def save_safetensors(
    tensors: Mapping[str, Union[torch.Tensor, SpooledTensor]],
    path: Union[str, Path],
    metadata: Optional[Dict[str, str]] = None,
) -> None:
    """Write one safetensors file; spooled tensors are copied from their spool files block by block.

    Without spooled tensors this is ``safetensors.torch.save_file``. With them, the header is built from
    dtypes and shapes, in-memory tensors are written from their buffers and spool files are copied (then
    deleted), into ``path`` + ``.partial``, renamed to ``path`` once complete.
    """
    path = Path(path)
    if not any(isinstance(t, SpooledTensor) for t in tensors.values()):
        _save_file(dict(tensors), path, metadata=metadata)
        return
    header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"Tensor '{name}' has dtype {tensor.dtype}, which safetensors cannot store.")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name in names:
                tensor = tensors[name]
                if isinstance(tensor, SpooledTensor):
                    with open(tensor.path, "rb") as src:
                        shutil.copyfileobj(src, f, _COPY_BLOCK_BYTES)
                else:
                    f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    for tensor in tensors.values():
        if isinstance(tensor, SpooledTensor):
            tensor.path.unlink(missing_ok=True)


def read_safetensors_rows(file_path: Union[str, Path], key: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of tensor ``key`` in one safetensors file, without reading the rest of it."""
    with safe_open(str(file_path), framework="pt", device="cpu") as f:
        tensor_slice = f.get_slice(key)
        rows = tensor_slice.get_shape()[0] if tensor_slice.get_shape() else 0
        if not 0 <= start <= stop <= rows:
            raise IndexError(f"Rows [{start}, {stop}) out of range for tensor '{key}' with {rows} rows in {file_path}.")
        return tensor_slice[start:stop]


def safetensors_tensor_shape(file_path: Union[str, Path], key: str) -> Tuple[int, ...]:
    """Shape of tensor ``key`` in one safetensors file, read from the header."""
    with safe_open(str(file_path), framework="pt", device="cpu") as f:
        return tuple(f.get_slice(key).get_shape())
