"""What image-swap and diagnose evaluate on: the base of the run config, optionally with a saved adapter,
and the seeded task mixture (same validation split as training for the same seed and data)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dsv4flash.engine.evaluate import evaluate


@dataclass
class Session:
    """Run config, base directory, tokenizer encoder and task mixture shared by every model evaluated."""

    cfg: Any
    base_dir: Path | None
    encoder: Any
    mixture: Any

    def model(self, adapter: str | Path | None = None) -> torch.nn.Module:
        """A fresh base model (eval mode), with the PEFT adapter at `adapter` loaded when given."""
        from dsv4flash.config import load_config
        from dsv4flash.engine import model_io
        from dsv4flash.model.transformer import Transformer

        mcfg = load_config(self.cfg.model.flavour)
        model = Transformer(mcfg, torch.float32, "cpu", seed=self.cfg.seed)
        if self.base_dir is not None:
            model_io.load_base_weights(model, self.base_dir)
        if adapter is not None:
            from dsv4flash.lora import load_peft_adapter

            path = Path(adapter)
            if not path.is_dir():
                raise FileNotFoundError(f"adapter {path}: not a directory (expected a PEFT adapter folder, e.g. "
                                        "<run>/train/adapter)")
            load_peft_adapter(model, path)
        return model.eval().requires_grad_(False) if adapter is None else model.eval()

    def val_loss(self, forward: Callable, examples: Sequence | None = None) -> float:
        """Teacher-forced validation loss (the engine's evaluate), on the split or on given (task, example) pairs."""
        mixture = self.mixture if examples is None else _Split(list(examples))
        return float(evaluate(forward, self.encoder, mixture, decode=False)["val_loss"])


class _Split:
    """The one attribute of TaskMixture that evaluate() reads."""

    def __init__(self, val: list) -> None:
        self.val = val


def adapter_seed(adapter: str | Path) -> int | None:
    """The seed of the study/train run that wrote `adapter` (its sibling summary.json), if known."""
    summary = Path(adapter).parent / "summary.json"
    if summary.is_file():
        return int(json.loads(summary.read_text())["seed"])
    return None


def open_session(overrides: Sequence[str] = (), seed: int | None = None, log=print) -> Session:
    """Compose the train config (default data: geometry), build/locate its base, build the mixture."""
    from dsv4flash.config import load_config
    from dsv4flash.tasks import Encoder, TaskMixture, TaskTokenizer, build_task
    from dsv4flash.train.base_cache import ensure_base
    from dsv4flash.train.compose import compose, to_train_config

    extra = [f"seed={seed}"] if seed is not None else []
    cfg = to_train_config(compose(None, ["algorithm=sft", "engine.progress=off", *extra, *overrides]))
    if cfg.engine.name != "local":
        raise ValueError(f"engine={cfg.engine.name}: image-swap and diagnose evaluate the single-device reference "
                         "model in this process (engine=local); see docs/placement.md for the full-size model")
    torch.set_num_threads(max(cfg.engine.threads, 1))
    base_dir = ensure_base(cfg, log=log)
    mcfg = load_config(cfg.model.flavour)
    tokenizer = TaskTokenizer.load(base_dir, mcfg) if base_dir is not None else TaskTokenizer(mcfg)
    tasks = {n: build_task(n, **dict(cfg.data.task_options.get(n, {}) or {})) for n in cfg.data.tasks}
    mixture = TaskMixture(tasks, dict(cfg.data.tasks), cfg.seed, cfg.data.val_size, cfg.data.train_size)
    return Session(cfg, base_dir, Encoder(tokenizer, mcfg), mixture)
