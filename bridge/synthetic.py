"""Synthetic checkpoints in the exact release layout, so tests and benchmarks run on real-format bytes.

`write_release_checkpoint(dst, "tiny")` writes every tensor of a config's census (`dsv4flash.release.census`):
sharded safetensors laid out as the `safetensors` library lays them out, `model.safetensors.index.json`
and `config.json`. Quantized weights are Gaussian weights run through the release codecs, so codes and
scales are real encodings; every tensor is generated and written in row chunks (bounded memory, Engram
tables included), each chunk seeded from (seed, tensor name, chunk index) so the bytes do not depend on
the shard count or tensor order.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from pathlib import Path
from typing import Sequence

import torch

from dsv4flash.release.quant_plan import QuantRole, StoredTensor, quant_role, scale_name, stored_layout
from dsv4flash_bridge import codecs
from dsv4flash_bridge.safetensors_io import SafetensorsWriter, TensorSpec, all_or_nothing, library_order
from dsv4flash_bridge.sharded import write_index

__all__ = ["write_release_checkpoint", "largest_tensor_bytes", "mid_config", "GENERATOR_CHUNK_ROWS"]

_SCALARS = ("engram_vocab_size", "engram_n_heads", "engram_max_ngram_size", "engram_layer_ids",
            "engram_compressed_vocab_size")
GENERATOR_CHUNK_ROWS = 4096  # a multiple of 32, so dense blocks never straddle chunks


def _logical(row: StoredTensor) -> tuple[int, ...]:
    """The float shape behind a stored weight (MXFP4 packs two values per byte)."""
    if quant_role(row.name) is QuantRole.EXPERT_MXFP4:
        return (row.shape[0], row.shape[1] * 2)
    return row.shape


def _chunk_values(seed: int, name: str, index: int, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """Deterministic Gaussian values for one row chunk (fp32)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + index) % 2**63)
    return torch.randn(shape, generator=g) * std


def _write_tensor(writers: dict[str, SafetensorsWriter], shard_of: dict[str, str], row: StoredTensor,
                  seed: int, std: float) -> None:
    """Generate and write one logical tensor (and its scale) chunk by chunk."""
    role, writer = quant_role(row.name), writers[shard_of[row.name]]
    shape = _logical(row)
    total = shape[0] if shape else 1
    for index, r0 in enumerate(range(0, total, GENERATOR_CHUNK_ROWS)):
        r1 = min(total, r0 + GENERATOR_CHUNK_ROWS)
        chunk_shape = (r1 - r0, *shape[1:]) if shape else ()
        values = _chunk_values(seed, row.name, index, chunk_shape, std)
        if role in (QuantRole.BF16, QuantRole.F32):
            dtype = torch.bfloat16 if role is QuantRole.BF16 else torch.float32
            writer.write_rows(row.name, values.reshape(-1, *shape[1:]).to(dtype))
            continue
        q, s = codecs.encode(role, values, name=row.name)
        writer.write_rows(row.name, q)
        writers[shard_of[scale_name(row.name)]].write_rows(scale_name(row.name), s)


