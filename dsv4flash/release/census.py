"""Tensor census: the release-layout tensors of a config, derived from the reference model on `meta`.

The census is not a separate formula: it is the reference model's own state (release names) run through
the quantization plan, so a model change that drifts from the release shows up here first.
"""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import torch

from dsv4flash.config import DSV41FlashConfig, load_config
from dsv4flash.release.quant_plan import StoredTensor, stored_layout

__all__ = ["census", "format_tsv", "parse_tsv", "checkpoint_census", "diff_census", "CensusError"]


class CensusError(ValueError):
    """A checkpoint or census file that cannot be read."""


def logical_shapes(cfg: DSV41FlashConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of the reference model (release name -> logical shape), built on meta."""
    from dsv4flash.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg, device="meta", seed=None)
    return {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}


@functools.lru_cache(maxsize=8)
def _census_cached(cfg_json: str) -> tuple[StoredTensor, ...]:
    cfg = DSV41FlashConfig.from_hf(json.loads(cfg_json))
    rows = [stored for name, shape in logical_shapes(cfg).items() for stored in stored_layout(name, shape)]
    return tuple(sorted(rows, key=lambda r: r.name.encode()))  # LC_ALL=C order


def census(cfg: DSV41FlashConfig | str = "flash") -> list[StoredTensor]:
    """The release-layout census of a config: name, stored dtype, on-disk shape; sorted by name bytes."""
    return list(_census_cached(load_config(cfg).to_json()))


def format_tsv(rows: list[StoredTensor]) -> str:
    """`name<TAB>dtype<TAB>d0,d1,...` lines, the format of `release_tensors.tsv`."""
    return "".join(f"{r.name}\t{r.dtype}\t{','.join(map(str, r.shape))}\n" for r in rows)


def parse_tsv(text: str, source: str = "<tsv>") -> list[StoredTensor]:
    """Parse census TSV text; malformed lines are an error naming the line."""
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split("\t")
        if len(parts) != 3:
            raise CensusError(f"{source}:{lineno}: expected name<TAB>dtype<TAB>shape, got {line!r}")
        try:
            shape = tuple(int(d) for d in parts[2].split(",")) if parts[2] else ()
        except ValueError:
            raise CensusError(f"{source}:{lineno}: bad shape {parts[2]!r}") from None
        rows.append(StoredTensor(parts[0], parts[1], shape))
    return rows


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise CensusError(f"{path}: truncated safetensors file (no header length)")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise CensusError(f"{path}: implausible safetensors header length {length}")
        raw = fh.read(length)
    if len(raw) != length:
        raise CensusError(f"{path}: truncated safetensors header ({len(raw)} of {length} bytes)")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as err:
        raise CensusError(f"{path}: safetensors header is not JSON ({err})") from None


def checkpoint_census(directory: str | Path) -> list[StoredTensor]:
    """The census of a checkpoint directory, read from its safetensors headers only (no tensor data)."""
    directory = Path(directory)
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CensusError(f"{directory}: no *.safetensors files")
    rows = []
    for shard in shards:
        for name, info in _safetensors_header(shard).items():
            if name != "__metadata__":
                rows.append(StoredTensor(name, info["dtype"], tuple(info["shape"])))
    return sorted(rows, key=lambda r: r.name.encode())


def diff_census(expected: list[StoredTensor], actual: list[StoredTensor]) -> list[str]:
    """Human-readable differences: missing, unexpected, and dtype/shape mismatches (empty when equal)."""
    exp = {r.name: r for r in expected}
    act = {r.name: r for r in actual}
    out = [f"missing: {n} ({exp[n].dtype} {list(exp[n].shape)})" for n in sorted(exp.keys() - act.keys())]
    out += [f"unexpected: {n} ({act[n].dtype} {list(act[n].shape)})" for n in sorted(act.keys() - exp.keys())]
    for name in sorted(exp.keys() & act.keys()):
        e, a = exp[name], act[name]
        if (e.dtype, e.shape) != (a.dtype, a.shape):
            out.append(f"mismatch: {name}: expected {e.dtype} {list(e.shape)}, found {a.dtype} {list(a.shape)}")
    return out
