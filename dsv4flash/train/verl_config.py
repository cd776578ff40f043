"""Translate a run config into a complete veRL `ppo_trainer` config and validate it with veRL's own code.

The config is composed from verl's installed tree (`pkg://verl.trainer.config`, `ppo_trainer`) with
`model_engine=megatron` and one Hydra override per setting below, so veRL's schema checks every key we
set; then `verl.utils.config.validate_config` (the check `main_ppo` runs) and veRL's typed dataclasses
(`omega_conf_to_dataclass`) validate the result, `HFModelConfig` included: built by veRL from the
checkpoint's config.json through transformers' AutoConfig (`dsv4flash.hf` registers `deepseek_v41`), or
from the flavour's config.json when the checkpoint is not on this machine. Nothing here needs a GPU.

LoRA targets: the placement is resolved on the reference model (meta device) exactly as the local engine
does, then translated to megatron-core module names with the plugin's name map
(`dsv4flash.integrations.mcore.csa2.weights.name_map`) and compressed into Megatron-Bridge wildcard
patterns (`*.layers.20.self_attention.linear_q_down`, `*.layers.20.mlp.experts.*linear_fc1`).
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4flash.train.preflight import RunConfigError

VERL_CONFIG_MODULE = "verl.trainer.config"
VERL_PRIMARY = "ppo_trainer"
MODEL_PATH_UNSET = "<unset: model.hf_path>"
# veRL's agent-loop manager hook: per-trajectory rollout seeds (dsv4flash.integrations.verl.trajectory_seed)
AGENT_LOOP_MANAGER = "dsv4flash.integrations.verl.trajectory_seed.TrajectorySeededAgentLoopManager"


class VerlConfigError(RunConfigError):
    """A run config that veRL cannot express, or a veRL config that fails veRL's validation."""


def hydra_value(value: Any) -> str:
    """A Python value in Hydra's override grammar (strings quoted, lists/dicts recursive)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as a Hydra override value")


@functools.lru_cache(maxsize=32)
def _selected_modules(config_json: str, lora_json: str) -> frozenset[str]:
    """Release module names a placement adapts (language model only)."""
    from dsv4flash.lora import LoraConfig, resolve_targets
    from dsv4flash.lora.targets import meta_model

    targets = resolve_targets(meta_model(config_json), LoraConfig.from_dict(json.loads(lora_json)))
    return frozenset(c.name for c in targets if not c.name.startswith(("vision.", "aligner.")))


def megatron_lora_targets(mcfg: Any, lora_cfg: Any) -> list[str]:
    """Megatron-Bridge `target_modules` patterns for a LoRA placement (resolved on the reference model)."""
    from dsv4flash.integrations.mcore.csa2.weights import name_map

    selected = _selected_modules(mcfg.to_json(), json.dumps(lora_cfg.to_dict(), sort_keys=True))
    by_module: dict[str, list[str]] = defaultdict(list)
    for pair in name_map(mcfg):
        for ref in pair.reference:
            if ref.endswith(".weight"):
                by_module[pair.megatron[: -len(".weight")]].append(ref[: -len(".weight")])
    covered: set[str] = set()
    chosen: list[str] = []
    for meg, refs in by_module.items():
        hit = [r for r in refs if r in selected]
        if hit and len(hit) != len(refs):
            raise VerlConfigError(f"LoRA placement selects {hit} but not {sorted(set(refs) - set(hit))}; Megatron "
                                  f"fuses them into one module ({meg}), so they must be adapted together on "
                                  "engine=verl")
        if hit:
            chosen.append(meg)
            covered.update(hit)
    missing = sorted(selected - covered)
    if missing:
        raise VerlConfigError(f"LoRA placement selects modules with no Megatron counterpart in the plugin's name "
                              f"map: {missing[:5]}{'...' if len(missing) > 5 else ''}")
    # Compress: one pattern per (layer, module suffix); routed experts take any local id / grouped layout.
    patterns: dict[tuple[str, str], None] = {}
    for meg in chosen:
        parts = meg.split(".")
        layer = parts[2] if parts[:2] == ["decoder", "layers"] else None
        rest = ".".join(parts[3:]) if layer is not None else meg
        if ".local_experts." in rest:
            head, tail = rest.split(".local_experts.")
            rest = f"{head}.*{tail.split('.', 1)[1]}"
        patterns[(layer or "", rest)] = None
    layers = sorted({int(k[0]) for k in patterns if k[0]})
    all_layers = set(range(mcfg.text.num_hidden_layers))
    out: list[str] = []
    for rest in dict.fromkeys(r for _, r in patterns):
        owners = {int(layer) for layer, r in patterns if r == rest and layer}
        if owners == all_layers:
            out.append(f"*.layers.*.{rest}")
        else:
            out.extend(f"*.layers.{layer}.{rest}" for layer in layers if layer in owners)
    if lora_cfg.train_head:  # the head LoRA (`head`, Megatron's `output_layer`) is the placement's own switch
        out.append("output_layer")
    return out


def _lora(cfg: Any):
    from dsv4flash.train.preflight import lora_config

    return lora_config(cfg.lora)


# Keys whose values are paths inside the run directory; the config holds them relative to it (so it moves
# with the directory) and each launch pins them to where the directory is (`pin_run_dir`, launch_verl.sh).
RUN_DIR_KEYS = ("data.train_files", "data.val_files", "trainer.default_local_dir",
                "actor_rollout_ref.model.tokenizer_path", "trainer.dsv4flash_lifecycle.store")


def run_relative(path: str, output_dir: str) -> str:
    """`path` relative to the run directory when it lies inside it, else unchanged (a user's shared path, a URL)."""
    import os

    if "://" in path:
        return path
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(output_dir))
    return path if rel == ".." or rel.startswith(f"..{os.sep}") else rel


