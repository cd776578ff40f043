"""engine=local: every adapter a LoRA run saves becomes a revision of a policy in an adapter store.

`Publisher` is the local engine's `on_save` (dsv4flash/engine/local.py calls it after each checkpoint).

The store is `lifecycle.root` (a directory or an initialised `s3://bucket/prefix` store; default:
`dsv4flash.lifecycle.default_store`, the store `dsv4flash serve` reads) and the policy `lifecycle.policy` (default: the recipe's name). Each checkpoint and the final adapter
go through the lifecycle's one writer (`dsv4flash.lifecycle.checkpoint.save_checkpoint`: packed MoE LoRA
bytes, the optimizer/RNG state blob, the scheduler and data position, one atomic catalog commit), tagged
`step-N` and `latest`; the manifest carries the placement (so the server can rebuild the adapter's shell),
the base the run loaded and the run's output directory. A revision chains onto the policy head when the
head is an earlier step of the same run config (a checkpoint of this run, or the run it resumed from);
a fresh run forks from the base (no parent), and still becomes the head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_store(cfg: Any) -> tuple[Path | str, str]:
    """(store location: a directory or an s3:// URL, policy name) a run publishes into."""
    from dsv4flash.lifecycle.default_store import default_store, store_location

    root = store_location(cfg.lifecycle.root) if cfg.lifecycle.root else default_store()
    return root, cfg.lifecycle.policy or cfg.recipe


class Publisher:
    """`on_save` of a LoRA run: publishes each saved adapter into the run's policy -> a record of where it went."""

    def __init__(self, cfg: Any, base_dir: Path | None, output_dir: Path, *, log=print) -> None:
        from dsv4flash.config import load_config
        from dsv4flash.engine.fingerprint import fingerprint
        from dsv4flash.engine.model_io import read_manifest

        self.cfg, self.base_dir, self.log = cfg, base_dir, log
        self.root, self.policy = run_store(cfg)
        self.mcfg = load_config(cfg.model.flavour)
        self.base_sha = read_manifest(base_dir)["weights_sha256"] if base_dir is not None else ""
        self.fingerprint = fingerprint(cfg, self.base_sha)  # the engine's run fingerprint (resume, lineage)
        self.output_dir = str(Path(output_dir).resolve())

    def __call__(self, *, step: int, model: Any, optimizer: Any, handle: Any, lr: float) -> dict[str, Any]:
        """Publish the model's adapter at `step` as the policy's new head (tags step-N, latest)."""
        from dsv4flash.lifecycle import AdapterStore, base_fingerprint
        from dsv4flash.lifecycle.catalog.base import LATEST
        from dsv4flash.lifecycle.checkpoint import save_checkpoint

        placement = handle.config.to_dict()
        with AdapterStore.open(self.root, create=True) as store:
            store.create_policy(self.policy, base_fingerprint(self.mcfg), {
                "engine": "local", "recipe": self.cfg.recipe, "algorithm": self.cfg.algorithm.name,
                "base": str(self.base_dir) if self.base_dir else "random", "base_weights_sha256": self.base_sha or None,
                "placement": placement})
            position = {"step": step, "seed": self.cfg.seed, "config_fingerprint": self.fingerprint}
            rev = save_checkpoint(
                store, self.policy, model, optimizer, step=step, data_position=position,
                parent=self._parent(store, step), tags=[f"step-{step}", LATEST],
                scheduler_position={"schedule": self.cfg.optim.schedule, "warmup_steps": self.cfg.optim.warmup_steps,
                                    "total_steps": self.cfg.engine.steps, "step": step, "last_lr": [lr]},
                extra={"engine": "local", "placement": placement, "recipe": self.cfg.recipe,
                       "algorithm": self.cfg.algorithm.name, "output_dir": self.output_dir,
                       "base_weights_sha256": self.base_sha or None})
        self.log(f"published step {step} as revision {rev.id[:12]} of policy {self.policy!r} (store {self.root})")
        return {"store": str(self.root), "policy": self.policy, "revision": rev.id, "step": step}

    def next_steps(self) -> str:
        """The commands that list and serve what the run published (flags only where the store is not the default)."""
        from dsv4flash.lifecycle.default_store import default_store

        own = _same_place(self.root) != _same_place(default_store())
        root, store = (f" --root {self.root}", f" --store {self.root}") if own else ("", "")
        return (f"policy {self.policy}:latest is in the store {self.root}: list it with `dsv4flash lifecycle{root} "
                f"policies`; serve it with `dsv4flash serve --base {self.cfg.model.flavour}{store}` and sample "
                f"model_path tinker://{self.policy}/weights/latest")

    def _parent(self, store: Any, step: int) -> str | None:
        """The head when it is an earlier step of this run config (a continuation), else None (a fresh fork)."""
        head = store.policy(self.policy).head
        if head is None:
            return None
        state = store.catalog.state(self.policy, head)
        position = dict(state.data_position) if state is not None else {}
        same_run = position.get("config_fingerprint") == self.fingerprint and int(position.get("step", step)) < step
        return head if same_run else None


def _same_place(location: Path | str) -> str:
    """A store location in a form two spellings of the same store compare equal in."""
    return str(location) if isinstance(location, str) else str(Path(location).resolve())


__all__ = ["Publisher", "run_store"]
