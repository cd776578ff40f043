"""veRL GRPO step on CPU, split by phase, next to the embedded engine's GRPO step on the same work.

One run of the real veRL path (`python -m dsv4flash.train +recipe=decoder_lora_verl_cpu`: Ray, the Megatron
actor on 2 gloo ranks, the dsv4flash rollout backend, unmerged LoRA sync and a lifecycle publish every step)
and one of the embedded engine (`engine=local algorithm=grpo`) on the same tiny base, task, prompts per step,
group size and response length. The phases are veRL's own `timing_s/*` metrics of each step:
rollout = `gen`, weight sync = `update_weights`, replay = `old_log_prob` (the actor's recomputation under the
replayed routes), update = `update_actor`, publish = the lifecycle publish inside `save_checkpoint` (logged by
`LifecycleRayPPOTrainer`), step = `step`. Figures are means over the steps after the first (the first pays
for warm-up; means, so the phases and the remainder add up to the step); the embedded step is the baseline of the
veRL step. No target is stated for the overhead, so no
MET/MISS line is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from dsv4flash.bench.report import BenchReport

PHASES = {"rollout": "timing_s/gen", "weight_sync": "timing_s/update_weights", "replay": "timing_s/old_log_prob",
          "update": "timing_s/update_actor", "save_checkpoint": "timing_s/save_checkpoint"}
_NUMBER = re.compile(r"(?:np\.\w+\()?(-?\d[\d.]*(?:e[-+]?\d+)?|nan|-?inf)\)?")
_PUBLISH = re.compile(r"published step (\d+) as revision \w+ of policy .* \(publish_s:([\d.e+-]+)\)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Benchmark options."""
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per engine (default 3; >= 2)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step (default 2)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt (default 4)")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--plot", metavar="PNG", help="also write a stacked bar chart of the phases")
    parser.add_argument("--verl-log", metavar="LOG", help="read the veRL side from this finished run's log instead "
                        "of running one (its steps, prompts and group size must be the options given; needs --base)")
    parser.add_argument("--base", metavar="DIR", help="with --verl-log: the base directory that run trained on")


def step_metrics(log: str) -> dict[int, dict[str, float]]:
    """veRL's per-step console metrics (`step:N - key:value - ...`) and the lifecycle publish times."""
    out: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        if m := _PUBLISH.search(line):
            out.setdefault(int(m[1]), {})["publish_s"] = float(m[2])
            continue
        m = re.search(r"step:(\d+) - (.*)", line)
        if not m:
            continue
        values = {}
        for part in m[2].split(" - "):
            key, _, value = part.partition(":")
            if num := _NUMBER.fullmatch(value.strip()):
                values[key.strip()] = float(num[1])
        out.setdefault(int(m[1]), {}).update(values)
    return out


def _agent_loop_workers() -> int:
    """The CPU recipe's agent-loop worker count (veRL's default, 8, when it sets none)."""
    from dsv4flash.train.compose import compose, to_train_config

    workers = to_train_config(compose("decoder_lora_verl_cpu", ["model.hf_path=unused"])).engine.agent_loop_workers
    return workers or 8


def verl_cpu_env() -> dict[str, str]:
    """The environment of a CPU veRL run: the CPU platform, gloo on the loopback interface, no usage reporting."""
    from dsv4flash.integrations.mcore import child_environment

    env = child_environment(dict(os.environ))
    return {**env, "VERL_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo", "RAY_USAGE_STATS_ENABLED": "0"}


def _run_verl(base: Path, out: Path, args) -> dict[int, dict[str, float]]:
    env = verl_cpu_env()
    cmd = [sys.executable, "-m", "dsv4flash.train", "+recipe=decoder_lora_verl_cpu", f"model.hf_path={base}",
           f"output_dir={out}", f"lifecycle.root={out / 'lifecycle'}", f"engine.total_training_steps={args.steps}", f"engine.train_batch_size={args.prompts}",
           f"engine.ppo_mini_batch_size={args.prompts}", f"algorithm.group_size={args.group_size}"]
    print(f"verl_step: veRL GRPO, {args.steps} steps ({' '.join(cmd[3:])})", file=sys.stderr)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out.parent / "verl_run.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"the veRL run failed (exit {proc.returncode}); log: {out.parent / 'verl_run.log'}\n"
                           f"{log[-2000:]}")
    return step_metrics(log)


