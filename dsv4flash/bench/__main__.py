"""`python -m dsv4flash.bench NAME [--json PATH] [benchmark options]`."""

from __future__ import annotations

import argparse
import importlib
import sys

from dsv4flash.bench import BENCHMARKS


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark, print its table and optionally write its figures as JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        names = "\n".join(f"  {k:10s} {v}" for k, v in BENCHMARKS.items())
        print(f"usage: python -m dsv4flash.bench NAME [--json PATH] [options]\n\nbenchmarks:\n{names}",
              file=sys.stderr)
        return 2
    name = argv[0]
    module = importlib.import_module(f"dsv4flash.bench.{name}")
    parser = argparse.ArgumentParser(prog=f"python -m dsv4flash.bench {name}", description=BENCHMARKS[name])
    parser.add_argument("--json", metavar="PATH", help="also write the figures as a flat JSON object")
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    report = module.run(args)
    print(report.render())
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
