"""veRL's `actor_rollout_ref` config of the trainer group, composed and validated the way `engine=verl` runs do.

The run config is the project's (`+recipe=decoder_lora engine=verl`, `dsv4flash.train.verl_config`): veRL's own
ppo_trainer composed with one override per setting and checked by veRL's validators, so the group's Megatron
actor is built exactly as the recipe path builds it — the base through the registered Megatron-Bridge bridge, the
LoRA from the provider's `provide_peft` — with the group's placement shell and layout. What a Tinker service
needs on top: no LR schedule (the client sends the learning rate every step), no routing replay (no rollouts of
the actor's own), Megatron's plain optimizer per rank (the slots swap its moments; the distributed optimizer
shards them) and the adapter unmerged.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, open_dict

from dsv4flash.service.compute.megatron.layout import TrainerLayout


def actor_config(base_dir: Path, flavour: str, preset: str, max_rank: int, layout: TrainerLayout, world: int,
                 work_dir: Path, *, cuda: bool, micro_batch: int) -> DictConfig:
    """The validated `actor_rollout_ref` section for a group of `world` ranks training `preset` LoRA (and the head's)
    at rank `max_rank` on the base in `base_dir` (its flavour's config)."""
    from dsv4flash.tasks.verl_export import REWARD_FUNCTION_MODULE
    from dsv4flash.config import load_config
    from dsv4flash.train.compose import compose, to_train_config
    from dsv4flash.train.preflight import check_parallel_layout
    from dsv4flash.train.verl_config import build_verl_config, pin_run_dir
    from dsv4flash.train.verl_engine import task_tokenizer_for

    overrides = [
        f"model={flavour}", f"model.hf_path={base_dir}", "engine=verl", "lora=decoder_half", f"lora.preset={preset}",
        f"lora.rank={max_rank}", "lora.alpha=null", "lora.merge=false", f"output_dir={work_dir}",
        "engine.nnodes=1", f"engine.n_gpus_per_node={world}",
        f"engine.tensor_model_parallel_size={layout.tp}", f"engine.pipeline_model_parallel_size={layout.pp}",
        f"engine.context_parallel_size={layout.cp}", f"engine.expert_model_parallel_size={layout.ep}",
        f"engine.dtype={'bfloat16' if cuda else 'float32'}", "engine.optimizer_offload=false",
        f"engine.micro_batch_size_per_gpu={micro_batch}", f"engine.rollout={'vllm' if cuda else 'dsv4flash'}",
        "engine.rollout_tensor_parallel_size=1", "engine.rollout_expert_parallel_size=1", "engine.recompute=false",
        # unused by a Tinker group (the client sends its batches), but veRL's validator checks their divisibility
        "algorithm.router_replay=disabled", f"engine.train_batch_size={world * micro_batch}",
        f"engine.ppo_mini_batch_size={world * micro_batch}",
    ]
    cfg = to_train_config(compose("decoder_lora", overrides))
    # the layout rules of a veRL training run (one home: the run's preflight), before any worker is started
    check_parallel_layout(cfg.engine, load_config(flavour))
    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = task_tokenizer_for(cfg, work_dir)
    config = build_verl_config(cfg, data_dir=str(work_dir / "unused"), output_dir=str(work_dir),
                               reward_path=REWARD_FUNCTION_MODULE,
                               tokenizer_path=None if tokenizer is None else str(tokenizer))
    section = pin_run_dir(config, str(work_dir)).actor_rollout_ref
    from dsv4flash.lora import LoraConfig
    from dsv4flash.train.verl_config import megatron_lora_targets

    # the shell carries the head LoRA too: a policy with train_unembed=False keeps it at zero
    targets = megatron_lora_targets(load_config(flavour), LoraConfig(preset=preset, rank=max_rank, train_head=True))
    with open_dict(section):
        section.model.lora.target_modules = targets
        section.actor.optim.total_training_steps = 1 << 30  # no schedule: each optim_step sets its learning rate
        section.actor.megatron.router_replay.mode = "disabled"
        section.actor.megatron.use_distributed_optimizer = False
        section.rollout.enable_rollout_routing_replay = False
        section.actor.use_dynamic_bsz = False
        section.rollout.log_prob_use_dynamic_bsz = False
        section.rollout.log_prob_micro_batch_size_per_gpu = micro_batch
        section.actor.ppo_micro_batch_size_per_gpu = micro_batch
    return section
