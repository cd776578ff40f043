"""Placement report: adapter size per preset and module group on any config (a `meta` model, no memory).

    python -m dsv4flash.lora --config flash            # every preset, rich table
    python -m dsv4flash.lora --config tiny --preset decoder_half --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsv4flash.lora.apply import plan_lora
from dsv4flash.lora.config import PRESETS, LoraConfig


def placement_rows(config: str, presets: list[str]) -> list[dict]:
    """One row per preset: totals, share per group and tensor counts (packed vs per-expert files)."""
    from dsv4flash.model.transformer import Transformer

    model = Transformer(config, dtype=torch.bfloat16, device="meta")
    rows = []
    for preset in presets:
        handle = plan_lora(model, LoraConfig(preset=preset))
        experts = [a for a in handle.adapters if a.kind == "packed_experts"]
        packed = 2 * len(handle.adapters)
        rows.append({
            "preset": preset, "rank": handle.config.rank, "layers": list(handle.layers()),
            "modules": len(handle.modules), "params": handle.trainable_params,
            "master_bytes": handle.master_bytes, "by_group": handle.params_by_group(),
            "tensors_packed": packed,
            "tensors_per_expert": packed + sum(2 * (a.shape_a[0] - 1) for a in experts),
        })
    return rows


def _print(rows: list[dict], config: str) -> None:
    from rich.console import Console
    from rich.table import Table

    groups = sorted({g for r in rows for g in r["by_group"]}, key=lambda g: -max(r["by_group"].get(g, 0) for r in rows))
    table = Table(title=f"LoRA placements on {config}")
    for col in ("preset", "rank", "params", "fp32 master", "tensors packed / per-expert", *groups):
        table.add_column(col, justify="left" if col == "preset" else "right")
    for r in rows:
        shares = [f"{100 * r['by_group'].get(g, 0) / r['params']:.1f}%" for g in groups]
        table.add_row(r["preset"], str(r["rank"]), f"{r['params']:,}", f"{r['master_bytes'] / 2**30:,.2f} GiB",
                      f"{r['tensors_packed']:,} / {r['tensors_per_expert']:,}", *shares)
    Console(width=240).print(table)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({g for r in rows for g in r["by_group"]})
    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(rows)
    for g in groups:
        vals = [r["by_group"].get(g, 0) / 1e6 for r in rows]
        ax.bar([r["preset"] for r in rows], vals, bottom=bottom, label=g)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("adapter parameters (M)")
    ax.set_title("LoRA placement size by module group")
    ax.legend(fontsize=7, ncol=2)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: print (and optionally save/plot) the placement table."""
    parser = argparse.ArgumentParser(prog="python -m dsv4flash.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="tiny | flash | path to a config.json")
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable; default: all")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--plot", type=Path, help="write a stacked-bar PNG")
    args = parser.parse_args(argv)
    rows = placement_rows(args.config, args.preset or list(PRESETS))
    _print(rows, args.config)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        _plot(rows, args.plot)
    return 0
