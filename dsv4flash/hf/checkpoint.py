"""Checkpoint directories for `DeepseekV41ForCausalLM.from_pretrained` / `save_pretrained`, through the bridge.

Three layouts load (detected from the tensor names and files, never guessed from the config):

- **release**: FP8 / MXFP4 / Engram weights with their E8M0 `.scale` tensors. Decoded by the bridge's
  streaming `import_release` (release naming) into a temporary import next to nothing the user owns, whose
  weights are copied into the model in row chunks; its `release/` sidecar (recorded shard headers, index,
  config.json and scales) is kept with the model.
- **import**: the output of `dsv4flash convert import --naming release` (BF16/FP32, `release/` sidecar).
- **base**: what `python -m dsv4flash.train` caches (`dsv4flash.engine.model_io.save_base`): fp32
  `model.safetensors` in release names, config.json (it keeps `quantization_config`), tokenizer, base.json.

Every parameter must be present with its exact shape and nothing else may be there (errors name the tensor).
A model that came with a sidecar saves through `export_release`: re-encoded with the recorded scales, so
unchanged weights give the source's bytes. Any other model saves as a base directory (fp32, release names).
Both writes are all-or-nothing (staging directory, then rename) and keep the other files of an existing
target directory (tokenizer, generation config).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from torch import nn

from dsv4flash.atomic_io import publish_directory

__all__ = ["CheckpointLayoutError", "detect_layout", "load_checkpoint", "save_checkpoint"]

_CHUNK_BYTES = 64 << 20
# Not carried over from an existing target: the weights themselves, and base.json (its digest is of the old weights).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "base.json")


class CheckpointLayoutError(ValueError):
    """A directory whose tensors do not fit the model (names the file and tensor)."""


def detect_layout(directory: Path) -> str:
    """'release' (quantized tensors present), 'import' (bridge sidecar present) or 'base'."""
    from dsv4flash_bridge.convert_common import LAYOUT_FILE, SIDECAR
    from dsv4flash_bridge.sharded import CheckpointReader

    with CheckpointReader(directory) as ckpt:
        names = set(ckpt.names())
    # a quantized weight's block scale sits beside its weight; a module's own `scale` parameter (megatron's mHC
    # `mlp_hyper_connection.scale` in a megatron-named import) has no `.weight` sibling
    if any(name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names for name in names):
        return "release"
    return "import" if (directory / SIDECAR / LAYOUT_FILE).is_file() else "base"


def load_checkpoint(model: nn.Module, directory: Path, *, progress: bool = False,
                    staging_dir: str | Path | None = None, layout: str | None = None) -> Path | None:
    """Fill `model`'s parameters from `directory`; returns the bridge sidecar to export with (or None).
    A release directory is decoded under `staging_dir` (default: the system temp dir; needs the decoded size)."""
    import json

    from dsv4flash_bridge.convert import import_release
    from dsv4flash_bridge.convert_common import LAYOUT_FILE, SIDECAR

    layout = layout or detect_layout(directory)
    if layout == "base":
        _copy_tensors(model, directory)
        return None
    if layout == "import":
        naming = json.loads((directory / SIDECAR / LAYOUT_FILE).read_text(encoding="utf-8")).get("naming", "release")
        if naming != "release":
            raise CheckpointLayoutError(f"{directory}: imported with --naming {naming}; from_pretrained reads "
                                        "release-named imports (`dsv4flash convert import --naming release`) or the "
                                        "release directory itself")
        _copy_tensors(model, directory)
        return _keep(model, directory / SIDECAR)
    dtype = torch.float32 if next(model.parameters()).dtype == torch.float32 else torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="dsv4flash-import-", dir=staging_dir) as tmp:
        imported = Path(tmp) / "import"
        import_release(directory, imported, dtype=dtype, naming="release", progress=progress)
        _copy_tensors(model, imported)
        return _keep(model, imported / SIDECAR)


def _keep(model: nn.Module, sidecar: Path) -> Path:
    """A private copy of the sidecar that lives as long as the model (deleted with it)."""
    home = Path(tempfile.mkdtemp(prefix="dsv4flash-release-layout-"))
    shutil.copytree(sidecar, home / "release")
    weakref.finalize(model, shutil.rmtree, home, True)
    return home / "release"


def _copy_tensors(model: nn.Module, directory: Path) -> None:
    """Copy every tensor of a release-named checkpoint into the same-named parameter, row chunk by row chunk."""
    from dsv4flash_bridge.sharded import CheckpointReader

    params = dict(model.named_parameters())
    with CheckpointReader(directory) as ckpt:
        names = set(ckpt.names())
        missing, extra = sorted(set(params) - names), sorted(names - set(params))
        if missing:
            raise CheckpointLayoutError(f"{directory}: tensor {missing[0]} is missing ({len(missing)} missing); "
                                        "expected every parameter of the config's model")
        if extra:
            raise CheckpointLayoutError(f"{directory}: tensor {extra[0]} is not a parameter of this model "
                                        f"({len(extra)} unexpected)")
        with torch.no_grad():
            for name, param in params.items():
                info = ckpt.info(name)
                if tuple(info.shape) != tuple(param.shape):
                    raise CheckpointLayoutError(f"{directory}: tensor {name} has shape {list(info.shape)}, the "
                                                f"model expects {list(param.shape)}")
                if not info.shape:
                    param.copy_(ckpt.read(name))
                    continue
                step = max(1, _CHUNK_BYTES // max(info.row_bytes, 1))
                for r0 in range(0, info.rows, step):
                    r1 = min(info.rows, r0 + step)
                    param[r0:r1].copy_(ckpt.read_rows(name, r0, r1))


def _write_tensors(model: nn.Module, directory: Path, max_shard_bytes: int) -> None:
    """The model's parameters as a sharded safetensors checkpoint (release names, stored dtype = param dtype)."""
    from dsv4flash_bridge.safetensors_io import SafetensorsWriter, TensorSpec, all_or_nothing, dtype_name, library_order
    from dsv4flash_bridge.sharded import SINGLE_FILE, write_index

    params = dict(model.named_parameters())
    groups: list[list[str]] = [[]]
    size = 0
    for name, p in params.items():
        nbytes = p.numel() * p.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    files = [SINGLE_FILE] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    writers = {f: SafetensorsWriter(directory / f, library_order(
        [TensorSpec(n, dtype_name(params[n].dtype), tuple(params[n].shape)) for n in group]), {"format": "pt"})
        for f, group in zip(files, groups)}
    with all_or_nothing(writers), torch.no_grad():
        for f, group in zip(files, groups):
            for name in group:
                writers[f].write_rows(name, params[name].detach().cpu().contiguous())
    if len(groups) > 1:
        write_index(directory, {n: f for f, group in zip(files, groups) for n in group},
                    sum(p.numel() * p.element_size() for p in params.values()))


