"""Streaming conversion tests on synthetic release-format checkpoints: bit-exact round trip, chunking,
changed weights, resume, and clear errors with no output left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsv4flash.cli import main as cli_main
from dsv4flash.release.quant_plan import QuantRole, StoredTensor, quant_role, scale_name
from dsv4flash_bridge import codecs, convert, importer
from dsv4flash_bridge.codecs import CodecError
from dsv4flash_bridge.convert import ConvertError, export_release, import_release
from dsv4flash_bridge.safetensors_io import SafetensorsError, SafetensorsReader, load_file, save_file
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader
from dsv4flash_bridge.synthetic import write_release_checkpoint

SMALL = dict(progress=False, chunk_bytes=4096)  # many chunks per tensor, dense chunks of 32 rows


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """The tiny config's full census as a 3-shard release-format checkpoint."""
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny", shards=3, seed=1)


def copy_of(path: Path, tmp_path: Path) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(path, tmp_path / path.name))


def files(directory: Path) -> dict[str, bytes]:
    """Top-level file name -> bytes."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def nothing_left(tmp_path: Path, name: str) -> bool:
    """Neither DST nor DST.partial exists."""
    return not (tmp_path / name).exists() and not (tmp_path / f"{name}.partial").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_import_then_export_is_byte_identical(release, tmp_path, dtype):
    summary = import_release(release, tmp_path / "imported", dtype=dtype, verify=True, **SMALL)
    assert "re-encode to their source bytes" in summary.notes[0]
    config = json.loads((tmp_path / "imported" / "config.json").read_text())
    assert "quantization_config" not in config
    summary = export_release(tmp_path / "imported", tmp_path / "exported", verify=True, **SMALL)
    assert "0 weight values differ" in summary.notes[0]
    assert files(tmp_path / "exported") == files(release)  # shards, index and config.json, byte for byte


def test_imported_values_are_the_decoded_weights(release, tmp_path):
    import_release(release, tmp_path / "imported", **SMALL)
    with CheckpointReader(release) as src, CheckpointReader(tmp_path / "imported") as out:
        assert set(out.names()) == {n for n in src.names() if not n.endswith(".scale")}
        for name in out.names():
            role = quant_role(name)
            if role in convert.QUANTIZED:
                want = codecs.decode(role, src.read(name), src.read(scale_name(name)), dtype=torch.bfloat16)
            else:
                want = src.read(name)
            got = out.read(name)
            assert got.dtype == want.dtype and torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name


def test_reads_are_chunked(release, tmp_path, monkeypatch):
    sizes = []
    real = SafetensorsReader._read_into
    monkeypatch.setattr(SafetensorsReader, "_read_into", lambda self, buf, off, info: sizes.append(buf.numel()) or real(self, buf, off, info))
    import_release(release, tmp_path / "imported", **SMALL)
    # Engram tables are 64 wide: a 4 KiB chunk is 32 BF16 rows, i.e. 2 KiB of FP8 per read.
    with CheckpointReader(release) as src:
        largest = max(src.info(n).nbytes for n in src.names())
    assert max(sizes) < largest and max(sizes) <= 32 * 64 * 2 * 4


def test_changed_weights_get_fresh_scales_only_where_changed(release, tmp_path):
    import_release(release, tmp_path / "imported", **SMALL)
    shard = tmp_path / "imported" / json.loads((tmp_path / "imported" / INDEX_FILE).read_text())["weight_map"]["layers.0.attn.wkv.weight"]
    tensors = load_file(shard)
    w = tensors["layers.0.attn.wkv.weight"].clone()
    w[:32, :32] += 0.01  # a merged adapter touching one block
    tensors["layers.0.attn.wkv.weight"] = w
    save_file(tensors, shard, {"format": "pt"})
    summary = export_release(tmp_path / "imported", tmp_path / "exported", verify=True, **SMALL)
    assert "0 weight values differ" not in summary.notes[0]
    with CheckpointReader(release) as a, CheckpointReader(tmp_path / "exported") as b:
        for name in a.names():
            same = torch.equal(a.read(name).view(-1).view(torch.uint8), b.read(name).view(-1).view(torch.uint8))
            if name != "layers.0.attn.wkv.scale":
                assert same == (name != "layers.0.attn.wkv.weight"), name
        sa, sb = a.read("layers.0.attn.wkv.scale").view(torch.uint8), b.read("layers.0.attn.wkv.scale").view(torch.uint8)
        assert torch.equal(sa.flatten()[1:], sb.flatten()[1:])  # only block (0, 0) may move, to its canonical scale
        assert int(sb[0, 0]) == int(codecs.canonical_e8m0(w[:32, :32].float().abs().max(), codecs.E4M3_MAX))
        decoded = codecs.decode(QuantRole.DENSE_FP8, b.read("layers.0.attn.wkv.weight"), b.read("layers.0.attn.wkv.scale"))
        assert torch.equal(decoded[32:], w[32:].float()) and torch.allclose(decoded[:32, :32], w[:32, :32].float(), rtol=0.07, atol=1e-6)


def test_resume_after_a_crash_is_bit_identical(release, tmp_path, monkeypatch):
    real, calls = importer._import_shard, []

    def crash_on_second(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(importer, "_import_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        import_release(release, tmp_path / "resumed", resume=True, **SMALL)
    partial = tmp_path / "resumed.partial"
    assert (partial / calls[0]).exists() and not (tmp_path / "resumed").exists()
    monkeypatch.setattr(importer, "_import_shard", real)
    import_release(release, tmp_path / "resumed", resume=True, **SMALL)
    import_release(release, tmp_path / "clean", **SMALL)
    assert files(tmp_path / "resumed") == files(tmp_path / "clean") and not partial.exists()
    assert files(tmp_path / "resumed" / "release") == files(tmp_path / "clean" / "release")


# ---------------------------------------------------------------------------------------- errors
def damage_scale(directory: Path, name: str, byte: int) -> None:
    """Set the first byte of a scale tensor in place."""
    shard = directory / json.loads((directory / INDEX_FILE).read_text())["weight_map"][name]
    with SafetensorsReader(shard) as reader:
        offset = reader.info(name).start
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(bytes([byte]))


def test_nan_scale_fails_cleanly(release, tmp_path):
    bad = copy_of(release, tmp_path)
    damage_scale(bad, "layers.3.ffn.experts.5.w2.scale", 255)
    with pytest.raises(CodecError, match=r"layers\.3\.ffn\.experts\.5\.w2\.weight: E8M0 scale byte 255"):
        import_release(bad, tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")


def test_truncated_and_lying_shards_fail_cleanly(release, tmp_path):
    bad = copy_of(release, tmp_path)
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(SafetensorsError, match=f"{shard.name}: truncated"):
        import_release(bad, tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__" and header[k]["dtype"] == "BF16" and len(header[k]["shape"]) == 2)
    header[name]["shape"][0] += 1  # the header now claims more bytes than its offsets span
    blob = json.dumps(header).encode()
    shard.write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:])
    with pytest.raises(SafetensorsError, match=f"tensor '{name}' shape .* needs"):
        import_release(bad, tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")


def test_missing_shard_fails_cleanly(release, tmp_path):
    bad = copy_of(release, tmp_path)
    sorted(bad.glob("model-*.safetensors"))[2].unlink()
    with pytest.raises(SafetensorsError, match="model-00003-of-00003.safetensors' .* is missing"):
        import_release(bad, tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")


def test_export_rejects_wrong_shapes_and_missing_tensors(release, tmp_path):
    import_release(release, tmp_path / "imported", **SMALL)
    index = json.loads((tmp_path / "imported" / INDEX_FILE).read_text())
    shard = tmp_path / "imported" / index["weight_map"]["layers.2.attn.wq_a.weight"]
    tensors = load_file(shard)
    tensors["layers.2.attn.wq_a.weight"] = tensors["layers.2.attn.wq_a.weight"][:, :-1].contiguous()
    save_file(tensors, shard)
    with pytest.raises(ConvertError, match=r"layers\.2\.attn\.wq_a\.weight: shape \[32, 63\] but the release weight is \[32, 64\]"):
        export_release(tmp_path / "imported", tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")
    del tensors["layers.2.attn.wq_a.weight"]
    save_file(tensors, shard)
    del index["weight_map"]["layers.2.attn.wq_a.weight"]
    (tmp_path / "imported" / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConvertError, match=r"release tensor layers\.2\.attn\.wq_a\.weight is missing"):
        export_release(tmp_path / "imported", tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")
    with pytest.raises(ConvertError, match="export needs a checkpoint made by `convert import`"):
        export_release(release, tmp_path / "out", **SMALL)


def test_unpaired_or_mistyped_tensors_are_rejected(tmp_path):
    rows = [StoredTensor("layers.0.attn.wkv.weight", "F8_E4M3", (32, 32))]
    with pytest.raises(ValueError, match="the release layout needs StoredTensor.name='layers.0.attn.wkv.scale'"):
        write_release_checkpoint(tmp_path / "a", rows=rows, shards=1)
    save_file({"layers.0.attn.wkv.weight": torch.zeros(32, 32, dtype=torch.float8_e4m3fn)}, tmp_path / "a" / "model.safetensors")
    with pytest.raises(ConvertError, match=r"layers\.0\.attn\.wkv\.weight: quantized \(dense_fp8\) but its scale"):
        import_release(tmp_path / "a", tmp_path / "out", **SMALL)
    save_file({"layers.0.attn_norm.weight": torch.ones(4, dtype=torch.bfloat16),
               "layers.0.attn_norm.scale": torch.ones(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)},
              tmp_path / "b" / "model.safetensors")
    with pytest.raises(ConvertError, match="has a .scale sibling but quant_plan says it is bf16"):
        import_release(tmp_path / "b", tmp_path / "out", **SMALL)
    assert nothing_left(tmp_path, "out")


def test_cli_round_trip_and_error(release, tmp_path, capsys):
    assert cli_main(["convert", "import", str(release), str(tmp_path / "i"), "--no-progress", "--chunk-mb", "1"]) == 0
    assert cli_main(["convert", "export", str(tmp_path / "i"), str(tmp_path / "e"), "--no-progress", "--verify"]) == 0
    assert files(tmp_path / "e") == files(release)
    assert cli_main(["convert", "import", str(release), str(tmp_path / "i"), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
