"""DSV41-MBRIDGE-003: megatron-bridge's checkpoint reader reads row ranges, `save_generator` takes row chunks.

The stock test shows 0.6.2 has neither (no `load_rows`; a chunk in the export stream breaks `save_file`). The
`patch_form` tests run twice: with the runtime twin on the installed megatron-bridge, and in a subprocess on a
copy of the pinned release with the format-patch applied; both must pass and record identical values, among
them the bytes of every written shard. safetensors itself (`safe_open`) is the oracle for what was written.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import weakref
from pathlib import Path

import pytest
import torch

PATCH_ID = "DSV41-MBRIDGE-003"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
if importlib.util.find_spec("megatron.bridge") is None:  # not imported here: it needs the CPU shim first
    pytest.skip("megatron-bridge is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def state():
    """megatron-bridge's hf_pretrained.state (imported through the CPU import shim)."""
    from tests.mbridge import shim

    shim.install()
    from megatron.bridge.models.hf_pretrained import state

    return state


@pytest.fixture
def checkpoint(tmp_path):
    """An indexed two-shard checkpoint: an FP8 table and its per-row scales, a bf16 tensor next to the scales."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"engram.embed.weight": (torch.randn(53, 16, generator=g) * 8).to(torch.float8_e4m3fn),
               "engram.embed.scale": torch.rand(53, 1, generator=g),
               "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16)}
    src = tmp_path / "src"
    src.mkdir()
    save_file({"engram.embed.weight": tensors["engram.embed.weight"]}, src / SHARDS[0])
    save_file({k: tensors[k] for k in ("engram.embed.scale", "norm.weight")}, src / SHARDS[1])
    weight_map = {"engram.embed.weight": SHARDS[0], "engram.embed.scale": SHARDS[1], "norm.weight": SHARDS[1]}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return src, tensors


def chunks(tensor_row_chunk, tensor, step):
    """The rows of `tensor` as `TensorRowChunk`s of `step` rows (copies: a chunk owns its memory)."""
    for r0 in range(0, tensor.shape[0], step):
        yield tensor_row_chunk(tensor[r0:r0 + step].clone(), r0, tensor.shape[0])


def read(path, key):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        return f.get_tensor(key)


def test_twin_executes_the_patchs_own_file():
    from dsv4flash.integrations.mbridge.patches.row_chunks import SOURCE, UPSTREAM_SOURCES
    from dsv4flash.patchseries.series import load_series

    patch = load_series(ROOT / "patches")["megatron-bridge"].by_id()[PATCH_ID]
    hunk = patch.diff.split(f"--- /dev/null\n+++ b/{SOURCE}\n", 1)[1].split("\ndiff --git", 1)[0]
    added = "".join(line[1:] + "\n" for line in hunk.splitlines()[1:] if line.startswith("+"))
    from dsv4flash.integrations.mbridge.patches import deepseek_v41_bridge, grouped_lora

    v41 = {f"{deepseek_v41_bridge.FOLDER}/{leaf}.py" for leaf in ("__init__", *deepseek_v41_bridge.SUBMODULES)}
    shipped = {SOURCE, grouped_lora.SOURCE, *v41}  # every file the megatron-bridge twins execute from _upstream/
    assert {str(p.relative_to(UPSTREAM_SOURCES)) for p in UPSTREAM_SOURCES.rglob("*.py")} == shipped
    assert added == (UPSTREAM_SOURCES / SOURCE).read_text(), f"{SOURCE}: the twin's copy differs from the patch"


def test_stock_release_has_no_row_reads_and_no_chunked_export(state, checkpoint, tmp_path):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    src, tensors = checkpoint
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-bridge {twin.installed_version()} already has {PATCH_ID}")
        source = state.SafeTensorsStateSource(src)
        assert not hasattr(source, "load_rows")
        table = tensors["engram.embed.weight"]
        stream = [("norm.weight", tensors["norm.weight"]), ("engram.embed.scale", tensors["engram.embed.scale"]),
                  ("engram.embed.weight", (table[:20], 0, 53))]  # what a chunk is without the patch: a tuple
        with pytest.raises((AttributeError, TypeError, ValueError)):
            source.save_generator(iter(stream), tmp_path / "out")


def test_row_reads_and_shapes_come_from_the_shards(patch_form, state, checkpoint):
    src, tensors = checkpoint
    hf = state.StateDict(state.SafeTensorsStateSource(src))
    table = tensors["engram.embed.weight"]
    assert hf.get_shape("engram.embed.weight") == (53, 16)
    rows = [hf.load_rows("engram.embed.weight", r0, min(53, r0 + 8)) for r0 in range(0, 53, 8)]
    assert all(r.dtype == torch.float8_e4m3fn for r in rows)
    assert torch.equal(torch.cat(rows).view(torch.uint8), table.view(torch.uint8))
    with pytest.raises(IndexError, match=r"Rows \[50, 60\) out of range for tensor 'engram.embed.weight'"):
        hf.load_rows("engram.embed.weight", 50, 60)
    with pytest.raises(KeyError, match="nope.weight"):
        hf.load_rows("nope.weight", 0, 1)
    in_memory = state.StateDict({"t": tensors["engram.embed.scale"]})  # the base class default
    assert in_memory.get_shape("t") == (53, 1)
    assert torch.equal(in_memory.load_rows("t", 3, 9), tensors["engram.embed.scale"][3:9])
    patch_form.record("rows_8_16", hf.load_rows("engram.embed.weight", 8, 16).view(torch.uint8))


def test_export_streams_interleaved_chunks_into_the_source_shards(patch_form, state, checkpoint, tmp_path):
    from megatron.bridge.models.hf_pretrained.row_chunks import TensorRowChunk

    src, tensors = checkpoint
    out = tmp_path / "out"
    held = []

    def stream():  # weight chunk, scale chunk, ...: as a bridge re-encodes a table chunk by chunk
        yield "norm.weight", tensors["norm.weight"]
        pairs = zip(chunks(TensorRowChunk, tensors["engram.embed.weight"], 10),
                    chunks(TensorRowChunk, tensors["engram.embed.scale"], 10))
        for w, s in pairs:
            assert all(ref() is None for ref in held[:-2]), "an earlier row chunk is still held by the writer"
            held.extend((weakref.ref(w.rows), weakref.ref(s.rows)))
            yield "engram.embed.weight", w
            yield "engram.embed.scale", s
            del w, s

    state.SafeTensorsStateSource(src).save_generator(stream(), out)
    for key, want in tensors.items():
        got = read(out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][key], key)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    gc.collect()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in src.iterdir())  # no spool, no .partial
    for shard in SHARDS:
        patch_form.record(shard, torch.frombuffer(bytearray((out / shard).read_bytes()), dtype=torch.uint8))


def test_bad_chunk_streams_are_refused_by_name(patch_form, state, checkpoint, tmp_path):
    from megatron.bridge.models.hf_pretrained.row_chunks import TensorRowChunk

    src, tensors = checkpoint
    table = tensors["engram.embed.weight"]
    source = state.SafeTensorsStateSource(src)
    cases = {
        "gap": ([TensorRowChunk(table[:10], 0, 53), TensorRowChunk(table[20:30], 20, 53)],
                r"'engram.embed.weight' starts at row 20 of 53, expected row 10 of 53"),
        "shape": ([TensorRowChunk(table[:10], 0, 53), TensorRowChunk(table[10:20, :8], 10, 53)],
                  r"'engram.embed.weight' is torch.float8_e4m3fn \(10, 8\), expected torch.float8_e4m3fn rows"),
        "overrun": ([TensorRowChunk(table[:50], 0, 53), TensorRowChunk(table[:10], 50, 53)],
                    r"'engram.embed.weight' ends at row 60, past its 53 rows"),
    }
    for case, (stream, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            source.save_generator(((("engram.embed.weight", c) for c in stream)), tmp_path / case)
    with pytest.raises(TypeError, match="'engram.embed.weight' was yielded as a TensorRowChunk"):
        source.save_generator(iter([("engram.embed.weight", TensorRowChunk(table, 0, 53))]), tmp_path / "d",
                              distributed_save=True)
    short = [("norm.weight", tensors["norm.weight"]), ("engram.embed.scale", tensors["engram.embed.scale"]),
             ("engram.embed.weight", TensorRowChunk(table[:10], 0, 53))]
    with pytest.raises(RuntimeError, match="1 tensors from the original checkpoint were not written"):
        source.save_generator(iter(short), tmp_path / "short")
    assert not (tmp_path / "short" / SHARDS[0]).exists()
    gc.collect()
    patch_form.record("left_behind", sorted(p.name for p in (tmp_path / "short").iterdir()))
