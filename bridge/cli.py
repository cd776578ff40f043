"""`dsv4flash convert import|export|synthetic`: the checkpoint bridge on the command line."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands and their options."""
    sub = parser.add_subparsers(dest="action", required=True)
    for action, text in (("import", "release layout -> BF16/FP32 (release or Megatron names), keeping what export "
                                    "needs"),
                         ("export", "an import (possibly trained) -> release layout, bit-exact where unchanged")):
        p = sub.add_parser(action, help=text, description=text)
        p.add_argument("src")
        p.add_argument("dst")
        if action == "import":
            p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="dtype of decoded weights")
            p.add_argument("--naming", choices=("release", "megatron"), default="release",
                           help="tensor names: release (= the reference model's) or Megatron-Core (docs/bridge.md)")
            p.add_argument("--allow-extra", action="store_true",
                           help="pass tensors the config's census does not know through unchanged (default: refuse)")
        p.add_argument("--chunk-mb", type=int, default=256, help="rows per chunk are sized to about this many MiB")
        p.add_argument("--verify", action="store_true", help="re-read the output and check it against the source")
        p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
        p.add_argument("--resume", action="store_true", help="keep DST.partial on failure and reuse its finished shards")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("synthetic", help="write a synthetic checkpoint in the exact release layout")
    p.add_argument("dst")
    p.add_argument("--config", default="tiny",
                   help="flavour name (tiny, tiny_mtp, flash), 'mid' (release structure, smaller sizes) or a "
                        "config.json path")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=1024, help="mid: hidden size (a multiple of 128)")
    p.add_argument("--experts", type=int, default=8, help="mid: routed experts per layer")
    p.add_argument("--vocab", type=int, default=16384, help="mid: vocabulary size")
    p.add_argument("--engram-rows", type=int, default=1 << 18, help="mid: approximate rows of each Engram table")


def run(args: argparse.Namespace) -> int:
    """Run one action; a bad checkpoint, a bad argument or a failed write prints one line and returns 2."""
    import torch

    from dsv4flash.release.census import CensusError
    from dsv4flash.config import ConfigError
    from dsv4flash_bridge.codecs import CodecError
    from dsv4flash_bridge.convert import ConvertError, export_release, import_release
    from dsv4flash_bridge.safetensors_io import SafetensorsError
    from dsv4flash_bridge.synthetic import mid_config, write_release_checkpoint

    try:
        if args.action == "synthetic":
            config = (mid_config(hidden=args.hidden, experts=args.experts, vocab=args.vocab, engram_rows=args.engram_rows)
                      if args.config == "mid" else args.config)
            print(write_release_checkpoint(args.dst, config, shards=args.shards, seed=args.seed))
            return 0
        common = dict(chunk_bytes=args.chunk_mb << 20, verify=args.verify, progress=not args.no_progress,
                      overwrite=args.overwrite, resume=args.resume)
        if args.action == "import":
            dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
            summary = import_release(args.src, args.dst, dtype=dtype, naming=args.naming,
                                     allow_extra=args.allow_extra, **common)
        else:
            summary = export_release(args.src, args.dst, **common)
    except (ConvertError, CodecError, SafetensorsError, ConfigError, CensusError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions, a vanished file: the staging directory is already removed
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"error: {args.action} {args.src} -> {args.dst} failed: {exc.strerror or exc}{where}; nothing was "
              f"written to {args.dst}", file=sys.stderr)
        return 2
    rate = summary.bytes_read / max(summary.seconds, 1e-9) / 2**20
    print(f"{args.action}: {summary.tensors} tensors, {summary.bytes_read / 2**30:.2f} GiB read, "
          f"{summary.bytes_written / 2**30:.2f} GiB written in {summary.seconds:.1f} s ({rate:.0f} MiB/s)")
    for note in summary.notes:
        print(note)
    return 0
