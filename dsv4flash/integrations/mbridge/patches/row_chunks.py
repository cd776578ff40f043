"""Runtime twin of DSV41-MBRIDGE-003: row reads on `StateSource`, row-chunked tensors in `save_generator`.

Why: megatron-bridge 0.6.2's `StateSource` reads only whole tensors, and `SafeTensorsStateSource.save_generator`
buffers each shard whole and writes it with `safetensors.torch.save_file` (one bytes object per shard), so a
table of hundreds of millions of rows cannot be imported or exported without holding it whole in memory.

How: the patch's new module `megatron.bridge.models.hf_pretrained.row_chunks` (`TensorRowChunk`,
`RowChunkSpool`, `save_safetensors`) is executed from the patch's own file (`_upstream/`, byte-identical);
`get_shape` / `load_rows` are added to `StateSource`, `StateDict` and `SafeTensorsStateSource` as in the patch;
`save_generator` is the stock method run on the spooled stream while `safetensors.torch.save_file` is
`save_safetensors` (identical for shards without spooled tensors), which is the patch's only change to its body.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mbridge.patches import import_bridge, mbridge_twin
from dsv4flash.integrations.mcore.patches import provide_upstream_files

UPSTREAM_SOURCES = Path(__file__).resolve().parent / "_upstream"
MODULE = "megatron.bridge.models.hf_pretrained.row_chunks"
SOURCE = "src/megatron/bridge/models/hf_pretrained/row_chunks.py"
_STATE = "megatron.bridge.models.hf_pretrained.state"
TOUCHES = tuple(f"{_STATE}.{owner}.{name}" for owner in ("StateSource", "StateDict", "SafeTensorsStateSource")
                for name in ("get_shape", "load_rows")) + (f"{_STATE}.SafeTensorsStateSource.save_generator",) + tuple(
    f"{MODULE}.{name}" for name in ("TensorRowChunk", "RowChunkSpool", "save_safetensors"))


def upstream_has_row_chunks() -> bool:
    """Probe: does a dict-backed `StateSource` read a row range, and does the row-chunk module exist?"""
    import_bridge()
    import importlib.util

    from megatron.bridge.models.hf_pretrained.state import DictStateSource

    table = torch.arange(6.0).reshape(3, 2)
    load_rows = getattr(DictStateSource({"t": table}), "load_rows", None)
    if load_rows is None or importlib.util.find_spec(MODULE) is None:
        return False
    return torch.equal(load_rows("t", 1, 3), table[1:3])


def _methods(state, rc):
    """The patch's new methods (each a delegation to `row_chunks`, as in the patch)."""

    def source_get_shape(self, key):
        """Returns the shape of a tensor (this default loads it)."""
        return tuple(self[key].shape)

    def source_load_rows(self, key, start, stop):
        """Loads rows [start, stop) of a tensor (this default loads it whole)."""
        return self[key][start:stop]

    def dict_get_shape(self, key):
        """Returns the shape of a tensor without loading it, when the source can."""
        return self.source.get_shape(key)

    def dict_load_rows(self, key, start, stop):
        """Loads rows [start, stop) of a tensor, without the rest of it when the source can."""
        return self.source.load_rows(key, start, stop)

    def file_containing(self, key):
        filename = self.key_to_filename_map.get(key)
        if filename is None:
            raise KeyError(f"Key not found in safetensors from {self.model_name_or_path}: {key}")
        return self.path / filename

    def safetensors_get_shape(self, key):
        """Returns the shape of a tensor from its shard header, without loading it."""
        return rc.safetensors_tensor_shape(file_containing(self, key), key)

    def safetensors_load_rows(self, key, start, stop):
        """Reads rows [start, stop) of a tensor from its shard, without reading the other rows."""
        return rc.read_safetensors_rows(file_containing(self, key), key, start, stop)

    return {state.SafeTensorsStateSource: {"get_shape": safetensors_get_shape, "load_rows": safetensors_load_rows},
            state.StateSource: {"get_shape": source_get_shape, "load_rows": source_load_rows},
            state.StateDict: {"get_shape": dict_get_shape, "load_rows": dict_load_rows}}


def _save_generator(rc, stock):
    """`save_generator` that spools row chunks and writes shards holding spooled tensors from disk."""
    import safetensors.torch

    @contextlib.contextmanager
    def spooled_shard_writer():
        # stock imports save_file at call time; save_safetensors calls the original for plain shards
        original = safetensors.torch.save_file
        safetensors.torch.save_file = rc.save_safetensors
        try:
            yield
        finally:
            safetensors.torch.save_file = original

    def refuse_chunks(generator):
        for name, tensor in generator:
            if isinstance(tensor, rc.TensorRowChunk):
                raise TypeError(f"Tensor '{name}' was yielded as a TensorRowChunk, which distributed_save does "
                                "not support; save with distributed_save=False.")
            yield name, tensor

    def save_generator(self, generator, output_path, strict=True, distributed_save=False, save_every_n_ranks=1,
                       ignored_source_key_prefixes=None):
        """Stock `save_generator`; a generator may yield `TensorRowChunk`s (spooled, written from disk)."""
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        if distributed_save or rank != 0:  # stock drains the generator on other ranks
            generator = refuse_chunks(generator) if distributed_save else generator
            return stock(self, generator, output_path, strict, distributed_save, save_every_n_ranks,
                         ignored_source_key_prefixes)
        spool = rc.RowChunkSpool(output_path)
        try:
            with spooled_shard_writer():
                return stock(self, spool.stream(generator), output_path, strict, distributed_save,
                             save_every_n_ranks, ignored_source_key_prefixes)
        finally:
            for name, (done, total) in spool.incomplete().items():
                print(f"Warning: tensor '{name}' was not saved: its row chunks stopped after {done} of {total} rows.")

    return save_generator


@mbridge_twin(
    patch_id="DSV41-MBRIDGE-003",
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_ROW_CHUNKS",
    tests=("tests/patches/test_mbridge_row_chunks.py",),
    upstream_has_it=upstream_has_row_chunks,
)
def install(patcher: Patcher) -> None:
    """Provide `row_chunks`, add the row-read methods, wrap `SafeTensorsStateSource.save_generator`."""
    import sys

    from megatron.bridge.models.hf_pretrained import state

    provide_upstream_files(patcher, {MODULE: SOURCE}, root=UPSTREAM_SOURCES)
    rc = sys.modules[MODULE]
    for owner, methods in _methods(state, rc).items():  # subclass first: `add` refuses an inherited name
        for name, fn in methods.items():
            patcher.add(owner, name, fn)
    stock = state.SafeTensorsStateSource.save_generator
    patcher.replace(state.SafeTensorsStateSource, "save_generator", _save_generator(rc, stock))