def pin_run_dir(config: DictConfig, run_dir: str) -> DictConfig:
    """A copy of `config` whose run-relative paths (`RUN_DIR_KEYS`) are absolute under `run_dir`."""
    import os

    pinned = config.copy()
    for key in RUN_DIR_KEYS:
        value = OmegaConf.select(pinned, key)
        if isinstance(value, str) and not os.path.isabs(value) and "://" not in value:  # s3://… stays a URL
            OmegaConf.update(pinned, key, os.path.join(run_dir, value))
    return pinned


def verl_overrides(cfg: Any, *, data_dir: str, output_dir: str, reward_path: str) -> list[str]:
    """Hydra overrides of verl's ppo_trainer that express the run (engine=verl, algorithm=grpo); paths inside
    `output_dir` are written relative to it, `reward_path` may be veRL's `pkg://module` form."""
    from dsv4flash.config import load_config

    eng, algo, opt = cfg.engine, cfg.algorithm, cfg.optim
    if algo.name != "grpo":
        raise VerlConfigError(f"engine=verl runs GRPO through verl.trainer.main_ppo; algorithm={algo.name!r} is a "
                              "local-engine algorithm (use algorithm=grpo, or engine=local)")
    mcfg = load_config(cfg.model.flavour)
    settings: dict[str, Any] = {
        "model_engine": "megatron",
        # model + plugin
        "actor_rollout_ref.model.path": cfg.model.hf_path or MODEL_PATH_UNSET,
        "actor_rollout_ref.model.external_lib": eng.external_lib,
        "actor_rollout_ref.model.trust_remote_code": False,
        "actor_rollout_ref.model.enable_gradient_checkpointing": eng.recompute,
        # trainer
        "trainer.nnodes": eng.nnodes,
        "trainer.n_gpus_per_node": eng.n_gpus_per_node,
        "trainer.total_training_steps": eng.total_training_steps,
        "trainer.project_name": eng.project_name,
        "trainer.experiment_name": cfg.recipe,
        "trainer.logger": ["console"],
        "trainer.default_local_dir": run_relative(f"{output_dir}/verl_checkpoints", output_dir),
        "trainer.test_freq": eng.test_freq,
        "trainer.save_freq": eng.save_freq,
        "trainer.val_before_train": True,
        # data
        "data.train_files": run_relative(f"{data_dir}/train.parquet", output_dir),
        "data.val_files": run_relative(f"{data_dir}/val.parquet", output_dir),
        "data.train_batch_size": eng.train_batch_size,
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
        "data.image_key": "images",
        "data.prompt_key": "prompt",
        "data.seed": cfg.seed,
        # veRL 0.9.1's reward loop reads `reward.custom_reward_function` (the top-level key is legacy and is
        # migrated only on some trainer paths; the legacy TaskRunner's reward workers would use the default).
        "reward.custom_reward_function.path": reward_path,
        "reward.custom_reward_function.name": "compute_score",
        # GRPO
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": algo.norm_adv_by_std,
        "algorithm.use_kl_in_reward": False,
        "actor_rollout_ref.actor.use_kl_loss": False,
        "actor_rollout_ref.actor.ppo_mini_batch_size": eng.ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": eng.micro_batch_size_per_gpu,
        "actor_rollout_ref.actor.ppo_epochs": algo.ppo_epochs,
        "actor_rollout_ref.actor.clip_ratio_low": algo.clip_ratio_low,
        "actor_rollout_ref.actor.clip_ratio_high": algo.clip_ratio_high,
        "actor_rollout_ref.actor.loss_agg_mode": algo.loss_agg_mode,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": eng.micro_batch_size_per_gpu,
        # optimiser (the study: AdamW, lr 5e-5, constant)
        "actor_rollout_ref.actor.optim.lr": opt.lr,
        "actor_rollout_ref.actor.optim.weight_decay": opt.weight_decay,
        "actor_rollout_ref.actor.optim.betas": list(opt.betas),
        "actor_rollout_ref.actor.optim.clip_grad": opt.clip_grad,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": opt.warmup_steps,
        "actor_rollout_ref.actor.optim.lr_decay_style": opt.schedule,
        "actor_rollout_ref.actor.optim.min_lr": opt.lr * opt.min_lr_ratio,
        # Megatron actor: Bridge-backed model, parallelism, recompute, offload, router replay
        "actor_rollout_ref.actor.megatron.use_mbridge": True,
        "actor_rollout_ref.actor.megatron.vanilla_mbridge": False,
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": eng.tensor_model_parallel_size,
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": eng.pipeline_model_parallel_size,
        "actor_rollout_ref.actor.megatron.context_parallel_size": eng.context_parallel_size,
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size": eng.expert_model_parallel_size,
        "actor_rollout_ref.actor.megatron.param_offload": eng.param_offload,
        "actor_rollout_ref.actor.megatron.optimizer_offload": eng.optimizer_offload,
        "actor_rollout_ref.actor.megatron.router_replay.mode": algo.router_replay,
        "actor_rollout_ref.actor.megatron.dtype": eng.dtype,
        "actor_rollout_ref.ref.megatron.dtype": eng.dtype,
        "actor_rollout_ref.actor.use_dynamic_bsz": eng.dynamic_batching,
        # vLLM rollout: sampled log-probs for the correction, routes for R3, LoRA unmerged
        "actor_rollout_ref.rollout.name": eng.rollout,
        "actor_rollout_ref.rollout.n": algo.group_size,
        "actor_rollout_ref.rollout.temperature": algo.temperature,
        "actor_rollout_ref.rollout.calculate_log_probs": True,
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": algo.router_replay != "disabled",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": eng.rollout_tensor_parallel_size,
        "actor_rollout_ref.rollout.expert_parallel_size": eng.rollout_expert_parallel_size,
        "actor_rollout_ref.rollout.gpu_memory_utilization": eng.gpu_memory_utilization,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": eng.micro_batch_size_per_gpu,
        "actor_rollout_ref.rollout.load_format": "auto",
        "actor_rollout_ref.rollout.dtype": eng.dtype,
        # every request sampled with its trajectory's seed (step, prompt index, group member, rollout.seed), so
        # a run restarted from a checkpoint samples what the uninterrupted run sampled (AGENT_LOOP_MANAGER below)
        "actor_rollout_ref.rollout.seed": cfg.seed,
    }
    if eng.agent_loop_workers is not None:
        settings["actor_rollout_ref.rollout.agent.num_workers"] = eng.agent_loop_workers
    if eng.max_length is not None:
        settings.update({
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": eng.max_length,
            "actor_rollout_ref.rollout.max_model_len": eng.max_length,
        })
    if eng.recompute:
        settings.update({
            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity": "full",
            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method": "uniform",
            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers": 1,
        })
    settings.update(_rollout_correction(algo))
    settings.update(_lora_settings(cfg, mcfg))
    settings.update(_dataset_class(cfg))
    # in veRL's AgentLoopConfig dataclass, not in its yaml: added
    added = {"actor_rollout_ref.rollout.agent.agent_loop_manager_class": AGENT_LOOP_MANAGER}
    if eng.publish:  # keys veRL does not know: read by dsv4flash's LifecycleRayPPOTrainer
        from dsv4flash.train.publish import run_store

        root, policy = run_store(cfg)
        added.update({"trainer.dsv4flash_lifecycle.store": run_relative(str(root), output_dir),
                      "trainer.dsv4flash_lifecycle.policy": policy,
                      # the placement each revision carries, so `dsv4flash serve` rebuilds the adapter's shell
                      "trainer.dsv4flash_lifecycle.placement": json.dumps(_lora(cfg).to_dict(), sort_keys=True)})
        if eng.sync_check_prompt:  # read by LifecycleRayPPOTrainer (dsv4flash.integrations.verl.sync_check)
            added.update({"trainer.dsv4flash_sync_check.prompt": eng.sync_check_prompt,
                          "trainer.dsv4flash_sync_check.tolerance": eng.sync_check_tolerance})
    return ([f"{key}={hydra_value(value)}" for key, value in settings.items()]
            + [f"+{key}={hydra_value(value)}" for key, value in added.items()] + list(eng.overrides))


