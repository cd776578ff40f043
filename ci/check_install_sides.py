"""Check the per-side install recipes in ci/sides/*.txt against the real packages' declared requirements.

    python ci/check_install_sides.py                 # static: recipes vs installed METADATA (no network)
    python ci/check_install_sides.py --resolve SIDE  # also let pip resolve that side (network; downloads metadata)

Static checks: each side's transformers range lies inside every pin of the packages installed normally on that
side, and the cluster recipe names which packages must go in with --no-deps (those whose pin it violates).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

SIDES = Path(__file__).resolve().parent / "sides"
# Packages installed with their dependencies on each side (the others go in with --no-deps).
WITH_DEPS = {"rollout": ("vllm",), "trainer": ("verl", "megatron-bridge"), "cluster": ("verl",)}
# transformers releases to sweep when proving two ranges disjoint (5.0 .. 5.30, patch releases 0..9).
SWEEP = [Version(f"5.{minor}.{patch}") for minor in range(0, 31) for patch in range(0, 10)]


def recipe(side: str) -> dict[str, SpecifierSet]:
    """The `name -> specifier` lines of ci/sides/<side>.txt."""
    out = {}
    for line in (SIDES / f"{side}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            out[req.name.lower()] = req.specifier
    return out


def declared(distribution: str, dependency: str) -> SpecifierSet:
    """The installed `distribution`'s unconditional pin on `dependency` (empty set if none)."""
    spec = SpecifierSet()
    for raw in metadata.requires(distribution) or []:
        req = Requirement(raw)
        if req.name.lower() == dependency and (req.marker is None or "extra" not in str(req.marker)):
            spec &= req.specifier
    return spec


def allowed(spec: SpecifierSet) -> set[Version]:
    """Swept transformers versions inside `spec`."""
    return {v for v in SWEEP if spec.contains(v, prereleases=False)}


def check(side: str) -> list[str]:
    """Problems with one side's recipe (empty when consistent)."""
    problems = []
    mine = allowed(recipe(side).get("transformers", SpecifierSet()))
    if not mine:
        problems.append(f"{side}: the transformers range admits no release")
    for dist in WITH_DEPS[side]:
        theirs = allowed(declared(dist, "transformers"))
        if not mine <= theirs:
            problems.append(f"{side}: transformers {recipe(side)['transformers']} leaves {dist}'s pin "
                            f"{declared(dist, 'transformers')}")
    return problems


def no_deps_needed(side: str) -> list[str]:
    """Distributions whose transformers pin the side's recipe violates (they must be installed --no-deps)."""
    mine = allowed(recipe(side)["transformers"])
    return [d for d in ("vllm", "verl", "megatron-bridge") if not mine <= allowed(declared(d, "transformers"))]


def resolve(side: str) -> dict[str, str]:
    """Let pip resolve the side's with-deps packages under its recipe (dry run) -> name: version."""
    names = {"rollout": ["vllm==0.33.0"], "trainer": ["verl==0.9.1", "megatron-bridge==0.6.2"],
             "cluster": ["verl==0.9.1"]}[side]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--ignore-requires-python", "--report", str(report), "-c", str(SIDES / f"{side}.txt"), *names]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{side}: pip could not resolve {names}:\n{proc.stderr[-2000:]}")
        data = json.loads(report.read_text())
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in data["install"]}


def main() -> int:
    """Static checks for every side; `--resolve SIDE` adds pip's dry-run resolution."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolve", action="append", default=[], choices=sorted(WITH_DEPS))
    args = parser.parse_args()
    problems = [p for side in WITH_DEPS for p in check(side)]
    for side in WITH_DEPS:
        print(f"{side}: transformers {recipe(side)['transformers']}; --no-deps: {no_deps_needed(side) or 'none'}")
    for side in args.resolve:
        got = resolve(side)
        print(f"{side}: pip resolves " + ", ".join(f"{k}=={got[k]}" for k in ("transformers", "torch", "vllm", "verl")
                                                    if k in got))
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
