"""Check a typed run config against what the model and the engine can run, before anything is written.

`check_run` runs first in `python -m dsv4flash.train` (and in `run_verl`): a LoRA field out of range, a
rule adapting a module the placement keeps frozen, a parallel layout the CSA2 Megatron stack cannot run or
a rollout backend veRL does not know is a one-line `RunConfigError` naming the key and the allowed values,
raised before data is exported, a Ray cluster starts or a run directory gets content.
"""

from __future__ import annotations

from typing import Any


class RunConfigError(ValueError):
    """A run config key whose value the model or the engine cannot run (the message names key and allowed values)."""


def check_run(cfg: Any) -> None:
    """Raise RunConfigError for the first key of `cfg` that cannot run; engine-specific checks included."""
    from dsv4flash.config import load_config

    mcfg = load_config(cfg.model.flavour)
    if cfg.lora.enabled:
        check_lora(cfg.lora, mcfg)
    check_lifecycle(cfg)
    if cfg.data.train_size is not None and cfg.data.train_size < 1:
        raise RunConfigError(f"data.train_size={cfg.data.train_size}: expected a positive number of training problems, "
                             "or null (new problems every step)")
    if cfg.engine.name == "verl":
        check_parallel_layout(cfg.engine, mcfg)
        check_context_parallel_data(cfg.engine, cfg.data)
        check_lengths_and_dtype(cfg.engine, cfg.data)
        check_rollout_backend(cfg.engine.rollout)


def check_lifecycle(cfg: Any) -> None:
    """The policy name a run publishes into is a valid one, and its store root is not a file."""
    from pathlib import Path

    from dsv4flash.lifecycle.catalog.schema import TAG

    if not cfg.lifecycle.publish:
        return
    policy = cfg.lifecycle.policy or cfg.recipe
    if not TAG.fullmatch(policy):
        key = "lifecycle.policy" if cfg.lifecycle.policy else "recipe (the default lifecycle.policy)"
        raise RunConfigError(f"{key}={policy!r}: a policy name is letters, digits, '_', '-', '.' (at most 128, "
                             "starting with a letter or digit)")
    if cfg.lifecycle.root and Path(cfg.lifecycle.root).expanduser().is_file():
        raise RunConfigError(f"lifecycle.root={cfg.lifecycle.root!r} is a file; expected an adapter store directory "
                             "(created on the first publish)")


def lora_config(lora: Any):
    """The `dsv4flash.lora.LoraConfig` of a recipe's `lora` node; its validation errors name `lora.<field>`."""
    from dsv4flash.lora.config import LoraConfig  # torch-free: a field out of range is refused before torch loads

    try:
        return LoraConfig.from_recipe(lora)
    except ValueError as err:
        raise RunConfigError(str(err).replace("LoraConfig.", "lora.").replace("LoraConfig(", "lora(")) from None


