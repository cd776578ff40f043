"""The README's main job, timed: `python -m dsv4flash.train +recipe=decoder_lora` with a fresh and a cached base.

Each run is the real command in a child process (installation excluded). The fresh run builds the base into a
temporary cache directory; the cached run then finds it there. Phases come from the runs' own summaries
(dsv4flash/engine/local.py): base build (the pretrain run's wall time), training (the optimizer steps) and
evaluation; the rest of a run's wall time is start-up and writing outputs. Beside them: the training step's
tokens per second, and the latency of a CLI argument error (`dsv4flash lifecycle policies` without `--root`).
`--steps` / `--base-steps` shorten the runs (a different base config, so still built fresh); the targets
are stated for the default command on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4flash.bench.report import BenchReport

TARGET_MAIN_S = 300.0  # the main job with a cached base
TARGET_BASE_S = 300.0  # the base build
TARGET_CLI_S = 2.0  # an argument error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--steps", type=int, default=None, help="engine.steps of the fine-tuning (default: the recipe's)")
    parser.add_argument("--base-steps", type=int, default=None,
                        help="engine.steps of the base build (model.base_overrides; default: the recipe's)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="time only the cached run, on the base in this cache directory (no fresh build)")
    parser.add_argument("--cli-repeats", type=int, default=3, help="argument-error runs (median; default 3)")


def _overrides(args: argparse.Namespace, cache: Path, out: Path) -> list[str]:
    extra = [f"engine.steps={args.steps}"] if args.steps else []
    if args.base_steps:
        extra.append(f"model.base_overrides=['engine.steps={args.base_steps}']")
    return ["+recipe=decoder_lora", f"model.cache_dir={cache}", f"output_dir={out}", f"hydra.run.dir={out}/hydra",
            *extra]


def _train(overrides: list[str]) -> tuple[float, str]:
    """Run the main command; -> (wall seconds, stdout)."""
    # the child's output is parsed, not shown: one line says which run the next minutes belong to
    print(f"main: python -m dsv4flash.train {' '.join(overrides)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dsv4flash.train", *overrides], capture_output=True, text=True,
                          env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the main job failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return wall, proc.stdout


def _base_summary(cache: Path) -> dict | None:
    """The summary the base build wrote next to the cached base (the newest, if several)."""
    found = sorted((cache / "bases").glob("pretrain_tiny-*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text()) if found else None


def cli_error_latency(repeats: int) -> float:
    """Median wall seconds of `dsv4flash lifecycle policies` without --root (an argument error, exit 2)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dsv4flash", "lifecycle", "policies"], capture_output=True,
                              text=True)
        times.append(time.perf_counter() - t0)
        if proc.returncode != 2:
            raise RuntimeError(f"expected exit 2 from the argument error, got {proc.returncode}: {proc.stderr}")
    return statistics.median(times)


def build_report(runs: dict[str, tuple[float, dict]], base: dict | None, cli_s: float, full: bool) -> BenchReport:
    """The table: each run's wall time and phases, the base build, tokens/s, CLI latency, and the targets."""
    report = BenchReport("main job: python -m dsv4flash.train +recipe=decoder_lora" + ("" if full else " (shortened)"))
    report.add("cli_argument_error_s", cli_s, "s", note="dsv4flash lifecycle policies, no --root (median)")
    if base is not None:
        tokens = f", {base['train_tokens_per_s']:.0f} tok/s" if base.get("train_tokens_per_s") else ""
        report.add("base_build_s", base["wall_time_s"], "s", baseline="fresh_wall_s" if "fresh" in runs else None,
                   note=f"pretrain_tiny, {base['steps']} steps{tokens} (inside the fresh run)")
    for name, (wall, summary) in runs.items():
        report.add(f"{name}_wall_s", wall, "s", note=f"{summary['steps']} steps x {summary['batch_size']} rows")
        report.add(f"{name}_train_s", summary["train_time_s"], "s", baseline=f"{name}_wall_s")
        report.add(f"{name}_eval_s", summary["eval_time_s"], "s", baseline=f"{name}_wall_s")
        if summary.get("train_tokens_per_s"):
            report.add(f"{name}_train_tokens_per_s", summary["train_tokens_per_s"], "tok/s",
                       note="positions of the training batches (padding included) / optimizer-step time")
    if "cached" in runs:
        report.target(f"main job with a cached base <= {TARGET_MAIN_S:.0f} s"
                      + ("" if full else " (shortened run; the target is for the default command)"),
                      runs["cached"][0] <= TARGET_MAIN_S)
    if base is not None:
        report.target(f"base build <= {TARGET_BASE_S:.0f} s" + ("" if full else " (shortened)"),
                      base["wall_time_s"] <= TARGET_BASE_S)
    report.target(f"CLI argument error <= {TARGET_CLI_S:.0f} s", cli_s <= TARGET_CLI_S)
    return report


def run(args: argparse.Namespace) -> BenchReport:
    """Fresh run (temporary cache), then the cached run on that cache; the CLI latency first."""
    cli_s = cli_error_latency(args.cli_repeats)
    runs: dict[str, tuple[float, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="dsv4flash-bench-main-") as tmp:
        tmp_path = Path(tmp)
        cache = args.cache if args.cache is not None else tmp_path / "cache"
        if args.cache is None:
            out = tmp_path / "fresh"
            wall, stdout = _train(_overrides(args, cache, out))
            if "base: not cached" not in stdout.splitlines()[0]:
                raise RuntimeError("the fresh run did not build its base (temporary cache already holds it?)")
            runs["fresh"] = (wall, json.loads((out / "summary.json").read_text()))
        out = tmp_path / "cached"
        wall, stdout = _train(_overrides(args, cache, out))
        if "(cached)" not in stdout.splitlines()[0]:
            raise RuntimeError(f"the cached run did not find its base in {cache}: {stdout.splitlines()[0]}")
        runs["cached"] = (wall, json.loads((out / "summary.json").read_text()))
        base = _base_summary(cache) if args.cache is None else None
    return build_report(runs, base, cli_s, full=args.steps is None and args.base_steps is None)
