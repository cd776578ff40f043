"""Fault cases of the checkpoint bridge (`dsv4flash convert`): sources that lie, resumes that mix, full disks, kills."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from unittest.mock import patch
from pathlib import Path

from dsv4flash.faultcases import DataLost, SilentWrong, case
from dsv4flash_bridge.convert_common import replaced_path

SMALL = dict(progress=False, chunk_bytes=4096)


# ------------------------------------------------------------------------------------------ helpers
def _import(src: Path, dst: Path, **kw):
    from dsv4flash_bridge.convert import import_release

    return import_release(src, dst, **{**SMALL, **kw})


def _export(src: Path, dst: Path, **kw):
    from dsv4flash_bridge.convert import export_release

    return export_release(src, dst, **{**SMALL, **kw})


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under a directory (relative path -> bytes)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _variant(ctx, edit, name: str = "src", seed: int = 1) -> Path:
    """A tiny release checkpoint whose census rows went through `edit(rows) -> rows`, with tiny's config.json."""
    from dsv4flash.release.census import census
    from dsv4flash.config import load_config
    from dsv4flash_bridge.synthetic import write_release_checkpoint

    out = write_release_checkpoint(ctx.tmp / name, rows=edit(list(census("tiny"))), shards=3, seed=seed)
    load_config("tiny").save(out / "config.json")
    return out


def _resized(rows, names: set[str], first_dim: int):
    from dsv4flash.release.quant_plan import StoredTensor

    return [StoredTensor(r.name, r.dtype, (first_dim, *r.shape[1:])) if r.name in names else r for r in rows]