def _run_embedded(base: Path, out: Path, args) -> list[float]:
    from dsv4flash.engine.local import run_local
    from dsv4flash.train.compose import compose, to_train_config

    # the CPU veRL recipe's task, model and placement (its engine block is veRL's, so not composed here)
    cfg = compose("decoder_lora", ["engine=local", "algorithm=grpo", "data=arithmetic", "model=tiny",
                                   "lora=decoder_half", f"algorithm.group_size={args.group_size}",
                                   f"engine.batch_size={args.prompts * args.group_size}",
                                   f"engine.steps={args.steps}", f"engine.eval_every={args.steps}",
                                   "engine.checkpoint_every=0", "engine.eval_generate=false"])
    cfg.data.max_new_tokens = cfg.data.max_response_length  # the response budget veRL's rollout gets
    print(f"verl_step: embedded GRPO, {args.steps} steps", file=sys.stderr)
    run_local(to_train_config(cfg), out, base_dir=base)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time"] for r in rows if "step_time" in r]


def run(args: argparse.Namespace) -> BenchReport:
    """Both runs, one table: per-phase veRL means, the veRL and embedded step, their ratio."""
    from dsv4flash.config import load_config
    from dsv4flash.engine.model_io import save_base
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks import TaskTokenizer

    if args.steps < 2:
        raise SystemExit("verl_step: --steps must be >= 2 (the first step is warm-up)")
    workers = _agent_loop_workers()
    if (args.prompts * args.group_size) % workers:
        raise SystemExit(f"verl_step: --prompts × --group-size ({args.prompts * args.group_size}) must be a multiple "
                         f"of {workers}: veRL splits each batch evenly over its {workers} agent-loop workers")
    if bool(args.verl_log) != bool(args.base):
        raise SystemExit("verl_step: --verl-log and --base go together (a finished run's log and its base)")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_verl_step_"))
    try:
        if args.verl_log:
            # a run already made (the test suite's shared veRL run): its own log holds veRL's per-step timings
            base, verl = Path(args.base), step_metrics(Path(args.verl_log).read_text())
        else:
            cfg = load_config("tiny")
            base = save_base(Transformer(cfg, seed=0), cfg, TaskTokenizer(cfg), work / "base", {"kind": "bench"})
            verl = _run_verl(base, work / "verl", args)
        embedded = _run_embedded(base, work / "embedded", args)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    timed = [s for s in sorted(verl) if s >= 2 and "timing_s/step" in verl[s]]
    if not timed or len(embedded) < 2:
        raise RuntimeError(f"verl_step: too few steps measured (veRL {sorted(verl)}, embedded {len(embedded)})")
    med = {name: statistics.fmean(verl[s].get(key, 0.0) for s in timed) for name, key in PHASES.items()}
    med["publish"] = statistics.fmean(verl[s].get("publish_s", 0.0) for s in timed)
    med["save_checkpoint"] = max(med["save_checkpoint"] - med["publish"], 0.0)  # veRL's own save, publish apart
    verl_step = statistics.fmean(verl[s]["timing_s/step"] for s in timed)
    embedded_step = statistics.fmean(embedded[1:])

    rep = BenchReport(f"GRPO step, tiny model, {args.prompts} prompts × {args.group_size} samples, "
                      f"mean of steps 2..{args.steps}: veRL (Ray, Megatron EP=2 gloo, dsv4flash rollout) "
                      f"vs embedded engine")
    rep.add("embedded_step", embedded_step * 1e3, "ms", note="engine=local GRPO: rollout, old log-probs, update")
    rep.add("verl_step", verl_step * 1e3, "ms", baseline="embedded_step", note="timing_s/step")
    notes = {"rollout": "timing_s/gen", "weight_sync": "timing_s/update_weights (unmerged LoRA)",
             "replay": "timing_s/old_log_prob (actor recompute, R3 replay)", "update": "timing_s/update_actor",
             "publish": "lifecycle revision (in save_checkpoint)",
             "save_checkpoint": "veRL's own checkpoint save, publish excluded"}
    for name in ("rollout", "weight_sync", "replay", "update", "publish", "save_checkpoint"):
        rep.add(f"verl_{name}", med[name] * 1e3, "ms", limit="verl_step", note=notes[name])
    other = verl_step - sum(med[n] for n in notes)
    rep.add("verl_other", other * 1e3, "ms", limit="verl_step", note="rewards, advantages, Ray dispatch, logging")
    if args.plot:
        _plot(med, other, embedded_step, args.plot, rep.title)
    return rep


def _plot(med: dict[str, float], other: float, embedded: float, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["rollout", "weight_sync", "replay", "update", "publish", "save_checkpoint"]
    fig, ax = plt.subplots(figsize=(8, 3))
    left = 0.0
    for name, color in zip(phases + ["other"], ["#2a7", "#27a", "#a72", "#a27", "#7a2", "#777", "#ccc"]):
        width = (other if name == "other" else med[name]) * 1e3
        ax.barh(["veRL"], [width], left=left, color=color, label=name)
        left += width
    ax.barh(["embedded"], [embedded * 1e3], color="#444", label="embedded step")
    ax.set_xlabel("wall time per GRPO step (ms)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
