"""The meta-built reference model, run through the quantization plan, is exactly the release census."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4flash.release.census import census, checkpoint_census, diff_census, format_tsv, parse_tsv
from dsv4flash.model.transformer import Transformer

DATA = Path(__file__).resolve().parents[1] / "data"


def test_flash_census_equals_release_tensors_tsv():
    expected_text = gzip.open(DATA / "release_tensors.tsv.gz", "rt").read()
    rows = census("flash")
    assert diff_census(parse_tsv(expected_text), rows) == []
    assert format_tsv(rows) == expected_text  # names, dtypes, shapes and order, byte for byte
    assert len(rows) == 96085
    assert sum(r.nbytes for r in rows) == 510_286_023_000


def test_flash_builds_on_meta_without_memory():
    with torch.device("meta"):
        model = Transformer("flash", device="meta", seed=None)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 7e11


def test_tiny_censuses_equal_the_generator_output():
    assert format_tsv(census("tiny")) == (DATA / "tiny_tensors.tsv").read_text()
    assert format_tsv(census("tiny_mtp")) == (DATA / "tiny_mtp_tensors.tsv").read_text()
    assert sum(r.nbytes for r in census("tiny")) == 1_760_058


def test_checkpoint_census_lists_every_difference(tmp_path):
    rows = census("tiny")
    tensors = {}
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
              "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}
    for r in rows:
        tensors[r.name] = torch.zeros(r.shape, dtype=dtypes[r.dtype])
    del tensors["norm.weight"]
    tensors["head.weight"] = torch.zeros(512, 63, dtype=torch.bfloat16)
    tensors["extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:500]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[500:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    diff = diff_census(rows, checkpoint_census(tmp_path))
    assert diff == [
        "missing: norm.weight (BF16 [64])",
        "unexpected: extra.weight (BF16 [2])",
        "mismatch: head.weight: expected BF16 [512, 64], found BF16 [512, 63]",
    ]
    cli = subprocess.run([sys.executable, "-m", "dsv4flash", "census", "--config", "tiny", "--checkpoint",
                          str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 1 and "missing: norm.weight" in cli.stdout and "3 difference(s)" in cli.stderr


def test_census_cli_prints_the_tsv():
    out = subprocess.run([sys.executable, "-m", "dsv4flash", "census", "--config", "tiny"], capture_output=True,
                         text=True, check=True).stdout
    assert out == (DATA / "tiny_tensors.tsv").read_text()