def _shard_of(directory: Path, tensor: str) -> Path:
    return directory / json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _header(shard: Path) -> tuple[dict, bytes]:
    """A shard's header object and its data bytes."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write_header(shard: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    shard.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def _poke(directory: Path, tensor: str, value: int) -> None:
    """Set the first stored byte of `tensor` in place."""
    from dsv4flash_bridge.safetensors_io import SafetensorsReader

    shard = _shard_of(directory, tensor)
    with SafetensorsReader(shard) as reader:
        offset = reader.info(tensor).start
    with open(shard, "r+b") as fh:
        fh.seek(offset)
        fh.write(bytes([value]))


def _crash_after_first_shard():
    """Patch the importer so the second shard raises KeyboardInterrupt (a kill, as far as DST.partial knows)."""
    from dsv4flash_bridge import importer

    real, calls = importer._import_shard, []

    def crash(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)
    return patch.object(importer, "_import_shard", crash)


def _interrupted_resume(ctx, src: Path, dst: Path) -> None:
    with _crash_after_first_shard():
        try:
            _import(src, dst, resume=True)
        except KeyboardInterrupt:
            pass
        else:
            raise SilentWrong("the simulated kill did not happen")


def _left_clean(ctx, *paths: Path) -> None:
    for p in paths:
        ctx.nothing_at(p, p.with_name(p.name + ".partial"), replaced_path(p))


# ------------------------------------------------------------------------------------------ resume
@case("bridge", "import --resume on a different source (same structure, another path) is refused",
      match=r"not resumable .*it was started from")
def resume_other_source(ctx):
    a = ctx.copy_of(ctx.release(), "a")
    b = _variant(ctx, lambda rows: rows, "b", seed=2)
    _interrupted_resume(ctx, a, ctx.tmp / "out")
    failure = ctx.must_fail(lambda: _import(b, ctx.tmp / "out", resume=True))
    ctx.nothing_at(ctx.tmp / "out")
    return failure


@case("bridge", "import --resume after the source was replaced in place (identical headers) is refused",
      match=r"not resumable .*shard model-0000\d-of-00003\.safetensors differs")
def resume_replaced_source(ctx):
    a = ctx.copy_of(ctx.release(), "a")
    b = _variant(ctx, lambda rows: rows, "b", seed=2)
    _interrupted_resume(ctx, a, ctx.tmp / "out")
    for shard in b.glob("*.safetensors"):
        shutil.copyfile(shard, a / shard.name)
    return ctx.must_fail(lambda: _import(a, ctx.tmp / "out", resume=True))


@case("bridge", "import --resume on the same source finishes bit-identical to a clean import", expect="correct result")
def resume_same_source(ctx):
    src = ctx.copy_of(ctx.release(), "a")
    _interrupted_resume(ctx, src, ctx.tmp / "out")
    _import(src, ctx.tmp / "out", resume=True)
    if _files(ctx.tmp / "out") != _files(ctx.imported()):
        raise SilentWrong("the resumed import differs from a clean one")
    ctx.nothing_at(ctx.tmp / "out.partial")


@case("bridge", "import --resume with another --dtype than the interrupted run is refused",
      match=r"not resumable .*it was started with allow_extra=False, dtype=bfloat16, naming=release")
def resume_other_dtype(ctx):
    import torch

    src = ctx.copy_of(ctx.release(), "a")
    _interrupted_resume(ctx, src, ctx.tmp / "out")
    return ctx.must_fail(lambda: _import(src, ctx.tmp / "out", resume=True, dtype=torch.float32))


@case("bridge", "import --resume into a DST.partial with no source record is refused", match=r"has no source record")
def resume_unrecorded_partial(ctx):
    src = ctx.copy_of(ctx.release(), "a")
    _interrupted_resume(ctx, src, ctx.tmp / "out")
    (ctx.tmp / "out.partial" / ".source-identity.json").unlink()
    return ctx.must_fail(lambda: _import(src, ctx.tmp / "out", resume=True))


@case("bridge", "export --resume from a different import is refused", match=r"not resumable")
def export_resume_other_import(ctx):
    from dsv4flash_bridge import exporter

    one = ctx.copy_of(ctx.imported(), "one")
    two = ctx.copy_of(ctx.imported(), "two")
    real = exporter._export_quantized

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("simulated kill")
    with patch.object(exporter, "_export_quantized", crash):
        try:
            _export(one, ctx.tmp / "out", resume=True)
        except KeyboardInterrupt:
            pass
    assert real is exporter._export_quantized
    return ctx.must_fail(lambda: _export(two, ctx.tmp / "out", resume=True))


# ------------------------------------------------------------------------------------------ census
@case("bridge", "import: a tensor the config needs is missing", match=r"missing: layers\.2\.attn_norm\.weight")
def census_missing_tensor(ctx):
    src = _variant(ctx, lambda rows: [r for r in rows if r.name != "layers.2.attn_norm.weight"])
    failure = ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import: embed.weight with 500 rows instead of 512",
      match=r"mismatch: embed\.weight: expected BF16 \[512, 64\], found BF16 \[500, 64\]")
def census_short_embedding(ctx):
    src = _variant(ctx, lambda rows: _resized(rows, {"embed.weight"}, 500))
    failure = ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import: an Engram table with 400 rows instead of 462",
      match=r"mismatch: layers\.1\.engram\.embed\.scale: expected F8_E8M0 \[462, 2\]")
def census_short_engram(ctx):
    src = _variant(ctx, lambda rows: _resized(rows, {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"},
                                              400))
    failure = ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))
    _left_clean(ctx, ctx.tmp / "out")
    return failure


def _with_extra(rows):
    from dsv4flash.release.quant_plan import StoredTensor

    return rows + [StoredTensor("layers.0.attn.extra_probe.bias", "BF16", (8,))]


@case("bridge", "import: an unknown extra tensor is refused without --allow-extra",
      match=r"unexpected: layers\.0\.attn\.extra_probe\.bias .*--allow-extra")
def census_extra_refused(ctx):
    src = _variant(ctx, _with_extra)
    failure = ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import --allow-extra passes an unknown tensor through and export restores the source bytes",
      expect="correct result")
def census_extra_allowed(ctx):
    from dsv4flash_bridge.sharded import CheckpointReader

    src = _variant(ctx, _with_extra)
    summary = _import(src, ctx.tmp / "out", allow_extra=True)
    if not any("passed through 1 tensor" in n for n in summary.notes):
        raise SilentWrong(f"the pass-through was not reported: {summary.notes}")
    with CheckpointReader(ctx.tmp / "out") as out, CheckpointReader(src) as ref:
        name = "layers.0.attn.extra_probe.bias"
        if not (name in out and out.read(name).equal(ref.read(name))):
            raise SilentWrong(f"{name} did not pass through unchanged")
    _export(ctx.tmp / "out", ctx.tmp / "back")
    if {k: v for k, v in _files(ctx.tmp / "back").items()} != _files(src):
        raise SilentWrong("the export differs from the source")


@case("bridge", "CLI import --allow-extra is accepted; without it exit 2", match=r"^error: .*unexpected: ")
def census_extra_cli(ctx):
    src = _variant(ctx, _with_extra)
    ok = ctx.cli("convert", "import", src, ctx.tmp / "ok", "--no-progress", "--allow-extra")
    if ok.code != 0:
        raise SilentWrong(f"--allow-extra exited {ok.code}: {ok.err}")
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a tensor stored in another dtype than the census (F32 norm)",
      match=r"mismatch: layers\.0\.attn_norm\.weight: expected BF16 \[64\], found F32 \[64\]")
def census_wrong_dtype(ctx):
    from dsv4flash_bridge.safetensors_io import load_file, save_file

    src = ctx.copy_of(ctx.release())
    shard = _shard_of(src, "layers.0.attn_norm.weight")
    tensors = load_file(shard)
    tensors["layers.0.attn_norm.weight"] = tensors["layers.0.attn_norm.weight"].float()
    save_file(tensors, shard)
    return ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))


@case("bridge", "import: config.json of another flavour (tiny_mtp) than the tensors",
      match=r"does not match the census .*missing: mtp\.")
def census_other_config(ctx):
    from dsv4flash.config import load_config

    src = ctx.copy_of(ctx.release())
    load_config("tiny_mtp").save(src / "config.json")
    return ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))


# ------------------------------------------------------------------------------------------ config.json / layout.json
@case("bridge", "import: config.json is a dangling symlink (a half-downloaded hub cache)",
      match=r"config\.json: a symlink to .*does not exist")
def config_dangling_symlink(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("../blobs/0123456789abcdef")
    failure = ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import: config.json is a FIFO (refused at once, no hang)", match=r"config\.json: not a regular file",
      timeout_s=30)
def config_fifo(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    failure = ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import: config.json is not valid JSON",
      match=r"^error: .*config\.json: invalid JSON \(.* line 1 column")
def config_invalid_json(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "config.json").write_text('{"architectures": ["x"],')
    failure = ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import: config.json is not UTF-8", match=r"config\.json: not UTF-8 text")
def config_not_utf8(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "config.json").write_bytes(b'{"a": "\xff\xfe"}')
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: config.json is missing", match=r"config\.json: missing")
def config_missing(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "config.json").unlink()
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: config.json with an unknown key", match=r"unknown key `not_a_key`")
def config_unknown_key(ctx):
    src = ctx.copy_of(ctx.release())
    config = json.loads((src / "config.json").read_text())
    config["not_a_key"] = 1
    (src / "config.json").write_text(json.dumps(config))
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: config.json is a JSON list", match=r"config\.json: expected a JSON object, got list")
def config_json_list(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "config.json").write_text("[1, 2]")
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "export: layout.json is not valid JSON", match=r"layout\.json: invalid JSON")
def layout_invalid_json(ctx):
    src = ctx.copy_of(ctx.imported())
    (src / "release" / "layout.json").write_text("{not json")
    failure = ctx.cli_must_fail("convert", "export", src, ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "export: layout.json lacks its shard headers", match=r"layout\.json: field 'shards' is missing")
def layout_missing_field(ctx):
    src = ctx.copy_of(ctx.imported())
    layout = json.loads((src / "release" / "layout.json").read_text())
    del layout["shards"]
    (src / "release" / "layout.json").write_text(json.dumps(layout))
    return ctx.cli_must_fail("convert", "export", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "export: layout.json is a dangling symlink", match=r"layout\.json: a symlink to")
def layout_dangling_symlink(ctx):
    src = ctx.copy_of(ctx.imported())
    (src / "release" / "layout.json").unlink()
    (src / "release" / "layout.json").symlink_to("gone.json")
    return ctx.cli_must_fail("convert", "export", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: the index is not valid JSON", match=r"model\.safetensors\.index\.json: not valid UTF-8 JSON")
def index_invalid_json(ctx):
    src = ctx.copy_of(ctx.release())
    (src / "model.safetensors.index.json").write_text('{"weight_map": ')
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: the index maps a tensor outside the directory", match=r"not a plain file name")
def index_path_traversal(ctx):
    src = ctx.copy_of(ctx.release())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["embed.weight"] = "../model-00001-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


# ------------------------------------------------------------------------------------------ lying safetensors
def _some_shard(ctx) -> Path:
    src = ctx.copy_of(ctx.release())
    return sorted(src.glob("model-*.safetensors"))[1]


@case("bridge", "import: a shard truncated inside its data", match=r"truncated")
def shard_truncated_data(ctx):
    shard = _some_shard(ctx)
    shard.write_bytes(shard.read_bytes()[:-100])
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a shard shorter than its 8-byte header length", match=r"model-00002-of-00003\.safetensors")
def shard_truncated_length(ctx):
    shard = _some_shard(ctx)
    shard.write_bytes(b"\x10\x00\x00")
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a header length larger than the file", match=r"model-00002-of-00003\.safetensors")
def shard_header_length_lies(ctx):
    shard = _some_shard(ctx)
    data = shard.read_bytes()
    shard.write_bytes((len(data) * 4).to_bytes(8, "little") + data[8:])
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a header that is not JSON", match=r"model-00002-of-00003\.safetensors")
def shard_header_not_json(ctx):
    shard = _some_shard(ctx)
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    shard.write_bytes(data[:8] + b"{" + b"x" * (n - 1) + data[8 + n:])
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


def _edit_first_2d_bf16(shard: Path, edit) -> None:
    header, data = _header(shard)
    name = next(k for k in sorted(header) if k != "__metadata__" and header[k]["dtype"] == "BF16"
                and len(header[k]["shape"]) == 2)
    edit(header[name])
    _write_header(shard, header, data)


@case("bridge", "import: a header whose shape claims more bytes than its offsets", match=r"shape .* needs")
def shard_shape_lies(ctx):
    shard = _some_shard(ctx)
    _edit_first_2d_bf16(shard, lambda t: t["shape"].__setitem__(0, t["shape"][0] + 1))
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: header offsets that overlap the previous tensor", match=r"overlaps|gap|offsets")
def shard_offsets_overlap(ctx):
    shard = _some_shard(ctx)
    _edit_first_2d_bf16(shard, lambda t: t.__setitem__("data_offsets", [max(0, t["data_offsets"][0] - 2),
                                                                        t["data_offsets"][1] - 2]))
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a header with an unknown dtype", match=r"dtype")
def shard_unknown_dtype(ctx):
    shard = _some_shard(ctx)
    _edit_first_2d_bf16(shard, lambda t: t.__setitem__("dtype", "BF17"))
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a shard the index lists is missing", match=r"is missing")
def shard_missing(ctx):
    shard = _some_shard(ctx)
    shard.unlink()
    return ctx.cli_must_fail("convert", "import", shard.parent, ctx.tmp / "out", "--no-progress")


@case("bridge", "import: a shard holds a tensor the index does not list", match=r"not mapped to this shard")
def shard_unlisted_tensor(ctx):
    src = ctx.copy_of(ctx.release())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["embed.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return ctx.cli_must_fail("convert", "import", src, ctx.tmp / "out", "--no-progress")


# ------------------------------------------------------------------------------------------ codec NaNs
@case("bridge", "import: an E8M0 scale byte 255 (NaN) in an MXFP4 expert",
      match=r"layers\.3\.ffn\.experts\.5\.w2\.weight: E8M0 scale byte 255")
def codec_nan_scale(ctx):
    src = ctx.copy_of(ctx.release())
    _poke(src, "layers.3.ffn.experts.5.w2.scale", 255)
    failure = ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import: an E4M3 NaN code in a dense FP8 weight", match=r"layers\.0\.attn\.wkv\.weight: E4M3 NaN code")
def codec_nan_fp8(ctx):
    src = ctx.copy_of(ctx.release())
    _poke(src, "layers.0.attn.wkv.weight", 0x7F)
    return ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))


@case("bridge", "import: an E4M3 NaN code in an Engram table", match=r"layers\.1\.engram\.embed\.weight: E4M3 NaN code")
def codec_nan_engram(ctx):
    src = ctx.copy_of(ctx.release())
    _poke(src, "layers.1.engram.embed.weight", 0xFF)
    return ctx.must_fail(lambda: _import(src, ctx.tmp / "out"))


def _retrained(ctx, edit) -> Path:
    """A private copy of the import with one weight replaced by `edit(weight)`."""
    from dsv4flash_bridge.safetensors_io import load_file, save_file

    src = ctx.copy_of(ctx.imported())
    shard = _shard_of(src, "layers.2.attn.wq_a.weight")
    tensors = load_file(shard)
    tensors["layers.2.attn.wq_a.weight"] = edit(tensors["layers.2.attn.wq_a.weight"])
    save_file(tensors, shard)
    return src


@case("bridge", "export: a trained weight holding NaN", match=r"layers\.2\.attn\.wq_a\.weight: non-finite input value")
def export_nan_weight(ctx):
    import torch

    src = _retrained(ctx, lambda w: w.index_fill(0, torch.tensor([3]), float("nan")))
    failure = ctx.must_fail(lambda: _export(src, ctx.tmp / "out"))
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "export: a trained weight of the wrong shape",
      match=r"layers\.2\.attn\.wq_a\.weight: shape \[32, 63\] but the release weight is \[32, 64\]")
def export_wrong_shape(ctx):
    src = _retrained(ctx, lambda w: w[:, :-1].contiguous())
    return ctx.must_fail(lambda: _export(src, ctx.tmp / "out"))


@case("bridge", "export: a directory that was not made by import", match=r"export needs a checkpoint made by")
def export_not_an_import(ctx):
    return ctx.cli_must_fail("convert", "export", ctx.release(), ctx.tmp / "out", "--no-progress")


@case("bridge", "export: changed weights round-trip, unchanged ones stay byte-identical", expect="correct result")
def export_changed_weight(ctx):
    src = _retrained(ctx, lambda w: w * 1.5)
    _export(src, ctx.tmp / "out", verify=True)
    changed = _shard_of(ctx.release(), "layers.2.attn.wq_a.weight").name
    same = {k: v for k, v in _files(ctx.release()).items() if k != changed}
    got = _files(ctx.tmp / "out")
    if any(got.get(k) != v for k, v in same.items()) or got[changed] == _files(ctx.release())[changed]:
        raise SilentWrong("an untouched shard changed, or the changed weight was not written")


# ------------------------------------------------------------------------------------------ disk full, kills
def _enospc_after(calls: int):
    from dsv4flash_bridge.safetensors_io import SafetensorsWriter

    real, count = SafetensorsWriter.write_rows, [0]

    def write_rows(self, name, rows):
        count[0] += 1
        if count[0] > calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._tmp))
        return real(self, name, rows)
    return patch.object(SafetensorsWriter, "write_rows", write_rows)


@case("bridge", "import: disk full (ENOSPC) mid-shard: one line, exit 2, nothing written",
      match=r"^error: import .* failed: No space left on device")
def enospc_import(ctx):
    with _enospc_after(20):
        failure = ctx.cli_must_fail("convert", "import", ctx.release(), ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "export: disk full (ENOSPC) mid-shard: one line, exit 2, nothing written",
      match=r"^error: export .* failed: No space left on device")
def enospc_export(ctx):
    with _enospc_after(20):
        failure = ctx.cli_must_fail("convert", "export", ctx.imported(), ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import --resume after ENOSPC keeps finished shards and completes identically", expect="correct result")
def enospc_then_resume(ctx):
    with _enospc_after(60):
        failure = ctx.cli_must_fail("convert", "import", ctx.release(), ctx.tmp / "out", "--no-progress", "--resume")
    if not failure.is_clean():
        raise SilentWrong(f"the disk-full error was not clean: {failure.message}")
    _import(ctx.release(), ctx.tmp / "out", resume=True)
    if _files(ctx.tmp / "out") != _files(ctx.imported()):
        raise SilentWrong("the resumed import differs from a clean one")


@case("bridge", "import in a process with a 64 KiB file-size limit (real EFBIG): exit 2, nothing left",
      match=r"^error: import .* failed: File too large")
def efbig_import(ctx):
    from dsv4flash.cli import main
    from dsv4flash.faultcases import Failure
    from dsv4flash.faultcases.context import fork_run

    err = ctx.tmp / "stderr.txt"
    status = fork_run(lambda: main(["convert", "import", str(ctx.release()), str(ctx.tmp / "out"), "--no-progress"]),
                      fsize_limit=64 << 10, stderr_to=err)
    text = err.read_text()
    _left_clean(ctx, ctx.tmp / "out")
    if not os.WIFEXITED(status):
        raise SilentWrong(f"the child did not exit normally (status {status})")
    return Failure(text.strip(), exit_code=os.WEXITSTATUS(status), traceback="Traceback" in text)


def _kill_at_rename(suffix_of_target: str):
    """Patch Path.rename so the process SIGKILLs itself right after renaming something onto `*suffix`."""
    real = Path.rename

    def rename(self, target):
        result = real(self, target)
        if str(target).endswith(suffix_of_target):
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    return patch.object(Path, "rename", rename)


def _killed_overwrite(ctx, suffix: str) -> Path:
    """DST imported once, then an --overwrite import killed right after its rename onto `suffix`."""
    from dsv4flash.faultcases.context import fork_run

    dst = ctx.tmp / "out"
    _import(ctx.release(), dst)

    def child():
        with _kill_at_rename(suffix):
            _import(ctx.release(), dst, overwrite=True)
    status = fork_run(child)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise SilentWrong(f"the overwrite was not killed where intended (status {status})")
    return dst


@case("bridge", "--overwrite killed between its renames: the next run restores DST, nothing set aside remains",
      expect="correct result")
def overwrite_killed_between_renames(ctx):
    dst = _killed_overwrite(ctx, replaced_path(ctx.tmp / "out").name)
    if dst.exists() or not replaced_path(dst).exists():
        raise SilentWrong("the kill did not land between the two renames")
    failure = ctx.cli_must_fail("convert", "import", ctx.release(), dst, "--no-progress")  # no --overwrite
    if "already exists" not in failure.message:
        raise SilentWrong(f"expected the restored DST to exist: {failure.message}")
    if _files(dst) != _files(ctx.imported()):
        raise DataLost("the restored DST is not the previous complete output")
    ctx.nothing_at(replaced_path(dst))


@case("bridge", "--overwrite killed after the swap: the next run removes the previous DST left aside",
      expect="correct result")
def overwrite_killed_after_swap(ctx):
    dst = _killed_overwrite(ctx, "/out")
    if not (dst.exists() and replaced_path(dst).exists()):
        raise SilentWrong("the kill did not land after the swap")
    ok = ctx.cli("convert", "import", ctx.release(), dst, "--no-progress", "--overwrite")
    if ok.code != 0:
        raise SilentWrong(f"the rerun failed: {ok.err}")
    if _files(dst) != _files(ctx.imported()):
        raise DataLost("DST is not a complete import")
    ctx.nothing_at(replaced_path(dst), dst.with_name("out.partial"))


@case("bridge", "--overwrite leaves a user's own DST.old directory alone", expect="correct result")
def overwrite_spares_user_old(ctx):
    dst = ctx.tmp / "out"
    (ctx.tmp / "out.old").mkdir()
    (ctx.tmp / "out.old" / "mine.txt").write_text("a user's backup")
    _import(ctx.release(), dst)
    _import(ctx.release(), dst, overwrite=True)
    if (ctx.tmp / "out.old" / "mine.txt").read_text() != "a user's backup":
        raise DataLost("the user's out.old was changed")
    ctx.nothing_at(replaced_path(dst), dst.with_name("out.partial"))


@case("bridge", "import: DST exists without --overwrite", match=r"^error: .*already exists")
def dst_exists(ctx):
    (ctx.tmp / "out").mkdir()
    return ctx.cli_must_fail("convert", "import", ctx.release(), ctx.tmp / "out", "--no-progress")


@case("bridge", "import: SRC does not exist", match=r"^error: .*neither model\.safetensors\.index\.json nor")
def src_missing(ctx):
    failure = ctx.cli_must_fail("convert", "import", ctx.tmp / "nope", ctx.tmp / "out", "--no-progress")
    _left_clean(ctx, ctx.tmp / "out")
    return failure


@case("bridge", "import then export of an undamaged checkpoint is byte-identical (control)", expect="correct result")
def round_trip_control(ctx):
    _export(ctx.imported(), ctx.tmp / "back", verify=True)
    if _files(ctx.tmp / "back") != _files(ctx.release()):
        raise SilentWrong("the round trip is not byte-identical")


@case("bridge", "census --checkpoint on a directory with a truncated shard header", match=r"^error: .*truncated")
def census_cli_truncated(ctx):
    shard = _some_shard(ctx)
    shard.write_bytes(shard.read_bytes()[:20])
    return ctx.cli_must_fail("census", "--config", "tiny", "--checkpoint", shard.parent)


@case("bridge", "census --config naming a file that does not exist", match=r"^error: .*neither a flavour")
def census_cli_bad_config(ctx):
    return ctx.cli_must_fail("census", "--config", ctx.tmp / "nope.json")


@case("bridge", "census --checkpoint lists every difference of a damaged checkpoint and exits 1",
      expect="correct result")
def census_cli_lists_differences(ctx):
    src = _variant(ctx, lambda rows: _resized([r for r in rows if r.name != "layers.2.attn_norm.weight"],
                                              {"embed.weight"}, 500))
    run = ctx.cli("census", "--config", "tiny", "--checkpoint", src)
    lines = run.out.splitlines()
    if run.code != 1 or lines != ["missing: layers.2.attn_norm.weight (BF16 [64])",
                                  "mismatch: embed.weight: expected BF16 [512, 64], found BF16 [500, 64]"]:
        raise SilentWrong(f"exit {run.code}, listed {lines}")
