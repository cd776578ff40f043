"""Writers of the study's outputs: Markdown and CSV tables (atomic), JSON records, and the Table-2 summary."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from statistics import median
from typing import Any, Mapping, Sequence


def atomic_write(path: str | os.PathLike, text: str) -> Path:
    """Write text to a temp sibling, fsync, rename: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """JSON, atomically."""
    return atomic_write(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats to `digits` decimals, None/NaN as '—', ints with thousands separators."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], digits: int = 4) -> str:
    """Rows -> a GitHub Markdown table over `columns` (a missing key is an error naming row and column)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for i, row in enumerate(rows):
        missing = [c for c in columns if c not in row]
        if missing:
            raise KeyError(f"markdown_table: row {i} lacks columns {missing}")
        lines.append("| " + " | ".join(fmt(row[c], digits).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Rows -> CSV over `columns` (full precision, empty cell for None)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row[c] is None else row[c] for c in columns])
    return buf.getvalue()


def write_tables(stem: str | os.PathLike, rows: Sequence[Mapping[str, Any]], columns: Sequence[str], *,
                 title: str = "", notes: Sequence[str] = (), digits: int = 4) -> tuple[Path, Path]:
    """`<stem>.md` (title, table, notes) and `<stem>.csv`, both atomic -> their paths."""
    stem = Path(stem)
    md = (f"# {title}\n\n" if title else "") + markdown_table(rows, columns, digits)
    if notes:
        md += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return (atomic_write(stem.with_suffix(".md"), md), atomic_write(stem.with_suffix(".csv"), csv_text(rows, columns)))


TABLE2_COLUMNS = ("placement", "seeds", "plateau_val_loss", "range", "min_seed", "max_seed", "delta_vs_ref",
                  "final_val_loss", "trainable_params", "master_MiB", "step_time_s", "peak_mem_MiB")


def table2_rows(results: Sequence[Mapping[str, Any]], order: Sequence[str], reference: str | None) -> list[dict]:
    """Per-run results -> one row per placement: plateau mean over seeds, min/max/range across seeds, sizes,
    median step time, peak memory (max over seeds), and the difference to the `reference` placement."""
    by_variant: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by_variant.setdefault(r["variant"], []).append(r)
    rows = []
    for name in order:
        runs = sorted(by_variant.get(name, []), key=lambda r: r["seed"])
        if not runs:
            continue
        plateaus = [float(r["plateau_val_loss"]) for r in runs]
        mean = sum(plateaus) / len(plateaus)
        peaks = [r.get("peak_mem_bytes") for r in runs if r.get("peak_mem_bytes")]
        rows.append({
            "placement": name, "seeds": len(runs), "plateau_val_loss": mean,
            "range": max(plateaus) - min(plateaus), "min_seed": min(plateaus), "max_seed": max(plateaus),
            "final_val_loss": sum(float(r["final_val_loss"]) for r in runs) / len(runs),
            "trainable_params": int(runs[0]["trainable_params"]),
            "master_MiB": runs[0]["master_bytes"] / 2**20,
            "step_time_s": median(float(r["step_time_median_s"]) for r in runs),
            "peak_mem_MiB": max(peaks) / 2**20 if peaks else None,
        })
    ref = next((r["plateau_val_loss"] for r in rows if r["placement"] == reference), None)
    for row in rows:
        row["delta_vs_ref"] = None if ref is None else row["plateau_val_loss"] - ref
    return rows
