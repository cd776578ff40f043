"""PNG figures of the study: train/validation curves per placement, and ρ_c / zeroing bar charts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path


def plot_curves(name: str, runs: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """One placement: train loss (thin) and validation loss (markers) per seed, plateau steps shaded."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, r in enumerate(sorted(runs, key=lambda r: r["seed"])):
        colour = f"C{i}"
        train = [(p["step"], p["loss"]) for p in r["curve"] if "loss" in p]
        val = [(p["step"], p["val_loss"]) for p in r["curve"] if "val_loss" in p]
        if train:
            ax.plot(*zip(*train), color=colour, alpha=0.35, lw=1, label=f"train, seed {r['seed']}")
        ax.plot(*zip(*val), "o-", color=colour, ms=3, label=f"val, seed {r['seed']}")
    for step in runs[0]["plateau"]:
        ax.axvline(step, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{name}: train / validation loss (dotted: plateau evaluations)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_overview(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Plateau loss per placement with the across-seed range as an error bar."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    xs = range(len(rows))
    means = [r["plateau_val_loss"] for r in rows]
    lower = [r["plateau_val_loss"] - r["min_seed"] for r in rows]
    upper = [r["max_seed"] - r["plateau_val_loss"] for r in rows]
    ax.errorbar(xs, means, yerr=[lower, upper], fmt="o", capsize=4)
    ax.set_xticks(list(xs), [r["placement"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("plateau validation loss (mean over seeds, bar: min–max)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_diagnostics(energy_rows: Sequence[Mapping[str, Any]], zero_rows: Sequence[Mapping[str, Any]],
                     path: Path, title: str) -> Path:
    """Left: G_c/G next to n_c/n per group (ρ_c annotated). Right: val-loss change when a group is zeroed."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    groups = [r["group"] for r in energy_rows]
    xs = range(len(groups))
    width = 0.4
    ax1.bar([x - width / 2 for x in xs], [r["G_c/G"] for r in energy_rows], width, label="gradient energy G_c/G")
    ax1.bar([x + width / 2 for x in xs], [r["n_c/n"] for r in energy_rows], width, label="parameters n_c/n")
    for x, r in zip(xs, energy_rows):
        ax1.annotate(f"ρ={r['rho_c']:.2g}", (x, max(r["G_c/G"], r["n_c/n"])), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(xs), groups, rotation=30, ha="right")
    ax1.set_ylabel("share")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, axis="y")
    labels = [r["zeroed"] for r in zero_rows]
    ax2.bar(range(len(labels)), [r["delta_val_loss"] for r in zero_rows],
            color=["C3" if r["zeroed"] == "all" else "C2" for r in zero_rows])
    ax2.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax2.set_ylabel("Δ validation loss when zeroed")
    ax2.axhline(0, color="black", lw=0.6)
    ax2.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out