def _assign_shards(rows: Sequence[StoredTensor], shards: int) -> dict[str, str]:
    """Contiguous groups of about equal bytes in name order; a weight and its scale share a shard."""
    total = sum(r.nbytes for r in rows)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    out, done = {}, 0
    for r in rows:
        if r.name.endswith(".scale") and r.name[: -len(".scale")] + ".weight" in out:
            out[r.name] = out[r.name[: -len(".scale")] + ".weight"]
        else:
            out[r.name] = names[min(shards - 1, done * shards // max(total, 1))]
        done += r.nbytes
    for r in rows:  # scales listed before their weight follow the weight
        weight = r.name[: -len(".scale")] + ".weight"
        if r.name.endswith(".scale") and weight in out:
            out[r.name] = out[weight]
    return out


def mid_config(hidden: int = 1024, experts: int = 8, engram_rows: int = 1 << 18, vocab: int = 16384):
    """A mid-size config with the release's structure: flash's 40 layers, layer plan (compressor/indexer/
    candidate sources), two Engram tables, 32-block ViT, aligner, delimiters and 3 DSpark stages, with smaller
    widths, fewer experts, a smaller vocabulary and `engram_rows`-row Engram tables. For benchmarks and
    tests that need real-format bytes at a size between `tiny` and the release."""
    from dsv4flash.config import ConfigError, DSV41FlashConfig, _derive_engram_layouts, load_config

    if hidden % 128 or experts < 2:
        raise ConfigError(f"mid_config: hidden must be a multiple of 128 and experts >= 2, got {hidden}, {experts}")
    data = load_config("flash").to_hf()
    text, vision = data["text_config"], data["vision_config"]
    text.update(vocab_size=vocab, hidden_size=hidden, moe_intermediate_size=hidden // 2,
                num_attention_heads=hidden // 64, head_dim=128, q_lora_rank=hidden // 4, o_lora_rank=hidden // 4,
                o_groups=4, n_routed_experts=experts, num_experts_per_tok=min(4, experts), index_n_heads=8,
                index_head_dim=64, dspark_markov_rank=64, dspark_n_routed_experts=max(2, experts // 2),
                dspark_num_experts_per_tok=2, dspark_noise_token_id=vocab - 2,
                engram_vocab_size=max(64, engram_rows // (text["engram_n_heads"] * (text["engram_max_ngram_size"] - 1))))
    # Table rows are the sums of each layer's hash-bucket primes, which start at engram_vocab_size.
    probe = dataclasses.replace(load_config("flash").text, **{k: v for k, v in text.items() if k in _SCALARS})
    text["engram_num_embeddings"] = [layout.num_rows for layout in _derive_engram_layouts(probe)]
    vision.update(hidden_size=256, num_attention_heads=4, intermediate_size=704)
    data["image_token_id"] = vocab - 16
    return DSV41FlashConfig.from_hf(data, name=f"mid-{hidden}x{experts}", source="mid_config")


def write_release_checkpoint(dst: str | Path, config="tiny", *, rows: Sequence[StoredTensor] | None = None,
                             shards: int = 4, seed: int = 0, std: float = 0.02) -> Path:
    """Write a release-layout checkpoint of `config` (a flavour name, path or config) into `dst`.

    `rows` overrides the census (any release-named tensors, e.g. for benchmarks); `config.json` is written
    only when `config` is given and `rows` is not."""
    from dsv4flash.release.census import census
    from dsv4flash.config import load_config

    dst = Path(dst)
    cfg = load_config(config) if rows is None else None
    rows = sorted(census(cfg) if rows is None else rows, key=lambda r: r.name.encode())
    present = {r.name: r for r in rows}
    for r in rows:  # every stored tensor must be what the quantization plan lays out for it
        if not r.name.endswith(".scale"):
            for want in stored_layout(r.name, _logical(r)):
                if present.get(want.name) != want:
                    raise ValueError(f"{r.name}: the release layout needs {want}, got {present.get(want.name)}")
    shard_of = _assign_shards(rows, max(1, min(shards, len(rows))))
    by_shard: dict[str, list[TensorSpec]] = {}
    for r in rows:
        by_shard.setdefault(shard_of[r.name], []).append(TensorSpec(r.name, r.dtype, tuple(r.shape)))
    writers = {shard: SafetensorsWriter(dst / shard, library_order(specs), {"format": "pt"})
               for shard, specs in by_shard.items()}
    with all_or_nothing(writers):
        for r in rows:
            if not r.name.endswith(".scale"):
                _write_tensor(writers, shard_of, r, seed, std)
    write_index(dst, {r.name: shard_of[r.name] for r in rows}, sum(r.nbytes for r in rows))
    if cfg is not None:
        cfg.save(dst / "config.json")
    return dst


def largest_tensor_bytes(rows: Sequence[StoredTensor], dtype_bytes: int = 2) -> int:
    """Bytes of the largest tensor once decoded to `dtype_bytes` per element (for memory bounds)."""
    return max(math.prod(_logical(r)) * dtype_bytes for r in rows if not r.name.endswith(".scale"))
