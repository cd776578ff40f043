"""Benchmark report: a table of side-by-side figures with ratios, also written as flat JSON."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Figure:
    """One measured number, optionally compared with a baseline figure and a physical limit."""

    name: str
    value: float
    unit: str
    baseline: str | None = None  # name of the figure this one is compared with
    limit: str | None = None  # name of the figure that bounds this one (e.g. memcpy bandwidth)
    note: str = ""


@dataclass
class BenchReport:
    """All figures of one benchmark run, printable as a table and dumpable as `{name: number}` JSON."""

    title: str
    figures: list[Figure] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # human-readable target lines, with pass/miss

    def add(self, name: str, value: float, unit: str, **kwargs) -> Figure:
        """Record a figure and return it."""
        fig = Figure(name, float(value), unit, **kwargs)
        self.figures.append(fig)
        return fig

    def value(self, name: str) -> float:
        """Look up a recorded figure by name."""
        for fig in self.figures:
            if fig.name == name:
                return fig.value
        raise KeyError(f"no figure named {name!r} in benchmark {self.title!r}")

    def target(self, text: str, met: bool) -> None:
        """Record whether a stated target was met (reported, never asserted)."""
        self.targets.append(f"{'MET ' if met else 'MISS'}  {text}")

    def as_dict(self) -> dict[str, float]:
        """Flat `figure name -> number` mapping, ratios included as `<name>/<baseline>`."""
        out: dict[str, float] = {}
        for fig in self.figures:
            out[fig.name] = fig.value
            for other in (fig.baseline, fig.limit):
                if other:
                    denom = self.value(other)
                    out[f"{fig.name}/{other}"] = fig.value / denom if denom else float("nan")
        return out

    def render(self) -> str:
        """The table as text (rich is used by `print` when available)."""
        rows = [("figure", "value", "unit", "vs baseline", "vs limit", "note")]
        for fig in self.figures:
            ratios = []
            for other in (fig.baseline, fig.limit):
                if other:
                    denom = self.value(other)
                    ratios.append(f"{fig.value / denom:.3f}× {other}" if denom else "n/a")
                else:
                    ratios.append("")
            rows.append((fig.name, f"{fig.value:.4g}", fig.unit, ratios[0], ratios[1], fig.note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"== {self.title} =="]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(self.targets)
        return "\n".join(lines)

    def write_json(self, path: str | os.PathLike) -> None:
        """Write the flat figures atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
