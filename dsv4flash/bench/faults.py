"""`python -m dsv4flash.bench faults`: run the fault-case table and count what happened.

The cases are `dsv4flash.faultcases` — the same table `tests/faults/` asserts case by case. Each case
provokes one fault (bad input, damaged file, kill, race, full disk) and is classified: clean error, correct
result, silent wrong, data lost, left behind, unclean error, hung. The report gives the totals with their
share of the cases tried, per area too, and MET/MISS against the targets: nothing silently wrong, nothing
lost, nothing left behind, no traceback, nothing hung, every case as registered. PostgreSQL cases use
`--postgres DSN`, else a throwaway local server when one is installed, else they are counted as not run.
"""

from __future__ import annotations

import argparse
import tempfile
from contextlib import ExitStack

from dsv4flash.bench.report import BenchReport

BAD = ("silent wrong", "data lost", "left behind", "unclean error", "hung")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--area", action="append", choices=("bridge", "lifecycle", "service"),
                        help="only these areas (repeatable; default all)")
    parser.add_argument("--postgres", metavar="DSN", help="PostgreSQL server for the PostgreSQL cases "
                                                          "(default: start a throwaway local one if installed)")
    parser.add_argument("--no-postgres", action="store_true", help="do not run the PostgreSQL cases")
    parser.add_argument("--workdir", help="where cases write (default: a temp dir, removed afterwards)")
    parser.add_argument("--list", action="store_true", help="print every case's outcome, not only the unexpected")
    parser.add_argument("--plot", metavar="PNG", help="also draw the outcomes per area as a stacked bar chart")


def run(args: argparse.Namespace) -> BenchReport:
    """Run the cases and tabulate the outcomes."""
    from rich.progress import Progress

    from dsv4flash.faultcases import OUTCOMES, Totals, all_cases, run_case
    from dsv4flash.faultcases.context import FaultContext

    cases = [c for c in all_cases() if not args.area or c.area in args.area]
    results, not_run = [], []
    with ExitStack() as stack:
        root = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="dsv4flash-faults-"))
        server = None if args.no_postgres else (args.postgres or _local_postgres(stack))
        ctx = FaultContext(root, postgres_server=server)
        with Progress() as progress:
            task = progress.add_task("fault cases", total=len(cases))
            for c in cases:
                progress.update(task, description=c.id)
                if "postgres" in c.needs and server is None:
                    not_run.append(c)
                else:
                    results.append(run_case(c, ctx))
                progress.advance(task)
    totals = Totals.of(results)
    report = BenchReport("fault cases: what a bad input, damaged file, kill, race or full disk leads to")
    report.add("tried", totals.tried, "cases", note=f"{len(not_run)} PostgreSQL case(s) not run" if not_run else "")
    for outcome in OUTCOMES:
        report.add(outcome, totals.counts[outcome], "cases", baseline="tried")
    expected = sum(r.as_expected for r in results)
    report.add("as registered", expected, "cases", baseline="tried", note="outcome and message as the table says")
    for area in sorted({c.area for c in cases}):
        mine = [r for r in results if r.case.area == area]
        report.add(f"{area}: tried", len(mine), "cases")
        report.add(f"{area}: bad outcomes", sum(r.outcome in BAD for r in mine), "cases", baseline=f"{area}: tried")
    report.add("seconds", sum(r.seconds for r in results), "s", note="all cases, one after another")
    for outcome in BAD:
        report.target(f"{outcome}: 0 (got {totals.counts[outcome]})", totals.counts[outcome] == 0)
    report.target(f"every case as registered ({expected} of {totals.tried})", expected == totals.tried)
    for r in results:
        if args.list or not r.as_expected:
            report.targets.append(f"      {'ok  ' if r.as_expected else 'FAIL'} {r.outcome:14s} {r.case.id}: "
                                  f"{r.detail[:160]}")
    if args.plot:
        _plot(results, args.plot)
    return report


def _local_postgres(stack: ExitStack) -> str | None:
    """A throwaway server's DSN when PostgreSQL and psycopg are installed (None otherwise)."""
    from dsv4flash.lifecycle.catalog.pg_local import postgres_bin, throwaway_server

    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None
    return stack.enter_context(throwaway_server()) if postgres_bin() is not None else None


def _plot(results, path: str) -> None:
    """Stacked bars: per area, how many cases ended in each outcome."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dsv4flash.faultcases import OUTCOMES

    areas = sorted({r.case.area for r in results})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0] * len(areas)
    for outcome in OUTCOMES:
        counts = [sum(r.case.area == a and r.outcome == outcome for r in results) for a in areas]
        if any(counts):
            ax.bar(areas, counts, bottom=bottom, label=outcome)
            bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_ylabel("cases")
    ax.set_title("fault cases by outcome")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
