"""Console output of the local engine: what a run does, as it does it.

`ProgressLog.task(label, total, unit)` tracks one long step (training, an evaluation, the base build's steps):
on a terminal a rich bar with rate and ETA; piped, `RateLine` plain lines (the first update, then at most one
per `every_s`, and the last), so a log always shows the rate and the ETA; a unit of work that runs longer than
`every_s` (the first batch of greedy decodes of an evaluation) gets a heartbeat line, so piped output never falls
silent for longer. Every message and every plain
progress line also goes to the run log file when one is given (`<output_dir>/train.log` from
`python -m dsv4flash.train`), so the log holds what the console showed.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

_SHOWN = ("loss", "reward", "val_loss", "val_reward", "rollout_corr/corrected_fraction", "reward_accuracy", "lr",
          "step_time")
_SHORT = {"rollout_corr/corrected_fraction": "masked", "reward_accuracy": "pref_acc", "step_time": "s/step"}
PLAIN_EVERY_S = 15.0  # piped output: a progress line at least this often while updates arrive


def format_duration(seconds: float) -> str:
    """`42s`, `3m07s`, `1h02m`."""
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class RateLine:
    """Throttled plain progress lines: `label done/total (pct%)  rate unit/s  elapsed  ETA  status`.

    `update(done)` returns the line to show, or None while the last line is younger than `every_s`; the
    first update and the one reaching `total` always give a line. `clock` is injectable (tests).
    """

    def __init__(self, label: str, total: int, *, unit: str = "it", start: int = 0, every_s: float = PLAIN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.unit, self.start, self.every_s, self.clock = label, total, unit, start, every_s, clock
        self.t0 = clock()
        self.last: float | None = None

    def update(self, done: int, status: str = "") -> str | None:
        """The line for `done` items finished, if one is due."""
        now = self.clock()
        if self.last is not None and now - self.last < self.every_s and done < self.total:
            return None
        self.last = now
        return self.format(done, now, status)

    def format(self, done: int, now: float, status: str = "") -> str:
        """The line itself (rate over the items done since `start`; no ETA before the first one)."""
        elapsed = now - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 and done > self.start else None
        pct = 100.0 * done / self.total if self.total else 100.0
        parts = [f"{self.label} {done}/{self.total} ({pct:.0f}%)"]
        parts.append(f"{rate:.3g} {self.unit}/s" if rate is not None else f"- {self.unit}/s")
        parts.append(f"elapsed {format_duration(elapsed)}")
        if done >= self.total:
            parts.append("done")
        elif rate is not None:
            parts.append(f"ETA {format_duration((self.total - done) / rate)}")
        if status:
            parts.append(status)
        return "  ".join(parts)


class Task:
    """One tracked step; `advance(n, status)` after each unit of work."""

    def __init__(self, log: "ProgressLog", plain: RateLine, bar: Any = None, bar_task: Any = None) -> None:
        self.log, self.plain, self.bar, self.bar_task = log, plain, bar, bar_task
        self.done = plain.start
        self._lock = threading.Lock()  # advance (the worker) and heartbeat (a timer thread) share the RateLine

    def advance(self, n: int = 1, status: str = "") -> None:
        """`n` more units done; refresh the bar, or print a plain line when one is due."""
        with self._lock:
            self.done += n
            if self.bar is not None:
                elapsed, count = self.plain.clock() - self.plain.t0, self.done - self.plain.start
                rate = f"{count / elapsed:.3g} {self.plain.unit}/s" if elapsed > 0 and count > 0 else ""
                self.bar.update(self.bar_task, advance=n, status=status, rate=rate)
            line = self.plain.update(self.done, status)
        if line is not None:
            self.log.emit_progress(line)

    def heartbeat(self) -> None:
        """A plain line for a step still at work when none has come for `every_s` (a slow unit of work)."""
        with self._lock:
            line = self.plain.update(self.done, "working") if self.done < self.plain.total else None
        if line is not None:
            self.log.emit_progress(line)


class ProgressLog:
    """`mode`: auto (bar only on a terminal), on, off (plain lines either way when not a bar). Log lines go to
    stdout, and to `log_file` when given."""

    def __init__(self, mode: str = "auto", log_file: str | Path | None = None, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, heartbeat_s: float | None = None) -> None:
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"engine.progress must be auto, on or off, got {mode!r}")
        from rich.console import Console

        self.console = Console(file=stream or sys.stdout, highlight=False, soft_wrap=True)
        self.enabled = mode == "on" or (mode == "auto" and self.console.is_terminal)
        self.clock = clock
        # piped output: how often a timer thread looks for a silent step (real clock only; with an injected
        # clock a test calls Task.heartbeat itself)
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else \
            (PLAIN_EVERY_S / 3 if clock is time.monotonic else None)
        self._live: Any = None  # the rich Progress shown now, if any
        self.log_file = Path(log_file) if log_file is not None else None
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)

    def _to_file(self, text: str) -> None:
        if self.log_file is not None:
            stamp = time.strftime("%H:%M:%S")
            with open(self.log_file, "a", encoding="utf-8") as handle:
                handle.write("".join(f"{stamp} {line}\n" for line in text.splitlines() or [""]))

    def print(self, text: str) -> None:
        """A plain message (console and run log)."""
        self.console.print(text, markup=False)
        self.console.file.flush()  # logs must show up promptly when stdout is a file or pipe
        self._to_file(text)

    def emit_progress(self, line: str) -> None:
        """A plain progress line: on the console unless a bar shows the same, always in the run log."""
        if self.enabled:
            self._to_file(line)
        else:
            self.print(line)

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
    def task(self, label: str, total: int, *, unit: str = "it", start: int = 0) -> Iterator[Task]:
        """Track `total` units of `label` (a bar on a terminal, throttled plain lines otherwise)."""
        plain = RateLine(label, total, unit=unit, start=start, clock=self.clock)
        if not self.enabled:
            task = Task(self, plain)
            if self.heartbeat_s is None:
                yield task
                return
            stop = threading.Event()

            def beat() -> None:
                while not stop.wait(self.heartbeat_s):
                    task.heartbeat()

            timer = threading.Thread(target=beat, name=f"progress-{label}", daemon=True)
            timer.start()
            try:
                yield task
            finally:
                stop.set()
                timer.join()
            return
        if self._live is not None:  # nested (an evaluation inside training): a second row of the same display
            bar_task = self._live.add_task(label, total=total, completed=start, status="", rate="", label=label)
            try:
                yield Task(self, plain, self._live, bar_task)
            finally:
                self._live.remove_task(bar_task)
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        progress = Progress(TextColumn("[bold]{task.fields[label]}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[rate]}"),
                            TextColumn("{task.fields[status]}"), console=self.console)
        self._live = progress
        try:
            with progress:
                bar_task = progress.add_task(label, total=total, completed=start, status="", rate="", label=label)
                yield Task(self, plain, progress, bar_task)
        finally:
            self._live = None
