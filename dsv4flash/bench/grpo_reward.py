"""The README's GRPO example, its reward per step beside the frozen base's on the same problems and sampling seeds.

`+recipe=decoder_lora_grpo` (GRPO on the embedded engine, decoder-half LoRA on the trained tiny base, arithmetic
with partial credit over a fixed training set) runs twice in this process: as the recipe says, and with learning
rate 0 (the frozen base). Both read the same problems in the same order and sample each step with the same seed, so
step 1 is the same in both and every later difference is what the updates changed. The frozen run is the baseline
because the per-step reward moves without any learning too (a frozen policy's mean differs by up to ~10 % between
thirds of a 20-step run, from the samples drawn), so "rising" alone could be luck. Rewards are the task's own grader
(`ArithmeticTask.reward`); the held-out problems' greedy reward at the first and last evaluation
and each run's wall time are listed too.

Targets (MET/MISS, never asserted in tests): rising, the mean reward of the last third of the steps >= 1.2 x the
first third's; learned, the last third's >= 1.2 x the frozen run's last third. `--plot PNG` draws both curves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dsv4flash.bench.report import BenchReport

RECIPE = "decoder_lora_grpo"
TARGET_RATIO = 1.2
MAX_REWARD = 1.0  # the grader's best score (an exact answer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the recipe's)")
    parser.add_argument("--workdir", help="keep both runs here (default: a temporary directory)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the per-step reward of both runs")
    parser.add_argument("overrides", nargs="*", help="further overrides of the recipe (key=value), for both runs")


def thirds(values: list[float]) -> tuple[float, float]:
    """Means of the first and the last third of a per-step series (at least one step each)."""
    n = max(len(values) // 3, 1)
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])


def build_report(trained: list[float], frozen: list[float], val: tuple[float, float] | None,
                 title: str, wall: dict[str, float] | None = None) -> BenchReport:
    """The table: reward per step beside the frozen run's, the thirds, the held-out reward, each run's wall time
    (`wall`: run name -> seconds), and both targets."""
    if len(trained) != len(frozen) or len(trained) < 3:
        raise ValueError(f"grpo_reward: need the same >= 3 steps in both runs, got {len(trained)} and {len(frozen)}")
    report = BenchReport(title)
    report.add("max_reward", MAX_REWARD, "reward", note="the grader's best score (an exact answer)")
    for step, (mine, base) in enumerate(zip(trained, frozen), start=1):
        report.add(f"frozen@{step}", base, "reward", note="lr 0: same problems, same sampling seed")
        report.add(f"reward@{step}", mine, "reward", baseline=f"frozen@{step}")
    first, last = thirds(trained)
    frozen_first, frozen_last = thirds(frozen)
    n = max(len(trained) // 3, 1)
    report.add("frozen_first_third", frozen_first, "reward", note=f"steps 1-{n}")
    report.add("frozen_last_third", frozen_last, "reward", baseline="frozen_first_third",
               note=f"steps {len(trained) - n + 1}-{len(trained)}")
    report.add("reward_first_third", first, "reward", baseline="frozen_first_third", limit="max_reward")
    report.add("reward_last_third", last, "reward", baseline="frozen_last_third", limit="max_reward")
    report.add("rise_last_over_first", last / first if first else float("nan"), "x",
               note="reward_last_third / reward_first_third")
    if val is not None:
        report.add("val_reward_initial", val[0], "reward", note="held-out problems, greedy, before training")
        report.add("val_reward_final", val[1], "reward", baseline="val_reward_initial",
                   note="after training: how much of the rise carries over to new problems")
    for name, seconds in (wall or {}).items():
        report.add(f"{name}_run_wall", seconds, "s", note="the whole run: base load, training, evaluations")
    report.target(f"rising: last third {last:.3f} >= {TARGET_RATIO} x first third {first:.3f} "
                  f"({last / first if first else float('nan'):.2f} x)", first > 0 and last >= TARGET_RATIO * first)
    report.target(f"learned: last third {last:.3f} >= {TARGET_RATIO} x the frozen base's {frozen_last:.3f} "
                  f"({last / frozen_last if frozen_last else float('nan'):.2f} x)",
                  frozen_last > 0 and last >= TARGET_RATIO * frozen_last)
    return report


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run(args: argparse.Namespace) -> BenchReport:
    """The recipe, then the same with lr 0, on the trained tiny base (built and cached when missing)."""
    from dsv4flash.engine.local import run_local
    from dsv4flash.train.base_cache import ensure_base
    from dsv4flash.train.compose import compose, to_train_config

    overrides = list(args.overrides) + ([f"engine.steps={args.steps}"] if args.steps else [])
    # run_local without on_save: the bench's runs publish nothing into the user's store
    trained_cfg = to_train_config(compose(RECIPE, overrides))
    steps = trained_cfg.engine.steps
    # the frozen run evaluates only at the start and the end, and only the loss (its reward rows are what counts)
    frozen_cfg = to_train_config(compose(RECIPE, [*overrides, "engine.lr=0", f"engine.eval_every={steps}",
                                                  "engine.eval_generate=false"]))
    base = ensure_base(trained_cfg)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_grpo_reward_"))
    try:
        runs, wall = {}, {}
        for name, cfg in (("trained", trained_cfg), ("frozen", frozen_cfg)):
            print(f"grpo_reward: {name} run, +recipe={RECIPE} {' '.join(overrides)}"
                  + (" engine.lr=0" if name == "frozen" else ""), file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            run_local(cfg, work / name, base_dir=base)
            wall[name] = time.perf_counter() - t0
            runs[name] = _history(work / name)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    trained = [r["reward"] for r in runs["trained"] if "reward" in r]
    frozen = [r["reward"] for r in runs["frozen"] if "reward" in r]
    evals = [r["val_reward"] for r in runs["trained"] if "val_reward" in r]
    eng = trained_cfg.engine
    size = trained_cfg.data.train_size
    problems = "new problems every step" if size is None else f"train_size {size}"
    title = (f"GRPO example: +recipe={RECIPE}, {steps} steps x {eng.batch_size // trained_cfg.algorithm.group_size} "
             f"problems x {trained_cfg.algorithm.group_size} samples ({problems}), "
             f"lr {eng.lr:g}, vs the frozen base (lr 0) on the same problems and seeds")
    report = build_report(trained, frozen, (evals[0], evals[-1]) if len(evals) >= 2 else None, title, wall)
    if args.plot:
        plot(trained, frozen, args.plot, title)
    return report


def plot(trained: list[float], frozen: list[float], path: str, title: str) -> None:
    """Both per-step curves, with each run's first- and last-third means as short horizontal lines -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = list(range(1, len(trained) + 1))
    n = max(len(trained) // 3, 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    for values, label, color in ((trained, "GRPO (the recipe)", "#1f77b4"), (frozen, "frozen base (lr 0)", "#888")):
        ax.plot(steps, values, "o-", color=color, label=label, markersize=3)
        first, last = thirds(values)
        ax.hlines([first, last], [steps[0], steps[-n]], [steps[n - 1], steps[-1]], colors=color, linestyles="dashed")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(title.replace(", vs ", ",\nvs "), fontsize=8)  # two lines: fits the figure's width
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
