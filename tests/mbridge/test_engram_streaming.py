"""Engram tables leave `DSV41Bridge`'s export in row chunks (`RowChunk`), as they come in on import: the saved
release is byte-identical for parameter, host FP8 and host float tables, and the largest tensor materialised
while an Engram chunk is produced is one chunk's worth, not the table's (measured with a dispatch mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4flash.release.quant_plan import scale_name
from dsv4flash_bridge.sharded import CheckpointReader
from dsv4flash_bridge.synthetic import write_release_checkpoint

pytestmark = [pytest.mark.upstream]
ENGRAM = "layers.1.engram.embed.weight"


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """The tiny config as a 2-shard release checkpoint."""
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=2, seed=5)


class LargestTensor(TorchDispatchMode):
    """Records the byte size of the largest tensor any op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def measured(stream):
    """(name, value, largest bytes materialised while producing it) for each item of an export stream."""
    it = iter(stream)
    while True:
        mode = LargestTensor()
        with mode:
            try:
                name, value = next(it)
            except StopIteration:
                return
        yield name, value, mode.largest


def build(mbridge, release, table_dtype):
    """AutoBridge + a tiny Megatron model loaded from the release; Engram as a parameter (None) or host table."""
    from megatron.bridge import AutoBridge
    from megatron.core.transformer.spec_utils import ModuleSpec

    from dsv4flash.integrations.mcore.engram import PinnedEngram

    auto = AutoBridge(mbridge.ReleasePretrained(release))
    provider = mbridge.provider_for(release)
    if table_dtype is not None:
        provider.engram = ModuleSpec(module=PinnedEngram, params={"table_dtype": table_dtype})
    model = provider.provide()
    auto.load_hf_weights([model])
    return auto, model


@pytest.mark.parametrize("table_dtype", [None, torch.float8_e4m3fn, torch.float32],
                         ids=["parameter", "host_fp8", "host_fp32"])
def test_engram_tables_export_in_row_chunks_bit_exactly_with_one_chunk_of_memory(mbridge, mcore, release,
                                                                               tmp_path, monkeypatch, table_dtype):
    from dsv4flash.integrations.mbridge.bridge import DSV41Bridge

    with CheckpointReader(release) as ckpt:
        rows, width = ckpt.info(ENGRAM).shape
    step = rows // 7 + 1  # 7 chunks, the last one short
    monkeypatch.setattr(DSV41Bridge, "engram_rows_per_chunk", step)
    auto, model = build(mbridge, release, table_dtype)
    items = list(measured(auto.export_hf_weights([model], show_progress=False)))
    chunks = [(value, largest) for name, value, largest in items if name == ENGRAM]
    assert all(isinstance(v, mbridge.RowChunk) for v, _ in chunks)
    assert [v.start for v, _ in chunks] == list(range(0, rows, step)) and {v.total for v, _ in chunks} == {rows}
    assert [v.start for n, v, _ in items if n == scale_name(ENGRAM)] == list(range(0, rows, step))
    chunk_fp32 = step * width * 4
    table_fp32 = rows * width * 4
    largest = max(largest for _, largest in chunks[1:])  # the first chunk's next() also runs the stream before it
    assert largest <= chunk_fp32 < table_fp32 // 6, (largest, chunk_fp32, table_fp32)
    mbridge.save_release(((n, v) for n, v, _ in items), release, tmp_path / "out")
    for path in release.iterdir():
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes(), path.name


def test_save_release_refuses_chunks_out_of_order_or_short(mbridge, release, tmp_path):
    from dsv4flash.integrations.mbridge.checkpoint import RowChunk
    from dsv4flash_bridge.convert_common import ConvertError

    with CheckpointReader(release) as ckpt:
        table = ckpt.read(ENGRAM)
    rows = table.shape[0]
    with pytest.raises(ConvertError, match=f"{ENGRAM}: row chunk at 8 of {rows} rows, expected row 0"):
        mbridge.save_release([(ENGRAM, RowChunk(table[8:16], 8, rows))], release, tmp_path / "a")
    with pytest.raises(ConvertError, match=f"{ENGRAM}: the export stream ended after 8 of its {rows} rows"):
        mbridge.save_release([(ENGRAM, RowChunk(table[:8], 0, rows))], release, tmp_path / "b")
    with pytest.raises(ConvertError, match=f"{ENGRAM}: exported twice"):
        mbridge.save_release([(ENGRAM, table), (ENGRAM, RowChunk(table[:8], 0, rows))], release, tmp_path / "c")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_host_tables_import_through_megatron_bridges_row_reads(mbridge, mcore, release, monkeypatch):
    """With DSV41-MBRIDGE-003 applied (`register()`), `_fill_table` reads rows via `StateDict.load_rows`, which
    reaches `ReleaseStateSource.load_rows` (positioned reads), one call per chunk of the weight and its scale."""
    from dsv4flash.integrations.mbridge.bridge import DSV41Bridge
    from dsv4flash.integrations.mbridge.checkpoint import ReleaseStateSource

    with CheckpointReader(release) as ckpt:
        rows = ckpt.info(ENGRAM).rows
    step = rows // 3 + 1
    monkeypatch.setattr(DSV41Bridge, "engram_rows_per_chunk", step)
    calls, stock = [], ReleaseStateSource.load_rows
    monkeypatch.setattr(ReleaseStateSource, "load_rows",
                        lambda self, key, start, stop: calls.append((key, start, stop)) or stock(self, key, start, stop))
    build(mbridge, release, torch.float8_e4m3fn)
    want = [(start, min(rows, start + step)) for start in range(0, rows, step)]
    assert [(a, b) for key, a, b in calls if key == ENGRAM] == want
    assert [(a, b) for key, a, b in calls if key == scale_name(ENGRAM)] == want
