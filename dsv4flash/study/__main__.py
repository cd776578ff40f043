"""`python -m dsv4flash.study placement|image-swap|diagnose [ARG…] [key=value…]` (docs/placement.md).

Study options are `key=value` like the train entry's Hydra overrides; every other `key=value` (e.g.
`data.val_size=64`, `engine.lr=1e-3`, `engine=verl model=flash`) is passed on to the train config.
"""

from __future__ import annotations

import sys

from dsv4flash.study.placement import PlacementArgs

USAGE = """usage:
  python -m dsv4flash.study placement [seeds=3] [steps=100] [presets=[full_linear,decoder_half,…]] [jobs=1]
                                      [out=study/placement] [plateau=[0.5,0.7,1.0]] [seed0=0] [TRAIN_OVERRIDE…]
  python -m dsv4flash.study image-swap ADAPTER… [out=study/image_swap] [seed=N] [TRAIN_OVERRIDE…]
  python -m dsv4flash.study diagnose ADAPTER [steps=8] [start=0] [out=study/diagnose] [seed=N] [TRAIN_OVERRIDE…]
ADAPTER: a PEFT adapter folder, e.g. study/placement/runs/decoder_half/seed0-<hash>/train/adapter"""

_STUDY_KEYS = {
    "placement": {"seeds": int, "steps": int, "presets": "list", "out": str, "jobs": int, "plateau": "floats",
                  "seed0": int},
    "image-swap": {"out": str, "seed": int},
    "diagnose": {"out": str, "steps": int, "start": int, "seed": int},
}


def _value(key: str, text: str, kind):
    if kind in ("list", "floats"):
        if not (text.startswith("[") and text.endswith("]")):
            raise ValueError(f"{key}= expects a list like [a,b], got {text!r}")
        items = [s.strip() for s in text[1:-1].split(",") if s.strip()]
        return [float(s) for s in items] if kind == "floats" else items
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{key}= expects {kind.__name__}, got {text!r}") from None


def parse(command: str, argv: list[str]) -> tuple[list[str], dict, list[str]]:
    """argv -> (positional args, study options, train overrides)."""
    if command not in _STUDY_KEYS:
        raise ValueError(f"unknown study command {command!r}; expected one of {sorted(_STUDY_KEYS)}")
    keys = _STUDY_KEYS[command]
    positional, options, overrides = [], {}, []
    for arg in argv:
        if "=" not in arg:
            positional.append(arg)
            continue
        key, text = arg.split("=", 1)
        if key in keys:
            options[key] = _value(key, text, keys[key])
        else:
            overrides.append(arg)
    return positional, options, overrides


def main(argv: list[str] | None = None) -> int:
    """Dispatch a study command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "_run":  # one placement cell, in its own process (runner.launch)
        from dsv4flash.study.runner import child_main

        return child_main(rest[0])
    try:
        positional, options, overrides = parse(command, rest)
    except ValueError as exc:
        print(f"error: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    if command == "placement":
        if positional:
            print(f"error: placement takes no positional arguments, got {positional}\n{USAGE}", file=sys.stderr)
            return 2
        from dsv4flash.study.placement import run_placement

        result = run_placement(PlacementArgs(**options, overrides=overrides))
        return 1 if result["failed"] else 0
    if not positional:
        print(f"error: {command} needs at least one ADAPTER folder\n{USAGE}", file=sys.stderr)
        return 2
    if command == "image-swap":
        from dsv4flash.study.image_swap import run_image_swap

        run_image_swap(positional, overrides, **options)
        return 0
    if len(positional) != 1:
        print(f"error: diagnose takes one ADAPTER, got {positional}", file=sys.stderr)
        return 2
    from dsv4flash.study.diagnose import run_diagnose

    run_diagnose(positional[0], overrides, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