def check_lora(lora: Any, mcfg: Any) -> None:
    """Field ranges, then the placement on the model (meta device): rules must select adaptable modules."""
    lcfg = lora_config(lora)  # before the imports below (torch): a field out of range answers at once
    from dsv4flash.lora import kv_write_modules, resolve_targets
    from dsv4flash.lora.targets import candidates, meta_model, rule_matches

    model = meta_model(mcfg.to_json())
    if lcfg.freeze_kv_write and not lcfg.include_from_preset:
        frozen = set(kv_write_modules(model))
        names = [c.name for c in candidates(model)]
        for rule in lcfg.include:
            hits = [n for n in names if rule_matches(rule, n)]
            if hits and set(hits) <= frozen:
                raise RunConfigError(f"lora.include rule {rule!r} selects only {hits}, which "
                                     f"lora.freeze_kv_write=true keeps frozen (layer {model.cfg.decoder_start} "
                                     "writes the shared KV); allowed: rules selecting other modules, or "
                                     "lora.freeze_kv_write=false")
    try:
        resolve_targets(model, lcfg)
    except ValueError as err:
        raise RunConfigError(f"lora: {err}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parallel_layout(eng: Any, mcfg: Any) -> None:
    """The Megatron actor's TP/PP/CP/EP against the CSA2 stack (docs/megatron.md §6) and the cluster size."""
    world = eng.nnodes * eng.n_gpus_per_node
    if eng.nnodes < 1 or eng.n_gpus_per_node < 1:
        raise RunConfigError(f"engine.nnodes={eng.nnodes} and engine.n_gpus_per_node={eng.n_gpus_per_node} must be "
                             ">= 1")
    if eng.tensor_model_parallel_size != 1:
        raise RunConfigError(f"engine.tensor_model_parallel_size={eng.tensor_model_parallel_size}: allowed: 1 "
                             "(training with TP > 1 needs sequence parallelism, which the CSA2 stack lacks)")
    if eng.pipeline_model_parallel_size != 1:
        raise RunConfigError(f"engine.pipeline_model_parallel_size={eng.pipeline_model_parallel_size}: allowed: 1 "
                             "(megatron-core 0.19 sends only hidden_states between stages; CSA2 needs more)")
    cp = eng.context_parallel_size
    cp_ok = _divisors(world)
    if cp not in cp_ok:
        raise RunConfigError(f"engine.context_parallel_size={cp} must divide the {world} ranks "
                             f"(engine.nnodes x engine.n_gpus_per_node); allowed: {cp_ok}")
    experts = mcfg.text.n_routed_experts
    ep = eng.expert_model_parallel_size
    ep_ok = [d for d in _divisors(experts) if world % d == 0]
    if ep not in ep_ok:
        raise RunConfigError(f"engine.expert_model_parallel_size={ep} must divide both the {experts} routed experts "
                             f"of model={mcfg.name} and the {world} ranks; allowed: {ep_ok}")
    rollout = [("engine.rollout_tensor_parallel_size", eng.rollout_tensor_parallel_size),
               ("engine.rollout_expert_parallel_size", eng.rollout_expert_parallel_size)]
    for key, size in rollout:
        if size not in _divisors(world):
            raise RunConfigError(f"{key}={size} must divide the {world} ranks; allowed: {_divisors(world)}")
    workers = eng.agent_loop_workers
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise RunConfigError(f"engine.agent_loop_workers={workers!r} must be a positive number of processes "
                             "(or null for veRL's default)")
    if eng.rollout_expert_parallel_size > 1 and experts % eng.rollout_expert_parallel_size:
        raise RunConfigError(f"engine.rollout_expert_parallel_size={eng.rollout_expert_parallel_size} must divide "
                             f"the {experts} routed experts; allowed: {ep_ok}")


def check_context_parallel_data(eng: Any, data: Any) -> None:
    """Context parallelism splits every sequence over ranks; the Megatron actor cannot split an image span."""
    from dsv4flash.tasks import TASKS

    cp = eng.context_parallel_size
    if cp == 1:
        return
    images = sorted(name for name, weight in dict(data.tasks).items()
                    if weight and name in TASKS and TASKS[name].multimodal)
    if images:
        text = sorted(name for name, task in TASKS.items() if not task.multimodal)
        raise RunConfigError(f"engine.context_parallel_size={cp} with image prompts (data.tasks {images}): a "
                             "context-parallel rank holds part of each image span, and the Megatron actor embeds "
                             "images only on whole rows (DSV41MegatronModel.embed_images); allowed: "
                             f"engine.context_parallel_size=1 with image tasks, or text tasks only {text} "
                             "(e.g. data=arithmetic)")


# float32 through DSV41-VERL-010 (stock veRL 0.9.1's Megatron engine takes bfloat16 | float16 only).
VERL_DTYPES = ("bfloat16", "float16", "float32")


def check_lengths_and_dtype(eng: Any, data: Any) -> None:
    """veRL's Megatron engine dtypes; prompt + response must fit `engine.max_length`."""
    if eng.dtype not in VERL_DTYPES:
        raise RunConfigError(f"engine.dtype={eng.dtype!r}: allowed: {list(VERL_DTYPES)}")
    need = data.max_prompt_length + data.max_response_length
    if eng.max_length is not None and eng.max_length < need:
        raise RunConfigError(f"engine.max_length={eng.max_length} is below data.max_prompt_length + "
                             f"data.max_response_length = {need}; allowed: >= {need}, or null")


def rollout_backends() -> list[str]:
    """Rollout names veRL can run as servers: in both its rollout registry and its replica registry."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return sorted({name for name, mode in _ROLLOUT_REGISTRY if mode == "async"} & set(RolloutReplicaRegistry._registry))


def check_rollout_backend(name: str) -> None:
    """`engine.rollout` must name a backend registered with veRL (after the dsv4flash plugin has loaded)."""
    import verl  # noqa: F401  (loads the verl.plugins entry points, which may register backends)

    allowed = rollout_backends()
    if name not in allowed:
        raise RunConfigError(f"engine.rollout={name!r} is not a rollout backend registered with veRL; allowed: "
                             f"{allowed}")

