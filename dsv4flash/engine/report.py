"""Run outputs: metrics log (JSON lines), run summary (JSON) and the loss-curve plot (PNG)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dsv4flash.atomic_io import write_bytes_atomic


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON atomically."""
    return write_bytes_atomic(path, (json.dumps(data, indent=1, sort_keys=True, default=str) + "\n").encode())


def write_history(path: str | os.PathLike, history: list[dict[str, Any]]) -> Path:
    """All step records as JSON lines (rewritten whole, atomically)."""
    return write_bytes_atomic(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in history).encode())


def plot_curves(history: list[dict[str, Any]], path: str | os.PathLike, title: str) -> Path | None:
    """Train loss and val loss against step (left), val/train reward (right) -> PNG; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    rewards = {key: [(r["step"], r[key]) for r in history if key in r] for key in ("reward", "val_reward")}
    has_reward = any(rewards.values())
    fig, axes = plt.subplots(1, 2 if has_reward else 1, figsize=(11 if has_reward else 6, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss", alpha=0.6)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss (reference answers)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if has_reward:
        ax2 = axes[0][1]
        curves = (("reward", "train reward (sampled)", "-"), ("val_reward", "val reward (greedy)", "o-"))
        for key, label, style in curves:
            if rewards[key]:
                ax2.plot(*zip(*rewards[key]), style, label=label)
        ax2.set_xlabel("step")
        ax2.set_ylabel("reward")
        ax2.set_ylim(-0.02, 1.02)
        ax2.legend()
        ax2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
