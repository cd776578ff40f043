"""Imports in Megatron naming (assembled by the name table, exported back bit-exactly) and the tiny
checkpoint's logits through import: identical to a model built from the stored weights' decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dsv4flash.cli import main as cli_main
from dsv4flash.config import load_config
from dsv4flash.release.quant_plan import quant_role, scale_name
from dsv4flash_bridge import codecs, mapping
from dsv4flash_bridge.convert import QUANTIZED, ConvertError, export_release, import_release
from dsv4flash_bridge.renamed import ReleaseView, output_tensors, vision_heads
from dsv4flash_bridge.safetensors_io import load_file, save_file
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader
from dsv4flash_bridge.synthetic import write_release_checkpoint

SMALL = dict(progress=False, chunk_bytes=4096)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """tiny_mtp (every part: text, ViT, aligner, delimiters, DSpark) as a 3-shard release checkpoint."""
    return write_release_checkpoint(tmp_path_factory.mktemp("rel") / "release", "tiny_mtp", shards=3, seed=2)


@pytest.fixture(scope="module")
def megatron_import(release, tmp_path_factory) -> Path:
    """`release` imported to fp32 in Megatron naming."""
    dst = tmp_path_factory.mktemp("meg") / "megatron"
    import_release(release, dst, dtype=torch.float32, naming="megatron", verify=True, **SMALL)
    return dst


def decoded(directory: Path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every weight of a release checkpoint decoded in memory with the codecs (no converter involved)."""
    with CheckpointReader(directory) as ckpt:
        names = set(ckpt.names())
        out = {}
        for name in ckpt.names():
            if mapping.is_carried_scale(name, names):
                continue
            role = quant_role(name)
            out[name] = (codecs.decode(role, ckpt.read(name), ckpt.read(scale_name(name)), dtype=dtype, name=name)
                         if role in QUANTIZED else ckpt.read(name))
        return out


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory."""
    with CheckpointReader(directory) as ckpt:
        return {n: ckpt.read(n) for n in ckpt.names()}


def test_megatron_tensors_are_the_table_applied_to_the_decode(release, megatron_import):
    state = decoded(release)
    heads = load_config(release / "config.json").vision.num_attention_heads
    got = read_all(megatron_import)
    resolved = mapping.resolve(state)
    assert set(got) == {m.megatron for m in resolved}
    for m in resolved:
        if m.transform == "qkv":  # Megatron's per-head [q_h ; k_h ; v_h], written independently of renamed.py
            w = state[m.release[0]]
            want = w.view(3, heads, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
        else:
            want = torch.cat([state[r] for r in m.release])
        assert got[m.megatron].dtype == want.dtype and torch.equal(got[m.megatron], want), m.megatron
    fc1 = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    half = got[fc1].shape[0] // 2
    assert torch.equal(got[fc1][:half], state["layers.0.ffn.experts.1.w1.weight"])  # gate first, then up


def test_megatron_import_exports_byte_identical(release, megatron_import, tmp_path):
    summary = export_release(megatron_import, tmp_path / "exported", verify=True, **SMALL)
    assert "0 weight values differ" in summary.notes[0]
    for path in sorted(release.iterdir()):
        assert (tmp_path / "exported" / path.name).read_bytes() == path.read_bytes(), path.name
    layout = json.loads((megatron_import / "release" / "layout.json").read_text())
    assert layout["naming"] == "megatron"


def test_release_view_reads_release_rows_across_pieces(release, megatron_import):
    state = decoded(release)
    with CheckpointReader(megatron_import) as raw:
        outs = output_tensors(list(state), lambda n: state[n].shape[0] if state[n].dim() else 1, "megatron",
                              vision_heads((release / "config.json").read_text()))
        view = ReleaseView(raw, outs)
        assert set(view.names()) == set(state)
        name = "vision.blocks.1.attn.wqkv.weight"  # spread over 3 × heads pieces
        assert torch.equal(view.read_rows(name, 5, 77), state[name][5:77])
        assert torch.equal(view.read("layers.2.ffn.shared_experts.w3.weight"), state["layers.2.ffn.shared_experts.w3.weight"])


def _rewrite(directory: Path, name: str, change) -> None:
    """Apply `change(tensors)` to the shard holding `name` and keep the index consistent."""
    index = json.loads((directory / INDEX_FILE).read_text())
    shard = directory / index["weight_map"][name]
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, shard, {"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name}
    (directory / INDEX_FILE).write_text(json.dumps(index))


@pytest.mark.parametrize("damage, message", [
    ("drop", "Megatron tensor decoder.layers.1.mlp.shared_experts.linear_fc1.weight is missing"),
    ("short", r"decoder.layers.1.mlp.shared_experts.linear_fc1.weight: shape \[\d+, \d+\] but its release sources"),
    ("extra", "not part of the release layout, e.g. decoder.layers.1.made_up"),
])
def test_damaged_megatron_import_fails_cleanly(megatron_import, tmp_path, damage, message):
    src = Path(shutil.copytree(megatron_import, tmp_path / "damaged"))
    name = "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    if damage == "drop":
        _rewrite(src, name, lambda t: t.pop(name))
    elif damage == "short":
        _rewrite(src, name, lambda t: t.__setitem__(name, t[name][:-2].clone()))
    else:
        _rewrite(src, name, lambda t: t.__setitem__("decoder.layers.1.made_up", torch.zeros(2)))
        index = json.loads((src / INDEX_FILE).read_text())
        index["weight_map"]["decoder.layers.1.made_up"] = index["weight_map"][name]
        (src / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ConvertError, match=message):
        export_release(src, tmp_path / "out", **SMALL)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_cli_imports_in_megatron_naming(release, tmp_path, capsys):
    assert cli_main(["convert", "import", str(release), str(tmp_path / "m"), "--naming", "megatron",
                     "--no-progress", "--verify"]) == 0
    with CheckpointReader(tmp_path / "m") as out:
        assert "embedding.word_embeddings.weight" in out and "embed.weight" not in out
    assert cli_main(["convert", "export", str(tmp_path / "m"), str(tmp_path / "r"), "--no-progress"]) == 0
    assert (tmp_path / "r" / INDEX_FILE).read_bytes() == (release / INDEX_FILE).read_bytes()


# ------------------------------------------------------------------------------ tiny logits through import
def _model(state: dict[str, torch.Tensor]):
    """The tiny reference model with exactly these weights (strict: every key, nothing extra)."""
    from dsv4flash.model.transformer import Transformer

    model = Transformer("tiny", seed=None)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("naming", ["release", "megatron"])
def test_tiny_import_gives_the_logits_of_the_decoded_weights(tmp_path, naming):
    rel = write_release_checkpoint(tmp_path / "rel", "tiny", shards=2, seed=3)
    import_release(rel, tmp_path / "bf16", dtype=torch.bfloat16, naming=naming, progress=False)
    with CheckpointReader(tmp_path / "bf16") as raw:
        if naming == "megatron":  # back to reference names through the same table
            with CheckpointReader(rel) as src:
                rows = {n: src.info(n).rows for n in src.names()}
            outs = output_tensors(list(decoded(rel)), rows.__getitem__, "megatron",
                                  vision_heads((rel / "config.json").read_text()))
            source = ReleaseView(raw, outs)
        else:
            source = raw
        imported = {n: source.read(n) for n in source.names()}
    oracle = decoded(rel, torch.float32)  # decoded straight from the release bytes, in fp32
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.set_num_threads(1)
    with torch.no_grad():
        logits = _model(imported)(ids)
        want = _model(oracle)(ids)
        assert torch.isfinite(logits).all() and logits.std() > 0
        assert torch.equal(logits, want)
        oracle["layers.3.attn.wo_b.weight"][0, 0] += 0.25  # the comparison sees a single changed weight
        assert not torch.equal(_model(oracle)(ids), want)



def test_mid_config_keeps_the_release_structure():
    """Every kind of release tensor (wildcard form) appears in the mid census, and nothing else."""
    from dsv4flash.release.census import census
    from dsv4flash_bridge.mapping import _key
    from dsv4flash_bridge.synthetic import mid_config
    from tests.bridge.test_mapping import release_names

    cfg = mid_config(hidden=256, experts=2, vocab=4096, engram_rows=4096)
    mid = census(cfg)
    assert {_key(r.name)[0] for r in mid} == {_key(n)[0] for n in release_names()}
    assert cfg.text.num_hidden_layers == 40 and cfg.text.num_nextn_predict_layers == 3
    assert cfg.vision.num_hidden_layers == 32 and len(cfg.text.engram_layer_ids) == 2
    assert 4096 <= cfg.text.engram_num_embeddings[0] < 8192


def test_cli_writes_a_mid_checkpoint_and_rejects_a_bad_one(tmp_path, capsys):
    assert cli_main(["convert", "synthetic", str(tmp_path / "bad"), "--config", "mid", "--hidden", "200"]) == 2
    assert "multiple of 128" in capsys.readouterr().err and not (tmp_path / "bad").exists()
