"""The embedded local engine: single-process training of the tiny model (pretrain, SFT, DPO, GRPO), on CUDA when
torch sees a device and on the CPU otherwise (`engine.device`, `model.dtype`: dsv4flash/engine/device.py).

`run_local(cfg, output_dir, base_dir)` builds the reference model, loads the base, places LoRA, trains
with progress and periodic validation, checkpoints for bit-identical resume, and writes the outputs:

    output_dir/adapter/            PEFT adapter (adapter_config.json + adapter_model.safetensors + dsv4flash_adapter.json)  [LoRA runs]
    output_dir/model/              full model in base format (model.safetensors, config.json, ...)  [no LoRA]
    output_dir/revision.json       the new adapter revision: content hash, parent base, step, metrics
    output_dir/summary.json        run summary
    output_dir/metrics.jsonl       every step record
    output_dir/loss_curve.png      train/val loss (and reward) against step
    output_dir/checkpoint/state.pt resumable state

and hands each checkpoint of a LoRA run to `on_save` (`python -m dsv4flash.train` publishes it into the
adapter store: dsv4flash/train/publish.py).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from dsv4flash.config import load_config
from dsv4flash.engine import model_io, report
from dsv4flash.engine.algorithms import ALGORITHMS, StepContext, step_seed
from dsv4flash.engine.checkpoint import load_checkpoint, save_checkpoint
from dsv4flash.engine.device import DTYPES, Compute, on_device, resolve_compute
from dsv4flash.engine.evaluate import evaluate
from dsv4flash.engine.fingerprint import fingerprint
from dsv4flash.engine.progress import ProgressLog
from dsv4flash.tasks import Encoder, TaskMixture, TaskTokenizer, build_task

LOCAL_MAX_PARAMS = 200_000_000


@dataclass
class LocalResult:
    """Where a local run put its outputs, and its summary."""

    output_dir: Path
    summary: dict[str, Any]
    adapter_dir: Path | None
    model_dir: Path | None


def _optimizer(model: torch.nn.Module, cfg: Any, lr: float, handle: Any) -> tuple[torch.optim.Optimizer, list]:
    """AdamW over the adapters (LoRA param groups) or over every parameter (decay on matrices only)."""
    opt = cfg.optim
    if handle is not None:
        from dsv4flash.lora import param_groups

        groups = param_groups(model, handle, lr, weight_decay=opt.weight_decay)
    else:
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        plain = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"name": "decay", "params": decay, "lr": lr, "weight_decay": opt.weight_decay},
                  {"name": "no_decay", "params": plain, "lr": lr, "weight_decay": 0.0}]
    for g in groups:
        g["base_lr"] = g["lr"]
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(groups, betas=tuple(opt.betas), eps=opt.eps), params


def lr_factor(step: int, total: int, opt: Any) -> float:
    """Linear warmup then constant or cosine (down to min_lr_ratio) at optimizer step `step` (0-based)."""
    import math

    if opt.warmup_steps > 0 and step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return 1.0
    if opt.schedule == "cosine":
        span = max(total - opt.warmup_steps, 1)
        progress = min(max(step - opt.warmup_steps, 0) / span, 1.0)
        return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"optim.schedule must be 'constant' or 'cosine', got {opt.schedule!r}")


def resolve_run(cfg: Any) -> tuple[Any, Compute]:
    """(`cfg` with `model.dtype` resolved, where it computes): `engine.device`/`model.dtype` auto -> CUDA and the
    release's compute dtype when torch sees a CUDA device, else the CPU in float32. The run fingerprint sees the
    resolved dtype (a CPU run's is the same as before `auto` existed); the device is not part of it."""
    if cfg.model.dtype not in ("auto", *DTYPES):
        raise ValueError(f"model.dtype must be auto or one of {sorted(DTYPES)} on engine=local, got {cfg.model.dtype!r}")
    compute = resolve_compute(cfg.engine.device, cfg.model.dtype, release_dtype=load_config(cfg.model.flavour).dtype,
                              what="engine.device")
    if cfg.model.dtype != compute.dtype_name:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=compute.dtype_name))
    return cfg, compute


