"""The layout matrix of docs/megatron.md, generated from the tests' `layout` marks so it cannot drift.

A test (or one parametrization of it) that verifies a parallel layout carries
`pytest.mark.layout(tp=, pp=, cp=, ep=, packed=, recompute=, offload=, check=)`; a test that checks a
refusal carries `status="refused", key=<the config key the error names>, reason=<why>`; a `gpu`-marked
test carries `status="gpu"` (it runs on CUDA machines only, so the table does not count it as tested here). `collect()` reads
the marks off the test modules, `render()` writes the table, and `test_layout_matrix.py` fails when the
table in docs/megatron.md differs from it. Regenerate with

    python tests/mcore/layout_matrix.py --write
"""

from __future__ import annotations

import argparse
import importlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

LAYOUT = pytest.mark.layout
DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron.md"
BEGIN = "<!-- layout-matrix:begin (generated: python tests/mcore/layout_matrix.py --write) -->"
END = "<!-- layout-matrix:end -->"
MODULES = tuple(sorted(p.stem for p in Path(__file__).resolve().parent.glob("test_*.py")))  # every test module
AXES = dict(tp=(1, 2), pp=(1, 2, 4), cp=(1, 2), ep=(1, 2), packed=(False, True), recompute=("none", "full"),
            offload=(False, True))


@dataclass(frozen=True)
class Row:
    """One combination and what the test suite says about it."""

    tp: int
    pp: int
    cp: int
    ep: int
    packed: bool
    recompute: str
    offload: bool
    status: str  # "equal" | "gpu" (a `gpu` test: equality checked on a CUDA machine only) | "refused"
    check: str  # what is compared / the refusal reason
    test: str

    def axes(self) -> tuple:
        """The combination, with the recompute flavour reduced to none/full."""
        return (self.tp, self.pp, self.cp, self.ep, self.packed,
                "none" if self.recompute == "none" else "full", self.offload)


def _row(mark, test: str) -> Row:
    kw = dict(mark.kwargs)
    status = kw.pop("status", "equal")
    check = f"`{kw.pop('key')}`: {kw.pop('reason')}" if status == "refused" else kw.pop("check", "")
    axes = {name: kw.pop(name, values[0]) for name, values in AXES.items()}
    if kw:
        raise ValueError(f"{test}: unknown layout mark fields {sorted(kw)}")
    return Row(**axes, status=status, check=check, test=test)


def collect() -> list[Row]:
    """Every `layout` mark on the tests of tests/mcore (functions and their parametrizations)."""
    rows = []
    for module_name in MODULES:
        module = importlib.import_module(f"tests.mcore.{module_name}")
        for name, fn in sorted(vars(module).items()):
            if not name.startswith("test_") or not callable(fn):
                continue
            test = f"{module_name}.py::{name}"
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "layout":
                    rows.append(_row(mark, f"`{test}`"))
                elif mark.name == "parametrize":
                    for value in mark.args[1]:
                        for inner in getattr(value, "marks", ()):
                            if inner.name == "layout":
                                rows.append(_row(inner, f"`{test}[{value.id}]`"))
    order = {"equal": 0, "gpu": 1, "refused": 2}
    return sorted(rows, key=lambda r: (order[r.status], r.axes(), r.recompute, r.test))


def render(rows: list[Row]) -> str:
    """The markdown table and the count of combinations no test covers."""
    yes = lambda flag: "yes" if flag else "–"  # noqa: E731
    lines = ["| TP | PP | CP | EP | packed | recompute | offload | status | what is checked / why refused | test |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = {"equal": "**tested equal**", "gpu": "`gpu` test (CUDA only)", "refused": "refused"}[r.status]
        lines.append(f"| {r.tp} | {r.pp} | {r.cp} | {r.ep} | {yes(r.packed)} | {r.recompute} | {yes(r.offload)} | "
                     f"{status} | {r.check} | {r.test} |")
    equal = {r.axes() for r in rows if r.status == "equal"}
    space = list(itertools.product(*AXES.values()))
    rest = len(space) - len(equal)
    lines += ["", f"Of the {len(space)} combinations of TP ∈ {{1, 2}}, PP ∈ {{1, 2, 4}}, CP ∈ {{1, 2}}, EP ∈ {{1, 2}}, "
              f"packed, recompute ∈ {{none, full}} and optimizer CPU offload, {len(equal)} are tested equal above "
              f"on CPU; the other {rest} (the `gpu` rows included) are accepted by the config (given the settings "
              "the refused rows name) but **not tested together** — no claim is made for them."]
    return "\n".join(lines)


def section(text: str) -> str:
    """The generated part of docs/megatron.md."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC}: the layout matrix markers are missing")
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


def main(argv=None) -> int:
    """Print the table, or `--write` it into docs/megatron.md between its markers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in docs/megatron.md")
    args = parser.parse_args(argv)
    table = render(collect())
    if not args.write:
        print(table)
        return 0
    from dsv4flash.atomic_io import write_bytes_atomic

    text = DOC.read_text()
    section(text)  # the markers must be there
    head, rest = text.split(BEGIN, 1)
    write_bytes_atomic(DOC, f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}".encode())
    return 0


def _use_this_repository_tests() -> None:
    """Run as a script: make `tests` this repository's test tree (the verl wheel ships a `tests` package)."""
    import importlib.machinery
    import importlib.util
    import sys

    root = str(Path(__file__).resolve().parents[1])
    for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
        del sys.modules[name]
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("tests", None, is_package=True))
    package.__path__ = [root]
    sys.modules["tests"] = package


if __name__ == "__main__":
    _use_this_repository_tests()
    raise SystemExit(main())
