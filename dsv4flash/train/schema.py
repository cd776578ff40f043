"""Typed schema of a training run, stored in Hydra's ConfigStore.

The primary config `recipes/config.yaml` names `train_schema` first in its defaults, so every key a
recipe or the command line sets is checked against these dataclasses at compose time: a misspelt key or
a wrongly typed value is an error naming the key. `engine` and `algorithm` hold one of several option
schemas (each option file names its own schema: `engine/local.yaml` -> `local_schema`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class ModelConf:
    """The base model: architecture flavour and where its weights come from."""

    # config flavour ("tiny", "flash", "tiny_mtp") or a path to a release config.json
    flavour: str = "tiny"
    # "pretrain_tiny" (built by the project, cached), "random" (seeded init) or a checkpoint directory
    base: str = "pretrain_tiny"
    # dtype of the base weights on the local engine: auto (the release's compute dtype, bfloat16, on CUDA; float32
    # on the CPU), float32 or bfloat16
    dtype: str = "auto"
    # cache root for built bases (default $DSV4FLASH_CACHE or ~/.cache/dsv4flash)
    cache_dir: Optional[str] = None
    # HF-format release checkpoint that veRL/Megatron-Bridge/vLLM load (engine=verl)
    hf_path: Optional[str] = None
    # overrides of the pretrain_tiny recipe used when the base must be built (e.g. ["engine.steps=20"])
    base_overrides: list[str] = field(default_factory=list)


@dataclass
class DataConf:
    """Which built-in tasks to train on, with mixture weights and per-task options."""

    # task name -> mixture weight (tasks: arithmetic, countdown, geometry). Empty here: the data group
    # (recipes/data/*.yaml, default geometry) fills it, and Hydra merges dicts, so a default entry would
    # stay in every mixture (data=arithmetic would still train on geometry).
    tasks: dict[str, float] = field(default_factory=dict)
    # task name -> constructor options (e.g. {geometry: {max_shapes: 3}})
    task_options: dict[str, Any] = field(default_factory=dict)
    # held-out problems, never drawn for training
    val_size: int = 128
    # longest generated answer (tokens, eos included)
    max_new_tokens: int = 8
    # prompt/answer budget of a row when exported for veRL
    max_prompt_length: int = 64
    max_response_length: int = 16
    # training problems: null draws new ones every step (engine=local) and writes 4096 rows to veRL's training file;
    # N trains on a fixed set of N problems, a new seeded order each epoch (engine=local), and is that file's size
    train_size: Optional[int] = None


@dataclass
class OptimConf:
    """AdamW with warmup and a constant or cosine schedule (the study: lr 5e-5, constant)."""

    lr: float = 5e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    # constant | cosine
    schedule: str = "constant"
    # cosine floor as a fraction of lr
    min_lr_ratio: float = 0.0
    # global grad-norm clip (0 disables)
    clip_grad: float = 1.0


@dataclass
class LoraConf:
    """LoRA placement (`dsv4flash.lora.LoraConfig`); null fields come from the preset."""

    # false trains every parameter (used by pretrain_tiny)
    enabled: bool = True
    # full_linear | full_linear_r8 | decoder_half | encoder_half | lean_attention | no_down_proj | vit_lr_0p1 | custom
    preset: str = "full_linear"
    rank: Optional[int] = None
    # default 2 * rank (the study's setting)
    alpha: Optional[float] = None
    dropout: float = 0.0
    # frozen | train
    vit: Optional[str] = None
    vit_lr_mult: Optional[float] = None
    freeze_kv_write: Optional[bool] = None
    # all | encoder | decoder | explicit ids
    layers: Optional[str] = None
    include: Optional[list[str]] = None
    exclude: Optional[list[str]] = None
    lora_dtype: str = "float32"
    seed: int = 0
    # merge into the base for veRL weight sync (false: adapters travel unmerged, as the study)
    merge: bool = False


@dataclass
class PretrainAlgo:
    """Next-token pretraining of the whole model on prompt and answer text."""

    name: str = "pretrain"


@dataclass
class SFTAlgo:
    """Supervised fine-tuning: NLL of the reference answer."""

    name: str = "sft"


@dataclass
class DPOAlgo:
    """Direct preference optimisation on (reference answer, wrong answer) pairs; reference = the base."""

    name: str = "dpo"
    beta: float = 0.1


@dataclass
class RolloutCorrectionConf:
    """Train/rollout mismatch correction: icepop (mask outside [lower, upper]), tis (clamp at tis_cap) or none."""

    mode: str = "icepop"
    lower: float = 0.5
    upper: float = 5.0
    tis_cap: float = 2.0
    # true: the rollout log-probs serve as the old policy (no recompute); false: decoupled (recompute old)
    bypass: bool = False


@dataclass
class GRPOAlgo:
    """GRPO: group-normalised advantages, clipped policy loss, rollout correction over sampled log-probs."""

    name: str = "grpo"
    # samples per prompt
    group_size: int = 8
    temperature: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    norm_adv_by_std: bool = True
    # token-mean | seq-mean-token-mean
    loss_agg_mode: str = "token-mean"
    # optimisation passes over each rollout batch, and mini-batches per pass
    ppo_epochs: int = 1
    mini_batches: int = 1
    rollout_correction: RolloutCorrectionConf = field(default_factory=RolloutCorrectionConf)
    # dtype the local sampler runs in (bfloat16 emulates a bf16 rollout engine against an fp32 trainer)
    rollout_dtype: str = "float32"
    # veRL: replay the rollout's expert routes in the Megatron forward (disabled | R2 | R3)
    router_replay: str = "R3"


@dataclass
class LocalEngine:
    """Embedded single-process engine (CUDA when present, else the CPU)."""

    name: str = "local"
    steps: int = 100
    # training sequences per step (GRPO: batch_size / group_size prompts, each sampled group_size times;
    # DPO: batch_size / 2 pairs)
    batch_size: int = 32
    # learning rate on the local engine (null: optim.lr); tiny models need more than the study's 5e-5
    lr: Optional[float] = None
    eval_every: int = 20
    log_every: int = 5
    # save a resumable checkpoint every N steps (0: only at the end)
    checkpoint_every: int = 25
    # resume from output_dir/checkpoint when present
    resume: bool = True
    # forward only the trainable layers with grad (LoRA early stop)
    early_stop: bool = True
    # greedy-decode the validation set at each evaluation (accuracy / reward)
    eval_generate: bool = True
    # torch threads (0: leave torch's default)
    threads: int = 1
    # rich progress bar (auto: only on a terminal)
    progress: str = "auto"
    # where it computes: auto (CUDA when torch sees a device, else the CPU), cpu, cuda or cuda:N
    device: str = "auto"


@dataclass
class VerlEngine:
    """veRL GRPO (`verl.trainer.main_ppo`): Megatron actor with the dsv4flash plugin, vLLM rollout with LoRA."""

    name: str = "verl"
    # auto: launch only when CUDA GPUs are visible; never: stop after validation; force: launch regardless
    launch: str = "auto"
    nnodes: int = 1
    n_gpus_per_node: int = 8
    total_training_steps: int = 100
    # prompts per step (each sampled algorithm.group_size times)
    train_batch_size: int = 32
    ppo_mini_batch_size: int = 32
    micro_batch_size_per_gpu: int = 1
    # Megatron actor parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 2
    expert_model_parallel_size: int = 8
    # Megatron actor and rollout compute dtype: bfloat16 | float16 | float32 (float32: DSV41-VERL-010; CPU runs)
    dtype: str = "bfloat16"
    # dynamic batching: micro-batches packed up to max_length tokens per GPU instead of a fixed count
    dynamic_batching: bool = False
    # longest sequence (prompt + response) the actor and rollout take (null: veRL's defaults)
    max_length: Optional[int] = None
    # uniform full recompute, as the study
    recompute: bool = True
    optimizer_offload: bool = True
    param_offload: bool = False
    # rollout backend: a name registered with veRL's rollout and replica registries (vllm on GPU clusters)
    rollout: str = "vllm"
    # vLLM rollout
    rollout_tensor_parallel_size: int = 8
    rollout_expert_parallel_size: int = 8
    gpu_memory_utilization: float = 0.6
    # veRL's agent-loop worker processes that split each step's rollout requests (each imports the whole stack;
    # null: veRL's default, 8)
    agent_loop_workers: Optional[int] = None
    # the plugin module veRL imports in every worker (HFModelConfig.external_lib)
    external_lib: str = "dsv4flash.integrations.verl.plugin"
    # where the exported parquet files and reward function go (default: output_dir/verl_data)
    data_dir: Optional[str] = None
    project_name: str = "dsv4flash"
    test_freq: int = 10
    save_freq: int = 50
    # publish every checkpointed step (save_freq) as a lifecycle revision of policy lifecycle.policy in the store
    # lifecycle.root and resume from that policy's head (dsv4flash.integrations.verl.lifecycle_trainer; legacy
    # trainer only)
    publish: bool = False
    # with publish: after every weight sync the rollout's log-probs of this fixed prompt are compared with the
    # actor's (metric weight_sync/fixed_prompt_logprob_diff_max; null: no check); a difference above the
    # tolerance stops the run (null: measure only; fp32 runs: 1e-5)
    sync_check_prompt: Optional[str] = "q : 12 + 30 = ? a : 42"
    sync_check_tolerance: Optional[float] = None
    # raw veRL overrides appended last (Hydra override grammar against verl's ppo_trainer)
    overrides: list[str] = field(default_factory=list)


@dataclass
class LifecycleConf:
    """Where a run's adapters go: each saved one becomes a revision of a policy in an adapter store."""

    # publish every saved adapter (engine=local: each checkpoint and the final adapter of a LoRA run)
    publish: bool = True
    # store root: a directory or an initialised s3://bucket/prefix store (docs/lifecycle.md); null: $DSV4FLASH_STORE,
    # else $XDG_DATA_HOME/dsv4flash/store, else ~/.local/share/dsv4flash/store
    root: Optional[str] = None
    # policy name (null: the recipe's name)
    policy: Optional[str] = None