def _check_local_size(mcfg) -> int:
    from dsv4flash.model.transformer import Transformer

    n = sum(p.numel() for p in Transformer(mcfg, device="meta", seed=None).parameters())
    if n > LOCAL_MAX_PARAMS:
        raise ValueError(f"engine=local trains in one process; model '{mcfg.name}' has {n:,} parameters (limit "
                         f"{LOCAL_MAX_PARAMS:,}). Use model=tiny, or engine=verl for the full-size model.")
    return n


def run_local(cfg: Any, output_dir: str | Path, *, base_dir: str | Path | None = None,
              stop_after: int | None = None, log: ProgressLog | None = None,
              on_save: Callable[..., dict | None] | None = None) -> LocalResult:
    """Train per `cfg` (a TrainConfig with engine=local) into `output_dir`; `stop_after` ends early (tests);
    `log` is the caller's console and run log (default: a console per `engine.progress`).

    `on_save(step=, model=, optimizer=, handle=, lr=)` runs after each checkpoint of a LoRA run (the final one
    included); what it returns (JSON-able) is kept as "published" in revision.json and the summary."""
    from dsv4flash.model.transformer import Transformer

    eng, algo_cfg = cfg.engine, cfg.algorithm
    if algo_cfg.name not in ALGORITHMS:
        raise ValueError(f"algorithm.name must be one of {sorted(ALGORITHMS)}, got {algo_cfg.name!r}")
    cfg, compute = resolve_run(cfg)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if eng.threads > 0:
        torch.set_num_threads(eng.threads)
    log = log or ProgressLog(eng.progress)

    mcfg = load_config(cfg.model.flavour)
    base_sha = ""
    if base_dir is not None:
        stored = model_io.base_config(base_dir)
        if stored.to_hf() != mcfg.to_hf():
            raise ValueError(f"{base_dir}/config.json is not the '{cfg.model.flavour}' config the run asks for")
        base_sha = model_io.read_manifest(base_dir)["weights_sha256"]
        tokenizer = TaskTokenizer.load(base_dir, mcfg)
    else:
        tokenizer = TaskTokenizer(mcfg)
    n_params = _check_local_size(mcfg)

    # Built, loaded and LoRA-wrapped on the CPU (the same initial bits on every device), then moved.
    model = Transformer(mcfg, compute.dtype, "cpu", seed=cfg.seed)
    if base_dir is not None:
        model_io.load_base_weights(model, base_dir)
    ref_model = None
    if algo_cfg.name == "dpo":
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    lr = eng.lr if eng.lr is not None else cfg.optim.lr
    handle = None
    if cfg.lora.enabled:
        from dsv4flash.lora import LoraConfig, apply_lora, forward_with_early_stop

        handle = apply_lora(model, LoraConfig.from_recipe(cfg.lora))
        log.print(handle.summary())
        train_forward = partial(forward_with_early_stop, model) if eng.early_stop else model
    elif algo_cfg.name != "pretrain":
        log.print("lora.enabled=false: fine-tuning every parameter")
        train_forward = model
    else:
        train_forward = model
    if compute.device.type != "cpu":
        model.to(compute.device)  # in place: the LoRA handle and train_forward keep pointing at the same modules
        if ref_model is not None:
            ref_model.to(compute.device)
        log.print(f"computing on {compute.describe()}")
    optimizer, params = _optimizer(model, cfg, lr, handle)
    if not params:
        raise ValueError("nothing to train: the LoRA placement selected no module and lora.enabled is true")

    tasks = {name: build_task(name, **dict(cfg.data.task_options.get(name, {}) or {})) for name in cfg.data.tasks}
    mixture = TaskMixture(tasks, dict(cfg.data.tasks), cfg.seed, cfg.data.val_size, cfg.data.train_size)
    encoder = Encoder(tokenizer, mcfg)
    # Batches, samplers and losses hold CPU tensors; on another device only the model's calls cross over.
    infer_forward = on_device(model, compute.device)
    ctx = StepContext(model=model, train_forward=on_device(train_forward, compute.device), infer_forward=infer_forward,
                      encoder=encoder, mixture=mixture, optimizer=optimizer, params=params,
                      clip_grad=cfg.optim.clip_grad, batch_size=eng.batch_size,
                      max_new_tokens=cfg.data.max_new_tokens, seed=cfg.seed,
                      ref_model=on_device(ref_model, compute.device) if ref_model is not None else None)
    algorithm = ALGORITHMS[algo_cfg.name](ctx, algo_cfg)

    fp = fingerprint(cfg, base_sha)
    published: dict[str, Any] | None = None

    def publish(step: int) -> None:
        nonlocal published
        if on_save is not None and handle is not None:
            published = on_save(step=step, model=model, optimizer=optimizer, handle=handle,
                                lr=optimizer.param_groups[0]["lr"])

    ckpt_dir = out / "checkpoint"
    start, history = 0, []
    if eng.resume:
        restored = load_checkpoint(ckpt_dir, model=model, optimizer=optimizer, fingerprint=fp)
        if restored is not None:
            start, history = restored
            log.print(f"resumed from {ckpt_dir} at step {start}")
    trainable = sum(p.numel() for p in params)
    log.print(f"{cfg.recipe}: {algo_cfg.name} on {'+'.join(sorted(tasks))}, {eng.steps} steps × {eng.batch_size} "
              f"prompts, lr {lr:g}{' (engine.lr; optim.lr ' + format(cfg.optim.lr, 'g') + ')' if eng.lr else ''}, "
              f"{trainable:,} trainable of {n_params:,} parameters")

    eval_times: list[float] = []

    def run_eval(step: int) -> dict[str, float]:
        model.eval()
        t0 = time.perf_counter()
        with log.task(f"eval@{step}", len(mixture.val), unit="examples") as task:
            metrics = evaluate(infer_forward, encoder, mixture, decode=eng.eval_generate,
                               max_new_tokens=cfg.data.max_new_tokens, on_batch=task.advance)
        eval_times.append(time.perf_counter() - t0)
        model.train()
        return metrics

    t_start = time.perf_counter()
    step_times: list[float] = []
    step_tokens: list[int] = []
    if start == 0:
        history.append({"step": 0, **run_eval(0)})
        log.line(0, eng.steps, history[-1])
    end = eng.steps if stop_after is None else min(eng.steps, stop_after)
    model.train()
    with log.task("train", eng.steps, unit="steps", start=start) as bar:
        for step in range(start, end):
            for g in optimizer.param_groups:
                g["lr"] = g["base_lr"] * lr_factor(step, eng.steps, cfg.optim)
            torch.manual_seed(step_seed(cfg.seed, step, "torch"))
            t0 = time.perf_counter()
            metrics = algorithm.step(step)
            step_times.append(time.perf_counter() - t0)
            step_tokens.append(int(metrics.pop("tokens", 0)))
            record = {"step": step + 1, "lr": optimizer.param_groups[0]["lr"], "step_time": step_times[-1], **metrics}
            done = step + 1
            if done % eng.eval_every == 0 or done == eng.steps:
                record.update(run_eval(done))
            history.append(record)
            bar.advance(1, f"loss {record.get('loss', float('nan')):.4f}"
                        + (f"  reward {record['reward']:.3f}" if "reward" in record else ""))
            if done % eng.log_every == 0 or "val_loss" in record or done == end:
                log.line(done, eng.steps, record)
            if eng.checkpoint_every > 0 and done % eng.checkpoint_every == 0 and done < eng.steps:
                save_checkpoint(ckpt_dir, step=done, model=model, optimizer=optimizer, history=history,
                                fingerprint=fp)
                publish(done)
    finished = end == eng.steps
    save_checkpoint(ckpt_dir, step=end, model=model, optimizer=optimizer, history=history, fingerprint=fp)
    report.write_history(out / "metrics.jsonl", history)
    if not finished:
        publish(end)
        stopped = {"stopped_at": end} if published is None else {"stopped_at": end, "published": published}
        return LocalResult(out, stopped, None, None)

    adapter_dir = model_dir = None
    revision = None
    if handle is not None:
        from dsv4flash.lora import save_peft_adapter

        adapter_dir = save_peft_adapter(model, handle, out / "adapter",
                                        base_model_name_or_path=str(base_dir) if base_dir else None, overwrite=True)
        publish(end)  # after the adapter is on disk: a store that refuses it loses nothing
        weights = adapter_dir / "adapter_model.safetensors"
        revision = {"revision": model_io.tensor_digest(weights)[:16], "adapter": str(adapter_dir),
                    "parent_base_sha256": base_sha or None, "base": str(base_dir) if base_dir else None,
                    "step": end, "recipe": cfg.recipe, "algorithm": algo_cfg.name,
                    "config_fingerprint": fp, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "published": published}
        report.write_json(out / "revision.json", revision)
    else:
        model.requires_grad_(False)
        model_dir = model_io.save_base(model, mcfg, tokenizer, out / "model",
                                       {"recipe": cfg.recipe, "config_fingerprint": fp, "steps": end,
                                        "parent_base_sha256": base_sha or None})

    evals = [r for r in history if "val_loss" in r]
    summary = {
        "recipe": cfg.recipe, "algorithm": algo_cfg.name, "tasks": dict(cfg.data.tasks), "steps": end,
        "batch_size": eng.batch_size, "lr": lr, "optim_lr": cfg.optim.lr,
        "lr_note": ("engine.lr overrides optim.lr on the local engine (tiny model; see docs/recipes.md)"
                    if eng.lr is not None else "optim.lr"),
        "seed": cfg.seed, "model": {"flavour": cfg.model.flavour, "parameters": n_params, "base": str(base_dir),
                                    "base_sha256": base_sha or None},
        "compute": {"device": str(compute.device), "dtype": compute.dtype_name},
        "lora": ({"preset": handle.config.preset, "rank": handle.config.rank, "alpha": handle.config.alpha,
                  "trainable_params": handle.trainable_params, "by_group": handle.params_by_group(),
                  "layers": list(handle.layers())} if handle is not None else None),
        "trainable_params": trainable,
        "val_loss_initial": evals[0]["val_loss"], "val_loss_final": evals[-1]["val_loss"],
        "val_reward_initial": evals[0].get("val_reward"), "val_reward_final": evals[-1].get("val_reward"),
        "train_loss_first": _mean([r["loss"] for r in history if "loss" in r][:5]),
        "train_loss_last": _mean([r["loss"] for r in history if "loss" in r][-5:]),
        "step_time_median_s": sorted(step_times)[len(step_times) // 2] if step_times else None,
        # Phases of this call (a resumed run counts its own steps): the optimizer steps and the evaluations.
        "train_time_s": sum(step_times), "eval_time_s": sum(eval_times), "train_tokens": sum(step_tokens),
        "train_tokens_per_s": sum(step_tokens) / sum(step_times) if step_times and sum(step_tokens) else None,
        "wall_time_s": time.perf_counter() - t_start,
        "config_fingerprint": fp, "revision": revision, "published": published,
        "outputs": {"adapter": str(adapter_dir) if adapter_dir else None,
                    "model": str(model_dir) if model_dir else None,
                    "metrics": str(out / "metrics.jsonl"), "plot": str(out / "loss_curve.png")},
    }
    if "reward" in history[-1]:
        summary["train_reward_first"] = _mean([r["reward"] for r in history if "reward" in r][:5])
        summary["train_reward_last"] = _mean([r["reward"] for r in history if "reward" in r][-5:])
    report.plot_curves(history, out / "loss_curve.png", f"{cfg.recipe}: {algo_cfg.name}, lr {lr:g}")
    report.write_json(out / "summary.json", summary)
    log.print(f"val loss {summary['val_loss_initial']:.4f} -> {summary['val_loss_final']:.4f}"
              + (f", val reward {summary['val_reward_initial']:.3f} -> {summary['val_reward_final']:.3f}"
                 if summary["val_reward_final"] is not None else "") + f"; outputs in {out}")
    return LocalResult(out, summary, adapter_dir, model_dir)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