def _dataset_class(cfg: Any) -> dict[str, Any]:
    """Image tasks read through `ImagePromptDataset` (veRL's stock image extraction resizes Qwen's way with
    `qwen_vl_utils`; the V4.1 processor does the model's own resize); text tasks keep veRL's `RLHFDataset`."""
    from dsv4flash.tasks import TASKS

    if not any(getattr(TASKS.get(name), "multimodal", False) for name in cfg.data.tasks):
        return {}
    return {"data.custom_cls.path": "pkg://dsv4flash.integrations.verl.dataset",
            "data.custom_cls.name": "ImagePromptDataset"}


def _rollout_correction(algo: Any) -> dict[str, Any]:
    corr = algo.rollout_correction
    if corr.mode == "icepop":
        rollout_is, threshold = "token", f"{corr.lower}_{corr.upper}"
    elif corr.mode == "tis":
        rollout_is, threshold = "token", float(corr.tis_cap)
    elif corr.mode == "none":
        rollout_is, threshold = None, 2.0
    else:
        raise VerlConfigError(f"algorithm.rollout_correction.mode must be icepop, tis or none, got {corr.mode!r}")
    block = {"rollout_is": rollout_is, "rollout_is_threshold": threshold, "bypass_mode": corr.bypass}
    out = {f"algorithm.rollout_correction.{k}": v for k, v in block.items()}
    if corr.bypass:
        # Bypass mode reads the actor's copy of the block (the V1 trainer does not copy it over).
        out["actor_rollout_ref.actor.policy_loss.loss_mode"] = "bypass_mode"
        out.update({f"++actor_rollout_ref.actor.policy_loss.rollout_correction.{k}": v for k, v in block.items()})
    return out


