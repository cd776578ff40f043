"""veRL's `RayPPOTrainer` with the MinT-style lifecycle: every checkpointed step is a published revision.

Selected by `trainer.dsv4flash_lifecycle` (`store`: the AdapterStore root, `policy`: the policy name) in veRL's
config and `lifecycle_task_runner()` as `run_ppo`'s task runner (`dsv4flash.train` does both for engine=verl).
  * `_update_actor`: keeps the step's rollout records (which prompt, which rollout adapter version and step
    produced each sample, its score and length) and the actor's learning rate;
  * `_save_checkpoint`: veRL's own save, then `publish.publish_step` (adapter, trainer-state blob, scheduler and
    data position, rollout records; atomic through dsv4flash.lifecycle);
  * `_load_checkpoint`: with `resume_mode` auto, the policy head's step folder is written back from its blob and
    veRL resumes from it, so the revision, not whatever veRL left on disk, is where a restarted run continues;
  * after every weight sync (`checkpoint_manager.update_weights`), with `trainer.dsv4flash_sync_check` set, the
    fixed-prompt check (`sync_check`): its metric joins the step's actor metrics.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from dsv4flash.integrations.verl import sync_check
from dsv4flash.integrations.verl.publish import STEP_PREFIX, publish_step, restore_step

CONFIG_KEY = "dsv4flash_lifecycle"


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None), dict)) else str(value)


def rollout_records(batch, step: int) -> list[dict[str, Any]]:
    """One JSON record per sample of a training batch: prompt uid/index, the rollout's adapter version and step."""
    nt, n = batch.non_tensor_batch, len(batch)
    scores = batch.batch["token_level_scores"].sum(-1).tolist() if "token_level_scores" in batch.batch else [None] * n
    lengths = batch.batch["response_mask"].sum(-1).tolist() if "response_mask" in batch.batch else [None] * n
    out = []
    for i in range(n):
        rec = {"train_step": step, "sample": i, "score": scores[i], "response_tokens": lengths[i]}
        for key in ("uid", "index", "adapter_version", "global_steps", "min_global_steps", "max_global_steps"):
            if key in nt:
                rec[key] = _plain(nt[key][i])
        out.append(rec)
    return out