def _keep_other_files(target: Path, staging: Path) -> None:
    """Copy the non-weight top-level files of an existing target (tokenizer, ...) into the staging dir."""
    if not target.is_dir():
        return
    for path in target.iterdir():
        if path.is_file() and path.name not in _WEIGHT_FILES and not path.name.endswith(".safetensors") \
                and not (staging / path.name).exists():
            shutil.copy2(path, staging / path.name)


def _shard_bytes(max_shard_size: int | str) -> int:
    """'5GB' / '500MB' / an int -> bytes."""
    if isinstance(max_shard_size, int):
        return max_shard_size
    text = max_shard_size.strip().upper()
    for unit, factor in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10**9), ("MB", 10**6),
                         ("KB", 10**3), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"max_shard_size: cannot read {max_shard_size!r} (expected e.g. '5GB' or a byte count)")


def save_checkpoint(model: nn.Module, target: Path, *, max_shard_size: int | str = "5GB",
                    progress: bool = False) -> None:
    """Release layout through `export_release` when the model has a sidecar, else a base directory."""
    from dsv4flash_bridge.convert import export_release
    from dsv4flash_bridge.convert_common import LAYOUT_FILE, SIDECAR

    shard_bytes = _shard_bytes(max_shard_size)
    sidecar = getattr(model, "release_layout", None)
    if sidecar is None:
        def write(tmp: Path) -> None:
            _write_tensors(model, tmp, shard_bytes)
            (tmp / "config.json").write_text(model.config.to_json_string(), encoding="utf-8")
            _keep_other_files(target, tmp)

        publish_directory(target, write, overwrite=True, what="save_pretrained")
        return
    if not (Path(sidecar) / LAYOUT_FILE).is_file():
        raise CheckpointLayoutError(f"{sidecar}: the release layout recorded at load is gone (it lives as long as "
                                    "the model it was loaded with); load the model again to save the release layout")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.staging-", dir=target.parent) as tmp:
        staging = Path(tmp)
        _write_tensors(model, staging, shard_bytes)
        shutil.copytree(sidecar, staging / SIDECAR)
        _keep_other_files(target, staging)
        export_release(staging, target, overwrite=True, progress=progress)
