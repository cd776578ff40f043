"""Console output of the local engine: a rich progress bar (on a terminal) and one-line step logs."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

_SHOWN = ("loss", "reward", "val_loss", "val_reward", "rollout_corr/corrected_fraction", "reward_accuracy", "lr",
          "step_time")
_SHORT = {"rollout_corr/corrected_fraction": "masked", "reward_accuracy": "pref_acc", "step_time": "s/step"}


class _Bar:
    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task = progress, task

    def advance(self, record: dict[str, Any]) -> None:
        """One step done; show its loss (and reward) in the bar."""
        if self.progress is not None:
            text = f"loss {record.get('loss', float('nan')):.4f}"
            if "reward" in record:
                text += f"  reward {record['reward']:.3f}"
            self.progress.update(self.task, advance=1, status=text)


class ProgressLog:
    """`mode`: auto (bar only on a terminal), on, off. Log lines always go to stdout."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"engine.progress must be auto, on or off, got {mode!r}")
        from rich.console import Console

        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.enabled = mode == "on" or (mode == "auto" and self.console.is_terminal)

    def print(self, text: str) -> None:
        """A plain message."""
        self.console.print(text, markup=False)
        self.console.file.flush()  # logs must show up promptly when stdout is a file or pipe

    def line(self, step: int, total: int, record: dict[str, Any]) -> None:
        """`step k/N  loss …  reward …  val_loss …` for the keys present."""
        parts = [f"step {step:>4}/{total}"]
        for key in _SHOWN:
            if key in record:
                value = record[key]
                parts.append(f"{_SHORT.get(key, key)} {value:.3g}" if key in ("lr", "step_time")
                             else f"{_SHORT.get(key, key)} {value:.4f}")
        self.print("  ".join(parts))

    @contextmanager
    def bar(self, total: int, start: int) -> Iterator[_Bar]:
        """A progress bar over the steps (a no-op when disabled)."""
        if not self.enabled:
            yield _Bar(None, None)
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=self.console)
        with progress:
            task = progress.add_task("train", total=total, completed=start, status="")
            yield _Bar(progress, task)