def _lora_settings(cfg: Any, mcfg: Any) -> dict[str, Any]:
    if not cfg.lora.enabled:
        raise VerlConfigError("engine=verl trains LoRA adapters; lora.enabled=false (full fine-tuning) is not "
                              "supported by this recipe tree")
    lcfg = _lora(cfg)
    if lcfg.vit != "frozen" and lcfg.vit_lr_mult != 1.0:
        raise VerlConfigError(f"LoRA preset {lcfg.preset!r} trains the ViT at {lcfg.vit_lr_mult}x the learning "
                              "rate; veRL's Megatron optimizer has one learning rate, so per-module multipliers "
                              "exist only on engine=local")
    alpha = int(lcfg.alpha) if float(lcfg.alpha).is_integer() else lcfg.alpha
    lora = {"type": "lora", "merge": cfg.lora.merge, "rank": lcfg.rank, "alpha": alpha, "dropout": lcfg.dropout,
            "target_modules": megatron_lora_targets(mcfg, lcfg), "exclude_modules": [],
            "freeze_vision_model": lcfg.vit == "frozen", "freeze_vision_projection": lcfg.vit == "frozen",
            "freeze_language_model": True, "dtype": None if lcfg.lora_dtype == "float32" else lcfg.lora_dtype}
    out = {f"actor_rollout_ref.model.lora.{k}": v for k, v in lora.items()}
    if lcfg.vit != "frozen":
        out["++actor_rollout_ref.rollout.engine_kwargs.vllm.enable_tower_connector_lora"] = True
    return out


def compose_verl(overrides: list[str]) -> DictConfig:
    """verl's own ppo_trainer composed with `overrides` (Hydra checks every key against verl's tree)."""
    from hydra import compose

    from dsv4flash.train.compose import isolated_hydra

    with isolated_hydra(f"pkg://{VERL_CONFIG_MODULE}"):
        return compose(config_name=VERL_PRIMARY, overrides=overrides)


