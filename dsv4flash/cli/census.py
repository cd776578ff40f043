"""`dsv4flash census`: print a config's release-layout tensor census, or diff it against a checkpoint."""

from __future__ import annotations

import argparse
import sys

from dsv4flash.config import FLAVOURS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `dsv4flash census`."""
    parser.add_argument("--config", default="flash",
                        help=f"a flavour ({', '.join(FLAVOURS)}) or a config.json / checkpoint directory")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="compare with this checkpoint's safetensors headers and list every difference")


def run(args: argparse.Namespace) -> int:
    """Print the census (TSV) or the differences against a checkpoint (exit 1 when any, 2 on a bad input)."""
    from dsv4flash.release.census import CensusError, checkpoint_census, census, diff_census, format_tsv
    from dsv4flash.config import ConfigError

    try:
        expected = census(args.config)
        actual = checkpoint_census(args.checkpoint) if args.checkpoint else None
    except (CensusError, ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if actual is None:
        sys.stdout.write(format_tsv(expected))
        return 0
    differences = diff_census(expected, actual)
    for line in differences:
        print(line)
    print(f"{len(differences)} difference(s) between config `{args.config}` and {args.checkpoint}",
          file=sys.stderr)
    return 1 if differences else 0
