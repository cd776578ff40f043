"""A veRL checkpoint step as a lifecycle revision, and back: `publish_step` / `restore_step`.

veRL's `_save_checkpoint` writes `global_step_N/` (the Megatron actor's distributed checkpoint with its
optimizer, scheduler and RNG states, the HF PEFT adapter under `actor/model/huggingface/adapter`, the
dataloader's `data.pt`). `publish_step` publishes that adapter in the project's format (packed MoE LoRA,
checked against the base's placement) as the policy's new head, with the whole step folder as the revision's
trainer-state blob, the scheduler position and data position, and appends the step's rollout records.
`restore_step` writes a revision's step folder back (temp path, then rename) for veRL's own `_load_checkpoint`.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

ADAPTER_DIR = Path("actor") / "model" / "huggingface" / "adapter"
STEP_PREFIX = "global_step_"


def step_adapter(step_dir: str | os.PathLike, cfg) -> tuple[Any, dict]:
    """(PackedMoELoRA, adapter_config) of a veRL step folder's HF adapter; errors name the file."""
    from safetensors.torch import load_file

    from dsv4flash.integrations.verl.rollout.weights import adapter_from_sync
    from dsv4flash.lifecycle.packed import PackedMoELoRA

    adapter = Path(step_dir) / ADAPTER_DIR
    config_path, weights_path = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: veRL's step checkpoint has no HF adapter file (is 'hf_model' in "
                                    "actor_rollout_ref.actor.checkpoint.save_contents?)")
    peft_config = json.loads(config_path.read_text())
    try:
        tensors = unpack_target_parameters(load_file(str(weights_path)), peft_config)
        _, canonical = adapter_from_sync(tensors, peft_config, cfg)
    except ValueError as exc:
        raise ValueError(f"{weights_path}: {exc}") from None
    return PackedMoELoRA.from_packed_tensors(canonical, alpha=float(peft_config["lora_alpha"]),
                                             source=str(weights_path)), peft_config


def unpack_target_parameters(tensors: dict, peft_config: Mapping[str, Any]) -> dict:
    """Megatron-Bridge's `save_hf_adapter` writes 3-D adapter factors (V4.1's grouped `wo_a`: A [G, r, in_g],
    B [G, out_g, r]) as PEFT `target_parameters` in ParamWrapper layout under the parent module's prefix
    (`_pack_target_parameter_adapter_weights`: A' = cat_g(B_g^T) [G·r, out_g], B' = cat_g(A_g^T) [in_g, G·r]);
    put them back under `<param>.lora_{A,B}.weight` as the bridge's export (and a weight sync) names them."""
    import torch

    out = dict(tensors)
    rank = int(peft_config["r"])
    depth: dict[str, int] = {}
    for param in peft_config.get("target_parameters") or []:
        parent = param.rpartition(".")[0]
        prefix = "base_model.model." + parent + ".base_layer" * depth.get(parent, 0)
        depth[parent] = depth.get(parent, 0) + 1
        a_key, b_key = f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"
        if a_key not in out or b_key not in out:
            raise ValueError(f"target parameter {param!r}: no {a_key} / {b_key} in the adapter file")
        packed_a, packed_b = out.pop(a_key), out.pop(b_key)
        if packed_b.ndim == 3 or packed_a.shape[0] % rank or packed_b.shape[1] != packed_a.shape[0]:
            a, b = packed_a, packed_b  # not packed by the bridge (only 3-D pairs are)
        else:
            groups = packed_a.shape[0] // rank
            b = torch.stack([packed_a[g * rank:(g + 1) * rank].T for g in range(groups)]).contiguous()
            a = torch.stack([packed_b[:, g * rank:(g + 1) * rank].T for g in range(groups)]).contiguous()
        out[f"{param}.lora_A.weight"], out[f"{param}.lora_B.weight"] = a, b
    return out


def pack_step(step_dir: str | os.PathLike) -> bytes:
    """The step folder as one uncompressed tar (members relative to it, sorted: same bytes for same files)."""
    step_dir = Path(step_dir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(step_dir.rglob("*")):
            if path.is_file():
                info = tar.gettarinfo(str(path), arcname=str(path.relative_to(step_dir)))
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
    return buf.getvalue()


def restore_step(blob: bytes, checkpoint_root: str | os.PathLike, step: int) -> Path:
    """Write a published step folder to `<checkpoint_root>/global_step_<step>` (replacing a stale one) and mark it
    veRL's latest; written under a temp name and renamed, so a crash leaves either the old folder or the new."""
    root = Path(checkpoint_root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{STEP_PREFIX}{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(tmp, filter="data")
    if target.exists():
        stale = target.with_name(f".{target.name}.stale")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, target)
    from dsv4flash.atomic_io import write_bytes_atomic

    write_bytes_atomic(root / "latest_checkpointed_iteration.txt", str(step).encode())
    return target


def publish_step(store, policy: str, step_dir: str | os.PathLike, cfg, *, step: int,
                 scheduler: Mapping[str, Any], data_position: Mapping[str, Any],
                 rollouts: Iterable[Mapping[str, Any]] = (), extra: Mapping[str, Any] | None = None):
    """Publish veRL's step folder as `policy`'s new head (one atomic catalog commit), then its rollout records."""
    adapter, peft_config = step_adapter(step_dir, cfg)
    rollouts = list(rollouts)
    rev = store.publish(policy, adapter, step=step, trainer_state=pack_step(step_dir), scheduler=dict(scheduler),
                        data_position=dict(data_position), tags=[f"step-{step}"],
                        extra={"engine": "verl", "target_modules": sorted(peft_config.get("target_modules") or []),
                               "rollouts": len(rollouts), **dict(extra or {})})
    if rollouts:
        store.catalog.add_rollouts(policy, rev.id, rollouts)
    return rev


__all__ = ["ADAPTER_DIR", "pack_step", "publish_step", "restore_step", "step_adapter", "unpack_target_parameters"]
