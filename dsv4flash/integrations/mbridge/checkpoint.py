"""A release checkpoint as Megatron-Bridge sees an HF checkpoint, and writing one back in the release layout.

`ReleasePretrained(path)` is a `PreTrainedCausalLM` whose `.state` reads the release shards through the
bridge's validating reader (`dsv4flash_bridge.sharded.CheckpointReader`: F8_E4M3 / F8_E8M0 / I8 as stored,
positioned reads, clear errors) and whose `.config` comes from `config.json` without asking transformers,
which has no `deepseek_v41` model type. `AutoBridge(ReleasePretrained(path))` then dispatches to the
registered V4.1 bridge. `save_release(weights, source, dst)` writes a stream of (release name, stored
tensor) pairs, such as `DSV41Bridge.stream_weights_megatron_to_hf` yields, into the source's shard headers,
so an unchanged model round-trips to byte-identical shards. A tensor may also arrive as consecutive
`RowChunk`s (the bridge streams Engram tables so), each written in place as it comes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple

import torch
from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
from megatron.bridge.models.hf_pretrained.state import StateDict, StateSource
from transformers import PretrainedConfig

from dsv4flash.config import DSV41FlashConfig
from dsv4flash_bridge.convert_common import ConvertError, copy_rows, staging
from dsv4flash_bridge.safetensors_io import SafetensorsWriter, TensorInfo, all_or_nothing
from dsv4flash_bridge.sharded import CheckpointReader

__all__ = ["ReleaseStateSource", "ReleasePretrained", "RowChunk", "save_release"]


class RowChunk(NamedTuple):
    """Rows [start, start + len(rows)) of a stored tensor of `total` rows, in an export stream.

    Not a tensor on purpose: a consumer that expects whole tensors fails on it instead of keeping one chunk.
    """

    rows: torch.Tensor
    start: int
    total: int


class ReleaseStateSource(StateSource):
    """Megatron-Bridge `StateSource` over a release-layout directory (tensors exactly as stored)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = CheckpointReader(self.path)

    def get_all_keys(self) -> List[str]:
        """Every tensor name, scales included."""
        return self.reader.names()

    def load_tensors(self, keys: List[str]) -> Dict[str, torch.Tensor]:
        """The named tensors that exist (Megatron-Bridge drops absent keys itself)."""
        return {k: self.reader.read(k) for k in keys if k in self.reader}

    def get_shape(self, key: str) -> tuple[int, ...]:
        """Stored shape, from the shard header (Megatron-Bridge's row-read API, DSV41-MBRIDGE-003)."""
        return tuple(self.reader.info(key).shape)

    def load_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as stored, read in place (Megatron-Bridge's row-read API, DSV41-MBRIDGE-003)."""
        return self.reader.read_rows(key, start, stop)

    def info(self, key: str) -> TensorInfo:
        """Stored dtype and shape of a tensor, without reading it."""
        return self.reader.info(key)

    def close(self) -> None:
        """Close the shard files."""
        self.reader.close()


class ReleasePretrained(PreTrainedCausalLM):
    """A release-layout V4.1 checkpoint directory as a Megatron-Bridge pretrained wrapper (config + lazy state)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: a release checkpoint needs its config.json")
        super().__init__(model_name_or_path=str(path), device="cpu")
        data = json.loads(config_path.read_text(encoding="utf-8"))
        self.dsv4 = DSV41FlashConfig.from_hf(data, name=path.name, source=str(config_path))
        self._config = PretrainedConfig.from_dict(data)
        self._state_dict_accessor = StateDict(ReleaseStateSource(path))


def save_release(weights: Iterable[tuple[str, torch.Tensor]], source: str | Path, dst: str | Path, *,
                 copy_missing: bool = True, overwrite: bool = False, chunk_bytes: int = 64 << 20) -> Path:
    """Write (release name, stored tensor) pairs into DST with SOURCE's shard headers, index and config.json
    verbatim. Each tensor may arrive at most once, with its stored dtype and shape, or as `RowChunk`s in row
    order, written as they come (the largest tensor held is then one chunk). Tensors the stream lacks
    (the part the Megatron model does not hold: DSpark `mtp.*`) are copied
    from SOURCE byte for byte when `copy_missing`, else they are an error; a weight and its `.scale` must
    come from the same side. Atomic: built in DST.partial, renamed at the end, removed on any error."""
    source, dst = Path(source), Path(dst)
    with CheckpointReader(source) as src, staging(dst, overwrite, False) as out:
        writers = {s: SafetensorsWriter.from_header(out / s, src.reader(s).header_blob) for s in src.index.shards}
        seen: set[str] = set()
        rows_done: dict[str, int] = {}  # chunked tensors: rows written so far
        with all_or_nothing(writers):
            for name, tensor in weights:
                if name not in src:
                    raise ConvertError(f"{name}: not a tensor of the release layout in {source}")
                if isinstance(tensor, RowChunk):
                    _write_chunk(writers[src.shard_of(name)], name, tensor, src.info(name), seen, rows_done)
                    continue
                if name in seen:
                    raise ConvertError(f"{name}: exported twice")
                seen.add(name)
                writers[src.shard_of(name)].write(name, tensor.detach().cpu().contiguous())
            partial = [n for n, done in rows_done.items() if done != src.info(n).rows]
            if partial:
                raise ConvertError(f"{partial[0]}: the export stream ended after {rows_done[partial[0]]} of its "
                                   f"{src.info(partial[0]).rows} rows")
            missing = [n for n in src.names() if n not in seen]
            if missing and not copy_missing:
                raise ConvertError(f"{len(missing)} release tensors were not exported, e.g. {missing[0]}")
            for name in missing:
                partner = _partner(name)
                if partner in seen:
                    raise ConvertError(f"{name}: not exported, but {partner} was (a weight and its scale go together)")
                info = src.info(name)
                copy_rows(src, info, lambda t, n=name: writers[src.shard_of(n)].write_rows(n, t), chunk_bytes)
        for path in sorted(source.iterdir()):  # index.json and config.json verbatim, tokenizer files too
            if path.is_file() and not path.name.endswith(".safetensors"):
                shutil.copy2(path, out / path.name)
    return dst


def _write_chunk(writer, name: str, chunk: RowChunk, info: TensorInfo, seen: set, rows_done: dict) -> None:
    """Write the next row chunk of a tensor; chunks must come in order and cover the stored rows."""
    done = rows_done.get(name)
    if done is None and name in seen:
        raise ConvertError(f"{name}: exported twice")
    done = done or 0
    if chunk.start != done or chunk.total != info.rows:
        raise ConvertError(f"{name}: row chunk at {chunk.start} of {chunk.total} rows, expected row {done} of "
                           f"{info.rows} (chunks must arrive in order)")
    seen.add(name)
    writer.write_rows(name, chunk.rows.detach().cpu().contiguous())
    rows_done[name] = done + chunk.rows.shape[0]


def _partner(name: str) -> str:
    """`.weight` <-> `.scale` sibling name (the name itself for other tensors)."""
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".weight"
    if name.endswith(".weight"):
        return name[: -len(".weight")] + ".scale"
    return name
