"""Streaming conversion between the release layout and BF16/FP32 checkpoints (`dsv4flash convert`).

Import decodes every quantized weight (DENSE_FP8, EXPERT_MXFP4, ENGRAM_FP8) to BF16 or FP32 and copies
everything else bit for bit, source shard by source shard and tensor by tensor, each tensor in row chunks of
about `chunk_bytes`, so memory stays bounded by the chunk, not the checkpoint or the largest tensor (the
Engram tables included). Names are the release names, which are the reference model's (`naming="release"`),
or the name table's Megatron-Core names (`naming="megatron"`: `linear_fc1` = [w1 ; w3], the ViT's qkv per
head; `mapping.py`, `renamed.py`). It also keeps what a bit-exact export needs in `DST/release/`: the E8M0
scales (verbatim) and `layout.json` (the release's shard headers, index and config.json verbatim, and the
naming).

Export reverses it (reading a Megatron-named import back through the same table): every release shard is
rebuilt from its recorded header, quantized weights re-encoded
with the recorded scales as `like_scale`, so an unmodified import exports to byte-identical shards, and a
changed block gets a fresh canonical scale (docs/bridge.md). Both directions write into `DST.partial` and
rename it to DST at the end; a failure removes it, unless `resume` is set, in which case a rerun keeps the
shards already completed (each shard is renamed into place only when complete) and produces the same bytes.
"""

from __future__ import annotations

from pathlib import Path

from dsv4flash_bridge.convert_common import (DEFAULT_CHUNK_BYTES, LAYOUT_FILE, QUANTIZED, SIDECAR, ConvertError,
                                             Summary)
from dsv4flash_bridge.exporter import export_release
from dsv4flash_bridge.importer import import_release

__all__ = ["ConvertError", "Summary", "import_release", "export_release", "SIDECAR", "LAYOUT_FILE", "QUANTIZED",
           "DEFAULT_CHUNK_BYTES", "bench_convert"]


def bench_convert(config: str = "mid", scale: float = 1.0, chunk_bytes: int = 32 << 20,
                  naming: str = "release") -> tuple[int, int, int, int, int]:
    """Write a synthetic release checkpoint and import it in a fresh process. `config` is "mid" (the release's
    structure at hidden 512, 4 experts, a 8192 vocabulary and Engram tables of about 2^18·scale rows; see
    `synthetic.mid_config`) or any flavour/config path. Returns (peak RSS growth during the conversion, the
    process's peak RSS, the largest tensor's decoded bytes, the checkpoint's stored bytes, its tensor
    count), sizes in bytes."""
    import subprocess
    import sys
    import tempfile

    from dsv4flash.release.census import census
    from dsv4flash_bridge.synthetic import largest_tensor_bytes, mid_config, write_release_checkpoint

    cfg = mid_config(hidden=512, experts=4, vocab=8192, engram_rows=max(2048, int((1 << 18) * scale))) \
        if config == "mid" else config
    rows = census(cfg)
    # Linux: writing 5 to clear_refs resets the peak (VmHWM), so the peak below is the conversion's own.
    script = f"""
import re, sys
from dsv4flash_bridge.convert import import_release
def status(key): return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
import_release(sys.argv[1], sys.argv[2], chunk_bytes={chunk_bytes}, naming={naming!r}, progress=False)
print(status("VmHWM") - base, status("VmHWM"))
"""
    with tempfile.TemporaryDirectory() as tmp:
        write_release_checkpoint(Path(tmp) / "release", cfg, shards=4)
        done = subprocess.run([sys.executable, "-c", script, str(Path(tmp) / "release"), str(Path(tmp) / "bf16")],
                              capture_output=True, text=True, check=True)
        growth, peak = (int(v) for v in done.stdout.split()[-2:])
        return growth, peak, largest_tensor_bytes(rows), sum(r.nbytes for r in rows), len(rows)