def build_model_config(model_node: DictConfig, model_config: Any = None):
    """veRL's own `HFModelConfig` from the `actor_rollout_ref.model` section, built as veRL builds it (its
    `__post_init__` reads config.json through transformers' AutoConfig, which knows `deepseek_v41` once veRL
    has loaded our plugin). When `model.path` is not on this machine (a cluster path, or unset), it is built
    from a directory holding `model_config`'s config.json (the config the run asks for), without a tokenizer."""
    import tempfile
    from pathlib import Path

    from verl.utils.config import omega_conf_to_dataclass

    node = OmegaConf.to_container(model_node, resolve=True)
    if Path(str(node["path"])).is_dir():
        return omega_conf_to_dataclass(OmegaConf.create(node))
    if model_config is None:
        raise VerlConfigError(f"actor_rollout_ref.model.path={node['path']!r} is not a directory here; pass the "
                              "model config to check HFModelConfig against")
    with tempfile.TemporaryDirectory(prefix="dsv4flash-hfmodelconfig-") as tmp:
        model_config.save(Path(tmp) / "config.json")
        return omega_conf_to_dataclass(OmegaConf.create({**node, "path": tmp, "load_tokenizer": False}))


def validate_verl(config: DictConfig, model_config: Any = None) -> dict[str, Any]:
    """Run veRL's validators on a composed config -> the typed dataclass sections (HFModelConfig included);
    raises VerlConfigError. `model_config` (a DSV41FlashConfig) is what model.path's config.json must be."""
    import verl  # noqa: F401  (loads the verl.plugins entry points, as every veRL process does)
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import HFModelConfig, McoreActorConfig, RolloutConfig

    try:
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        typed = {
            "actor": omega_conf_to_dataclass(config.actor_rollout_ref.actor),
            "rollout": omega_conf_to_dataclass(config.actor_rollout_ref.rollout),
            "algorithm": omega_conf_to_dataclass(config.algorithm),
            "model": build_model_config(config.actor_rollout_ref.model, model_config),
        }
    except VerlConfigError:
        raise
    except Exception as err:  # veRL raises AssertionError/ValueError/omegaconf errors alike
        raise VerlConfigError(f"veRL rejected the composed config: {type(err).__name__}: {err}") from err
    if not isinstance(typed["actor"], McoreActorConfig):
        raise VerlConfigError(f"actor config is {type(typed['actor']).__name__}, expected McoreActorConfig")
    if not isinstance(typed["rollout"], RolloutConfig) or not isinstance(typed["algorithm"], AlgoConfig):
        raise VerlConfigError("rollout/algorithm sections did not build veRL's RolloutConfig/AlgoConfig")
    model = typed["model"]
    if not isinstance(model, HFModelConfig) or type(model.hf_config).__name__ != "DeepseekV41Config":
        raise VerlConfigError(f"actor_rollout_ref.model built {type(model.hf_config).__name__}, expected "
                              "DeepseekV41Config (is the dsv4flash veRL plugin installed?)")
    if model_config is not None and model.hf_config.to_dsv4flash().to_hf() != model_config.to_hf():
        raise VerlConfigError(f"{model.local_hf_config_path}/config.json is not the '{model_config.name}' config "
                              "the run asks for")
    return typed


def build_verl_config(cfg: Any, *, data_dir: str, output_dir: str, reward_path: str,
                      tokenizer_path: str | None = None) -> DictConfig:
    """Compose and validate the complete veRL config for a run (`tokenizer_path`: a tokenizer other than
    the checkpoint's own, e.g. the task tokenizer of a dsv4flash base in HF form)."""
    from dsv4flash.config import load_config

    overrides = verl_overrides(cfg, data_dir=data_dir, output_dir=output_dir, reward_path=reward_path)
    if tokenizer_path is not None:
        overrides.append(f"actor_rollout_ref.model.tokenizer_path={hydra_value(run_relative(tokenizer_path, output_dir))}")
    config = compose_verl(overrides)
    validate_verl(pin_run_dir(config, output_dir), load_config(cfg.model.flavour))
    return config


__all__ = ["RUN_DIR_KEYS", "VerlConfigError", "build_model_config", "pin_run_dir", "run_relative", "build_verl_config", "compose_verl", "hydra_value",
           "megatron_lora_targets", "validate_verl", "verl_overrides"]
