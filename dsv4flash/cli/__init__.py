"""`dsv4flash` console script: one subcommand per concern, each module imported only when used.

The package holds the front ends that belong to no single subsystem (`census`, `patches`, `smoke`); the
subsystems keep their own (`dsv4flash_bridge.cli`, `dsv4flash.lifecycle.cli`, `dsv4flash.service.protocol.serve`).
`dsv4flash train ...` is `python -m dsv4flash.train ...` (Hydra parses its overrides). A subcommand module imports
torch and the like only inside `run`, so `--help` and argument errors answer without them
(tests/core/test_cli_imports.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dsv4flash.train.main", "train a recipe: `dsv4flash train +recipe=decoder_lora [overrides]` "
                                      "(= python -m dsv4flash.train; see docs/recipes.md)"),
    "census": ("dsv4flash.cli.census", "print or check the release tensor census of a config"),
    "convert": ("dsv4flash_bridge.cli", "convert checkpoints between the release layout and BF16/FP32"),
    "patches": ("dsv4flash.cli.patches", "list, check, apply and audit the upstream patch series"),
    "lifecycle": ("dsv4flash.lifecycle.cli", "adapter store: init, list policies, show/log revisions, tag, rollback, "
                                             "gc, export, import"),
    "smoke": ("dsv4flash.cli.smoke", "tiny multimodal forward+backward and the flash census (a quick install check)"),
    "serve": ("dsv4flash.service.protocol.serve", "Tinker-protocol HTTP server over the policy service; `keys add`"),
}


DESCRIPTION = """LoRA post-training of DeepSeek-V4.1-Flash (README.md, docs/).

The main job: `dsv4flash train +recipe=decoder_lora` (the same as `python -m dsv4flash.train`).
`dsv4flash COMMAND --help` describes each command."""


def version() -> str:
    """The installed distribution's version (package metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("dsv4flash")
    except PackageNotFoundError:  # a source tree on sys.path without an install
        from dsv4flash import __version__

        return f"{__version__} (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; subcommand modules add their own arguments lazily."""
    parser = argparse.ArgumentParser(prog="dsv4flash", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dsv4flash {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dsv4flash` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        build_parser().parse_args(argv)  # prints help, the version or the "invalid choice" error and exits
        return 2
    name = argv[0]
    if name == "train":
        return _train(argv[1:])
    module = importlib.import_module(SUBCOMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"dsv4flash {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


def _train(overrides: list[str]) -> int:
    """`dsv4flash train ARGS`: the Hydra app of `python -m dsv4flash.train` on the same arguments."""
    from dsv4flash.train.main import main as train_main

    sys.argv = ["dsv4flash train", *overrides]
    try:
        train_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
