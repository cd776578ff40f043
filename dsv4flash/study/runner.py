"""One (placement, seed) run of the placement study, in its own process, through the train entry's engine
dispatch (`dsv4flash.train.main.run`: engine=local trains here, engine=verl launches veRL on a cluster).

The parent writes `spec.json`, the child `python -m dsv4flash.study _run RUN_DIR` trains into `RUN_DIR/train`
and writes `result.json` atomically last: a run with a `result.json` is finished and never re-run. A
separate process per run gives each its own peak-memory figure (ru_maxrss / CUDA high-water mark) and keeps
one crashed run from taking the grid down; the engine's own checkpoint resumes a killed run.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsv4flash.study.stats import eval_every_for, plateau_loss, plateau_steps
from dsv4flash.study.tables import write_json
from dsv4flash.study.variants import Variant

RESULT = "result.json"
SPEC = "spec.json"
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RunSpec:
    """What one run computes: placement, seed, steps, plateau steps and the train overrides."""

    variant: str
    seed: int
    steps: int
    plateau: tuple[int, ...]
    overrides: tuple[str, ...]

    def key(self) -> str:
        """Short hash of the spec: runs with other settings live in other folders."""
        text = json.dumps([self.variant, self.seed, self.steps, list(self.plateau), list(self.overrides)])
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def to_dict(self) -> dict:
        """JSON form."""
        return {"variant": self.variant, "seed": self.seed, "steps": self.steps, "plateau": list(self.plateau),
                "overrides": list(self.overrides)}


def make_spec(variant: Variant, seed: int, steps: int, user_overrides: list[str], plateau_fractions) -> RunSpec:
    """The train overrides of one grid cell: SFT on the chosen data, evaluations at the plateau steps."""
    points = plateau_steps(steps, plateau_fractions)
    # SFT, as the study, unless the user picks another algorithm (engine=verl trains GRPO only).
    algorithm = [] if any(o.split("=", 1)[0].lstrip("+~") == "algorithm" for o in user_overrides) else ["algorithm=sft"]
    every = eval_every_for(points)
    engine = next((o.split("=", 1)[1] for o in user_overrides if o.split("=", 1)[0].lstrip("+") == "engine"), "local")
    if engine == "verl":  # the same schedule in veRL's terms (validation every `test_freq` steps)
        schedule = [f"engine.total_training_steps={steps}", f"engine.test_freq={every}"]
    else:
        schedule = [f"engine.steps={steps}", f"engine.eval_every={every}", "engine.eval_generate=false",
                    "engine.progress=off"]
    overrides = [*algorithm, *variant.train_overrides(), f"seed={seed}", f"lora.seed={seed}", *schedule,
                 *user_overrides]
    return RunSpec(variant.name, seed, steps, points, tuple(overrides))


def run_dir(root: Path, spec: RunSpec) -> Path:
    """`<root>/runs/<placement>/seed<k>-<spec hash>`."""
    return root / "runs" / spec.variant / f"seed{spec.seed}-{spec.key()}"


def load_result(directory: Path) -> dict | None:
    """The finished run's result, or None when it has not finished."""
    path = directory / RESULT
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:  # writes are atomic, so this is outside interference
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it to re-run that cell") from None


def launch(directory: Path, spec: RunSpec, python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run one cell in a child process (output to `<dir>/log.txt`); returns the finished process."""
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / SPEC, spec.to_dict())
    env = dict(os.environ, TORCHDYNAMO_DISABLE=os.environ.get("TORCHDYNAMO_DISABLE", "1"))
    with open(directory / "log.txt", "a") as log:
        return subprocess.run([python, "-m", "dsv4flash.study", "_run", str(directory)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, check=False)


def peak_memory() -> dict[str, int | None]:
    """This process's peak resident set (bytes) and, with CUDA, the device high-water mark."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    cuda = None
    try:
        import torch

        if torch.cuda.is_available():
            cuda = int(torch.cuda.max_memory_allocated())
    except Exception:
        cuda = None
    return {"peak_rss_bytes": int(rss), "peak_cuda_bytes": cuda}


def child_main(directory: str) -> int:
    """Entry of `_run`: compose, dispatch to the engine, collect the history into `result.json`."""
    from dsv4flash.train.compose import compose, to_train_config
    from dsv4flash.train.main import run

    directory = Path(directory)
    spec = json.loads((directory / SPEC).read_text())
    out = directory / "train"
    cfg = to_train_config(compose(None, [*spec["overrides"], f"output_dir={out}"]))
    t0 = time.perf_counter()
    summary = run(cfg, out)
    wall = time.perf_counter() - t0
    metrics = out / "metrics.jsonl"
    if cfg.engine.name != "local" or not metrics.is_file():
        # veRL keeps its own logs; the study records what was launched and leaves the cell unfinished.
        write_json(directory / "launch.json", {"engine": cfg.engine.name, "result": summary, "wall_s": wall})
        print(f"engine={cfg.engine.name}: no local metrics history to collect; launch record in {directory}/launch.json")
        return 3
    history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    trainable = int(summary["trainable_params"])
    result = {
        **spec, "engine": cfg.engine.name, "plateau_val_loss": plateau_loss(history, spec["plateau"]),
        "final_val_loss": summary["val_loss_final"], "initial_val_loss": summary["val_loss_initial"],
        "trainable_params": trainable, "master_bytes": trainable * _BYTES[cfg.lora.lora_dtype],
        "step_time_median_s": summary["step_time_median_s"], "wall_s": wall,
        "adapter": summary["outputs"]["adapter"],
        "curve": [{k: r[k] for k in ("step", "loss", "val_loss") if k in r} for r in history],
        **peak_memory(),
    }
    result["peak_mem_bytes"] = result["peak_cuda_bytes"] or result["peak_rss_bytes"]
    write_json(directory / RESULT, result)
    return 0
