"""Fault-injection cases: bad inputs, damaged files, kills, races and full disks against the bridge, the
lifecycle store and the service — one table shared by `tests/faults/` and `python -m dsv4flash.bench faults`.

A case is a function `fn(ctx)` registered with `@case(area, name, expect=..., match=...)`. It provokes one
fault and then checks what it can see: it returns `None` when the operation gave the correct result, or
the `Failure` captured by `ctx.must_fail(...)` / `ctx.cli_must_fail(...)` when the operation refused. It
raises `SilentWrong`, `DataLost` or `LeftBehind` when a check finds one of those. `run_case` classifies:

  clean error     refused with a one-line message (CLI: exit status 2, one `error:` line, no traceback)
  correct result  completed, and every check of the result passed
  silent wrong    completed (or refused) but produced or reported something wrong
  data lost       something acknowledged before the fault is gone or unreadable
  left behind     refused, but a partial output, temp file or lock was left in place
  unclean error   refused with a traceback, a raw library exception or a multi-line message
  hung            did not finish within the case's time limit
"""

from __future__ import annotations

import importlib
import json
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Case", "CaseResult", "Failure", "SilentWrong", "DataLost", "LeftBehind", "Hung", "OUTCOMES", "case",
           "all_cases", "run_case", "AREAS"]

OUTCOMES = ("clean error", "correct result", "silent wrong", "data lost", "left behind", "unclean error", "hung")
AREAS = ("bridge", "lifecycle", "service")


class _Verdict(BaseException):
    """A finding of a check; BaseException so `ctx.must_fail` never swallows it."""


class SilentWrong(_Verdict):
    """The operation completed (or refused) but its result or report is wrong."""


class DataLost(_Verdict):
    """Something acknowledged before the fault is gone or unreadable."""


class LeftBehind(_Verdict):
    """A refused operation left partial output, a temp file or a lock behind."""


class Hung(_Verdict):
    """The case ran past its time limit."""


@dataclass
class Failure:
    """How an operation refused: an exception (API) or an exit status and its stderr (CLI)."""

    message: str
    exception: BaseException | None = None
    exit_code: int | None = None
    traceback: bool = False

    def is_clean(self) -> bool:
        """One line naming the problem: no traceback, no raw decoding error, exit 2 for a CLI."""
        if self.traceback or not self.message.strip() or "\n" in self.message.strip():
            return False
        if self.exit_code is not None:
            return self.exit_code == 2 and self.message.startswith("error: ")
        return not isinstance(self.exception, _RAW) and isinstance(self.exception, _CLEAN)


@dataclass(frozen=True)
class Case:
    """One registered fault case."""

    area: str
    name: str
    fn: Callable
    expect: str
    match: str | None = None
    needs: tuple[str, ...] = ()  # resources: "postgres"
    timeout_s: float = 60.0

    @property
    def id(self) -> str:
        """`area/function-name`: stable, for test ids and the JSON report."""
        return f"{self.area}/{self.fn.__name__}"


@dataclass
class CaseResult:
    """The outcome of one case and what it saw."""

    case: Case
    outcome: str
    detail: str = ""
    seconds: float = 0.0

    @property
    def as_expected(self) -> bool:
        """Outcome as registered, and (for a clean error) the message matches the case's pattern."""
        if self.outcome != self.case.expect:
            return False
        return self.case.match is None or re.search(self.case.match, self.detail) is not None


_CASES: list[Case] = []
# What a user may see from an API call: the library's own errors (all ValueError/KeyError/RuntimeError
# subclasses) and OSError from the system. Never a decoder's or an indexing error from deep inside.
_CLEAN: tuple[type, ...] = (ValueError, KeyError, TypeError, OSError, RuntimeError)
_RAW: tuple[type, ...] = (json.JSONDecodeError, UnicodeDecodeError, IndexError, AttributeError, AssertionError,
                          ZeroDivisionError)


def case(area: str, name: str, *, expect: str = "clean error", match: str | None = None,
         needs: tuple[str, ...] = (), timeout_s: float = 60.0):
    """Register `fn(ctx)` as a fault case."""
    if area not in AREAS or expect not in OUTCOMES[:2]:
        raise ValueError(f"case {name!r}: area must be one of {AREAS}, expect one of {OUTCOMES[:2]}")

    def register(fn: Callable) -> Callable:
        _CASES.append(Case(area, name, fn, expect, match, tuple(needs), timeout_s))
        return fn
    return register


def all_cases() -> list[Case]:
    """Every registered case, in area order then definition order."""
    for area in AREAS:
        importlib.import_module(f"dsv4flash.faultcases.{area}")
    return sorted(_CASES, key=lambda c: AREAS.index(c.area))


def run_case(c: Case, ctx) -> CaseResult:
    """Run one case in a fresh work directory of `ctx` and classify what happened."""
    start = time.perf_counter()

    def on_alarm(signum, frame):
        raise Hung(f"still running after {c.timeout_s:.0f} s")
    try:  # the watchdog interrupts even a blocking open() (a FIFO) or a lock wait
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, c.timeout_s)
    except ValueError:  # not the main thread: no watchdog
        previous = None
    try:
        with ctx.fresh(c.id):
            returned = c.fn(ctx)
        if returned is None:
            outcome, detail = "correct result", ""
        elif isinstance(returned, Failure):
            outcome = "clean error" if returned.is_clean() else "unclean error"
            detail = returned.message.strip()
        else:
            outcome, detail = "silent wrong", f"case returned {returned!r}"
    except SilentWrong as exc:
        outcome, detail = "silent wrong", str(exc)
    except DataLost as exc:
        outcome, detail = "data lost", str(exc)
    except LeftBehind as exc:
        outcome, detail = "left behind", str(exc)
    except Hung as exc:
        outcome, detail = "hung", str(exc)
    except Exception as exc:  # escaped the case: a traceback for the user
        outcome, detail = "unclean error", f"{type(exc).__name__}: {exc}"
    finally:
        if previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return CaseResult(c, outcome, detail, time.perf_counter() - start)


@dataclass
class Totals:
    """Counts per outcome over a set of results."""

    tried: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {o: 0 for o in OUTCOMES})

    @classmethod
    def of(cls, results: list[CaseResult]) -> "Totals":
        """Tally results."""
        totals = cls(len(results))
        for r in results:
            totals.counts[r.outcome] += 1
        return totals
