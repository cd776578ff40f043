"""`dsv4flash` console script: one subcommand per concern, each module imported only when used.

The package holds the front ends that belong to no single subsystem (`census`, `patches`, `smoke`); the
subsystems keep their own (`dsv4flash_bridge.cli`, `dsv4flash.lifecycle.cli`, `dsv4flash.service.protocol.serve`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "census": ("dsv4flash.cli.census", "print or check the release tensor census of a config"),
    "convert": ("dsv4flash_bridge.cli", "convert checkpoints between the release layout and BF16/FP32"),
    "patches": ("dsv4flash.cli.patches", "list, check, apply and audit the upstream patch series"),
    "lifecycle": ("dsv4flash.lifecycle.cli", "adapter store: list policies, show/log revisions, tag, rollback, gc, export"),
    "smoke": ("dsv4flash.cli.smoke", "tiny multimodal forward+backward and the flash census (a quick install check)"),
    "serve": ("dsv4flash.service.protocol.serve", "Tinker-protocol HTTP server over the policy service; `keys add`"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; subcommand modules add their own arguments lazily."""
    parser = argparse.ArgumentParser(prog="dsv4flash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dsv4flash` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints help or the "invalid choice" error and exits
        return 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"dsv4flash {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
