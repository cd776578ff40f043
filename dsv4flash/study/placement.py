"""`python -m dsv4flash.study placement`: every placement × seed, the analogue of the study's Table 2.

Outputs in `out=` (default `study/placement`): `table2.md` / `table2.csv`, `curves/<placement>.png`,
`overview.png`, and per run `runs/<placement>/seed<k>-<hash>/result.json` (finished cells are skipped).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from dsv4flash.study import plots
from dsv4flash.study.runner import launch, load_result, make_spec, run_dir
from dsv4flash.study.stats import PLATEAU_FRACTIONS
from dsv4flash.study.tables import TABLE2_COLUMNS, table2_rows, write_json, write_tables
from dsv4flash.study.variants import DEFAULT_VARIANTS, resolve_variant

REFERENCE = "full_linear"


@dataclass
class PlacementArgs:
    """Study options (`key=value` on the command line); anything else is passed to the train entry."""

    seeds: int = 3
    steps: int = 100
    presets: list[str] = field(default_factory=lambda: list(DEFAULT_VARIANTS))
    out: str = "study/placement"
    jobs: int = 1
    plateau: list[float] = field(default_factory=lambda: list(PLATEAU_FRACTIONS))
    seed0: int = 0
    overrides: list[str] = field(default_factory=list)


def run_placement(args: PlacementArgs, log=print) -> dict:
    """Run the missing cells of the grid, then write the table and plots -> {'rows', 'ran', 'skipped', ...}."""
    if args.seeds < 1 or args.jobs < 1:
        raise ValueError(f"seeds and jobs must be ≥ 1, got seeds={args.seeds} jobs={args.jobs}")
    if not args.presets:
        raise ValueError("presets= is empty; name at least one placement, e.g. presets=[full_linear,decoder_half]")
    variants = [resolve_variant(p) for p in args.presets]
    root = Path(args.out).expanduser()
    cells = [(v, make_spec(v, s, args.steps, list(args.overrides), args.plateau))
             for v in variants for s in range(args.seed0, args.seed0 + args.seeds)]
    todo, skipped = [], []
    for variant, spec in cells:
        (skipped if load_result(run_dir(root, spec)) is not None else todo).append(spec)
    log(f"placement study: {len(cells)} runs ({len(variants)} placements × {args.seeds} seeds, {args.steps} steps, "
        f"plateau steps {list(cells[0][1].plateau)}); {len(skipped)} finished, {len(todo)} to run; out {root}")
    failed = _run_cells(root, todo, args.jobs, log)
    results = [r for _, spec in cells if (r := load_result(run_dir(root, spec))) is not None]
    rows = table2_rows(results, [v.name for v in variants], REFERENCE)
    notes = [f"plateau = mean validation loss at steps {list(cells[0][1].plateau)} of {args.steps} "
             f"(the study: 50, 70, 100 of 100); range = max − min of the per-seed plateau means",
             "master_MiB: fp32 adapter master bytes; peak_mem_MiB: per-run process peak RSS on CPU "
             "(CUDA high-water mark on a GPU)",
             f"delta_vs_ref: plateau minus {REFERENCE}'s; overrides: {' '.join(args.overrides) or '(none)'}"]
    if failed:
        notes.append(f"FAILED runs (see their log.txt): {', '.join(failed)}")
    md, csv = write_tables(root / "table2", rows, TABLE2_COLUMNS, title="Placement study (Table 2 analogue)",
                           notes=notes)
    for v in variants:
        runs = [r for r in results if r["variant"] == v.name]
        if runs:
            plots.plot_curves(v.name, runs, root / "curves" / f"{v.name.replace('+', '_')}.png")
    if rows:
        plots.plot_overview(rows, root / "overview.png")
    write_json(root / "study.json", {"args": vars(args), "rows": rows, "failed": failed})
    log(md.read_text())
    return {"rows": rows, "ran": len(todo) - len(failed), "skipped": len(skipped), "failed": failed,
            "table_md": md, "table_csv": csv}


def _run_cells(root: Path, todo: list, jobs: int, log) -> list[str]:
    """Launch the unfinished cells (`jobs` at a time) with a progress bar -> names of failed cells."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    failed: list[str] = []
    if not todo:
        return failed
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not _is_terminal()) as bar:
        task = bar.add_task("runs", total=len(todo))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            started = {pool.submit(_one, root, spec): spec for spec in todo}
            for fut in as_completed(started):
                spec = started[fut]
                rc, wall = fut.result()
                cell = f"{spec.variant}/seed{spec.seed}"
                result = load_result(run_dir(root, spec))
                if rc != 0 or result is None:
                    failed.append(cell)
                    log(f"  {cell}: FAILED (exit {rc}); log {run_dir(root, spec) / 'log.txt'}")
                else:
                    log(f"  {cell}: plateau {result['plateau_val_loss']:.4f}, {wall:.0f}s")
                bar.advance(task)
    return failed


def _one(root: Path, spec) -> tuple[int, float]:
    t0 = time.perf_counter()
    proc = launch(run_dir(root, spec), spec)
    return proc.returncode, time.perf_counter() - t0


def _is_terminal() -> bool:
    import sys

    return sys.stdout.isatty()