@dataclass
class TrainConfig:
    """A whole run: model, data, engine, optimiser, LoRA placement and algorithm."""

    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    engine: Any = MISSING
    optim: OptimConf = field(default_factory=OptimConf)
    lora: LoraConf = field(default_factory=LoraConf)
    algorithm: Any = MISSING
    lifecycle: LifecycleConf = field(default_factory=LifecycleConf)
    seed: int = 0
    # where outputs go (null: the Hydra run directory)
    output_dir: Optional[str] = None
    # the recipe this run came from (set by each recipe file)
    recipe: str = "default"


SCHEMAS: dict[tuple[str | None, str], type] = {
    (None, "train_schema"): TrainConfig,
    ("engine", "local_schema"): LocalEngine,
    ("engine", "verl_schema"): VerlEngine,
    ("algorithm", "pretrain_schema"): PretrainAlgo,
    ("algorithm", "sft_schema"): SFTAlgo,
    ("algorithm", "dpo_schema"): DPOAlgo,
    ("algorithm", "grpo_schema"): GRPOAlgo,
}


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent: storing again replaces the same node)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        cs.store(group=group, name=name, node=node)


class UnknownKeyError(KeyError):
    """A config key that no schema declares (e.g. a misspelling added with `+`)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown config key"


def check_known_keys(node: Any, schema: type | None = None, path: str = "") -> None:
    """Raise UnknownKeyError for any key of a composed config that its dataclass schema does not declare.

    Hydra lets `+key=value` add keys even to structured nodes and `OmegaConf.to_object` then drops them
    silently; this walk turns such a typo into an error naming the key and the closest declared one.
    """
    import dataclasses
    import difflib

    from omegaconf import DictConfig, OmegaConf

    if not isinstance(node, DictConfig):
        return
    schema = schema or OmegaConf.get_type(node)
    if schema is None or not dataclasses.is_dataclass(schema):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node.keys():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {path + '.' if path else ''}{close[0]}?" if close else ""
            raise UnknownKeyError(f"unknown config key '{where}': {schema.__name__} declares "
                                  f"{sorted(fields)}{hint}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            child_type = OmegaConf.get_type(child)
            check_known_keys(child, child_type if dataclasses.is_dataclass(child_type) else None, where)