class LifecycleRayPPOTrainer(RayPPOTrainer):
    """RayPPOTrainer publishing each checkpointed step as a lifecycle revision and resuming from the policy head."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from dsv4flash.engine.model_io import base_config
        from dsv4flash.lifecycle import AdapterStore, base_fingerprint

        section = self.config.trainer.get(CONFIG_KEY)
        if not section or not section.get("store") or not section.get("policy"):
            raise ValueError(f"trainer.{CONFIG_KEY} needs 'store' and 'policy' (got {section!r})")
        self.base_cfg = base_config(self.config.actor_rollout_ref.model.path)
        self.store = AdapterStore.open(section["store"], create=True)
        self.policy = str(section["policy"])
        # the run's LoRA placement (train/verl_config.py writes it): each revision carries it for the server
        self.placement = json.loads(section["placement"]) if section.get("placement") else None
        self.store.create_policy(self.policy, base_fingerprint(self.base_cfg),
                                 {"engine": "verl", "base": str(self.config.actor_rollout_ref.model.path)})
        self._rollouts: list[dict[str, Any]] = []
        self._lr: float | None = None
        self._actor_output = None  # this step's update output, until the sync after it adds its check metric
        check = self.config.trainer.get(sync_check.CONFIG_KEY)
        self._check = dict(check) if check and check.get("prompt") else None
        self._check_ids: list[int] | None = None

    def init_workers(self):
        super().init_workers()
        if self._check is not None:
            self._check_ids = sync_check.fixed_prompt_ids(self.tokenizer, str(self._check["prompt"]))
            update = self.checkpoint_manager.update_weights

            def update_weights_then_check(*args, **kwargs):
                out = update(*args, **kwargs)
                self._after_sync()
                return out

            self.checkpoint_manager.update_weights = update_weights_then_check

    def _after_sync(self) -> None:
        """Score the fixed prompt on rollout and actor; the metric goes to the step whose update was synced."""
        diff = sync_check.measure(self, self._check_ids)
        tolerance = self._check.get("tolerance")
        where = f"after the sync at step {self.global_steps}"
        print(f"dsv4flash sync check: {sync_check.METRIC}:{diff:.3e} {where}")
        sync_check.check(diff, None if tolerance is None else float(tolerance), where)
        if self._actor_output is not None:
            self._actor_output.meta_info.setdefault("metrics", {})[sync_check.METRIC] = [diff]
            self._actor_output = None

    def _update_actor(self, batch):
        self._rollouts = rollout_records(batch, self.global_steps)
        print(f"dsv4flash lifecycle: updating the actor at step {self.global_steps}", flush=True)
        output = super()._update_actor(batch)
        lr = (output.meta_info.get("metrics") or {}).get("actor/lr")
        self._lr = float(np.mean(lr)) if lr is not None else None
        self._actor_output = output
        return output

    def _checkpoint_root(self) -> str:
        root = self.config.trainer.default_local_dir
        return root if os.path.isabs(root) else os.path.join(os.getcwd(), root)

    def _save_checkpoint(self):
        super()._save_checkpoint()
        step = self.global_steps
        step_dir = os.path.join(self._checkpoint_root(), f"{STEP_PREFIX}{step}")
        data = self.train_dataloader.state_dict()
        position = {"global_step": step, "epoch": step // max(len(self.train_dataloader), 1),
                    "batches_in_epoch": int(data.get("_num_yielded", step % max(len(self.train_dataloader), 1)))}
        scheduler = {"class": "megatron OptimizerParamScheduler", "global_step": step,
                     **({"last_lr": [self._lr]} if self._lr is not None else {})}
        t0 = time.perf_counter()
        rev = publish_step(self.store, self.policy, step_dir, self.base_cfg, step=step, scheduler=scheduler,
                           data_position=position, rollouts=self._rollouts,
                           extra={"placement": self.placement} if self.placement is not None else None)
        # `bench verl_step` reads the publish share of veRL's timing_s/save_checkpoint from this line
        print(f"dsv4flash lifecycle: published step {step} as revision {rev.id[:12]} of policy {self.policy!r} "
              f"(publish_s:{time.perf_counter() - t0:.6f})")

    def _load_checkpoint(self):
        if self.config.trainer.resume_mode == "auto":
            head = self.store.policy(self.policy)
            if head.head is not None:
                state, blob = self.store.trainer_state(self.policy, head.head)
                if state is None or blob is None:
                    raise ValueError(f"policy {self.policy!r}: head {head.head[:12]} has no trainer state to resume")
                folder = restore_step(blob, self._checkpoint_root(), int(state.step))
                print(f"dsv4flash lifecycle: resuming from revision {head.head[:12]} (step {state.step})")
                from omegaconf import open_dict

                with open_dict(self.config):
                    self.config.trainer.resume_mode = "resume_path"
                    self.config.trainer.resume_from_path = str(folder)
            else:
                print(f"dsv4flash lifecycle: policy {self.policy!r} has no revision yet; training from scratch")
                return 0
        return super()._load_checkpoint()


def lifecycle_task_runner():
    """veRL's legacy TaskRunner (a Ray actor class) building `LifecycleRayPPOTrainer` instead of RayPPOTrainer."""
    import ray
    from verl.trainer import main_ppo_v0

    base = main_ppo_v0.TaskRunner.__ray_actor_class__

    class LifecycleTaskRunner(base):
        def run(self, config):
            # TaskRunner.run names the trainer class through a global and has no hook. Ray ships the actor class
            # by value (its module name is the ActorClass wrapper), so the global lives in the unpickled
            # function's own globals; set there, inside the task runner's Ray actor process only.
            base.run.__globals__["RayPPOTrainer"] = LifecycleRayPPOTrainer
            return super().run(config)

    return ray.remote(LifecycleTaskRunner)


__all__ = ["CONFIG_KEY", "LifecycleRayPPOTrainer", "lifecycle_task_runner", "rollout_records"]
