"""Filter pip's stderr in ci/install.sh: the dependency conflicts of the packages it installs `--no-deps` on purpose
become one `[install] note:` line; every other line (a real error or warning, an unknown conflict) passes unchanged.

    python ci/pip_conflicts.py [--note-once FILE] < pip-stderr > filtered

Why each known conflict is harmless: ci/install_sides.md, "Known pip conflicts of the test install".
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# (distribution, version) installed --no-deps by ci/install.sh; pip lists their undeclared or off-pin dependencies.
KNOWN = {
    ("megatron-core", "0.19.2"): "--no-deps: its full dependencies are CUDA builds",
    ("megatron-bridge", "0.6.2"): "--no-deps: CUDA builds and optional integrations (mlflow, comet-ml, timm, ...)",
    ("tinker-cookbook", "0.6.1"): "--no-deps: tml-renderers is imported only by the Inkling/Kimi renderers, lazily",
    ("vllm", "0.33.0"): "--no-deps: CUDA-only kernels, and its torch/transformers pins that veRL's exclude",
}
HEADER = "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed."
CONFLICT = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+) (?P<version>\S+) (requires |has requirement )")
NOTE = ("[install] note: pip lists {n} dependency conflict(s) of {names}, installed --no-deps on purpose; harmless "
        "here (ci/install_sides.md, \"Known pip conflicts of the test install\"); any other conflict is printed as is")


def _known(line: str) -> str | None:
    m = CONFLICT.match(line)
    if m is None:
        return None
    key = (m["name"].lower().replace("_", "-"), m["version"].split("+")[0].rstrip(".,"))
    return f"{key[0]} {key[1]}" if key in KNOWN else None


def filter_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """-> (lines to print, the known conflicts dropped). The resolver's header goes only when every conflict
    listed after it is known."""
    kept, dropped, block = [], [], None
    for line in lines:
        text = line.rstrip("\n")
        if text.startswith(HEADER):
            block = [text]  # the header, then its conflict lines
            continue
        if block is not None and CONFLICT.match(text):
            block.append(text)
            continue
        if block is not None:
            kept += _flush(block, dropped)
            block = None
        kept.append(text)
    if block is not None:
        kept += _flush(block, dropped)
    return kept, dropped


def _flush(block: list[str], dropped: list[str]) -> list[str]:
    header, conflicts = block[0], block[1:]
    unknown = [c for c in conflicts if _known(c) is None]
    dropped += [c for c in conflicts if _known(c) is not None]
    return [header, *unknown] if unknown else []


def main(argv: list[str] | None = None) -> int:
    """Read pip's stderr on stdin, write the filtered lines and (once per `--note-once` file) the note."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--note-once", type=Path, default=None,
                        help="print the note only if this file does not exist yet, then create it")
    args = parser.parse_args(argv)
    kept, dropped = filter_lines(sys.stdin.readlines())
    for line in kept:
        print(line)
    if dropped and (args.note_once is None or not args.note_once.exists()):
        names = sorted({_known(c) for c in dropped})
        print(NOTE.format(n=len(dropped), names=", ".join(names)))
        if args.note_once is not None:
            args.note_once.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
