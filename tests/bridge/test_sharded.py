"""Sharded checkpoint tests: index round trip and index/shard cross-checks."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4flash_bridge import safetensors_io as io
from dsv4flash_bridge.safetensors_io import SafetensorsError
from dsv4flash_bridge.sharded import INDEX_FILE, CheckpointReader, read_index, write_index


def make_checkpoint(directory) -> dict[str, torch.Tensor]:
    """Two shards plus an index; returns the tensors."""
    tensors = {"embed.weight": torch.randn(8, 4), "layers.0.attn_norm.weight": torch.ones(4, dtype=torch.bfloat16),
               "layers.0.attn.wkv.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
               "layers.0.attn.wkv.scale": torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
    shards = {"model-00001-of-00002.safetensors": ["embed.weight", "layers.0.attn_norm.weight"],
              "model-00002-of-00002.safetensors": ["layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale"]}
    weight_map = {}
    for shard, names in shards.items():
        io.save_file({n: tensors[n] for n in names}, directory / shard)
        weight_map.update({n: shard for n in names})
    write_index(directory, weight_map, sum(t.numel() * t.element_size() for t in tensors.values()), {"format": "pt"})
    return tensors


def test_index_round_trip_and_reading(tmp_path):
    tensors = make_checkpoint(tmp_path)
    index = read_index(tmp_path / INDEX_FILE)
    assert index.metadata == {"format": "pt", "total_size": 32 * 4 + 8 + 16 + 1}
    assert index.shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    with CheckpointReader(tmp_path) as ckpt:
        assert set(ckpt.names()) == set(tensors) and ckpt.total_size == index.metadata["total_size"]
        for name, t in tensors.items():
            assert torch.equal(ckpt.read(name).view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(ckpt.read_rows("embed.weight", 2, 5), tensors["embed.weight"][2:5])
        assert ckpt.shard_of("layers.0.attn.wkv.scale") == "model-00002-of-00002.safetensors"
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_single_file_checkpoint(tmp_path):
    io.save_file({"a": torch.ones(2), "b": torch.zeros(3)}, tmp_path / "model.safetensors")
    with CheckpointReader(tmp_path) as ckpt:
        assert sorted(ckpt.names()) == ["a", "b"] and torch.equal(ckpt.read("a"), torch.ones(2))


def test_missing_shard_is_named(tmp_path):
    make_checkpoint(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SafetensorsError, match=r"shard 'model-00002-of-00002.safetensors' \(holding 'layers.0.attn.wkv.weight'"):
        CheckpointReader(tmp_path)


def test_index_and_shards_must_agree(tmp_path):
    make_checkpoint(tmp_path)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="'ghost.weight' is listed in the index but absent"):
        CheckpointReader(tmp_path)
    del index["weight_map"]["ghost.weight"], index["weight_map"]["embed.weight"]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="model-00001-of-00002.safetensors: tensor 'embed.weight' is not mapped"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("weight_map,message", [
    ({"a": "../outside.safetensors"}, "not a plain file name"),
    ({"a": 3}, "not a plain file name"),
    (None, "expected an object with a 'weight_map' object"),
])
def test_bad_index_files(tmp_path, weight_map, message):
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(SafetensorsError, match=message):
        CheckpointReader(tmp_path)


def test_empty_directory_and_broken_shard(tmp_path):
    with pytest.raises(SafetensorsError, match="neither model.safetensors.index.json nor model.safetensors"):
        CheckpointReader(tmp_path)
    make_checkpoint(tmp_path)
    shard = tmp_path / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(SafetensorsError, match="model-00001-of-00002.safetensors: truncated"):
        CheckpointReader(tmp_path)
