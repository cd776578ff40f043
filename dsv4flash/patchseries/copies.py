"""A patched copy of an upstream package on a temporary path: the pinned release with format-patches applied.

This is the "upstream form" that a runtime twin's tests also run against: put `PatchedCopy.sys_path` first
on `sys.path` (or `PYTHONPATH` of a subprocess) and the upstream import resolves to the patched files.
Copies are cached under `<cache>/patched/<key>`, keyed by the release sha256 and the exact patch bytes.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from dsv4flash.patchseries import fetch, gitops
from dsv4flash.patchseries.series import PatchFile, Series


@dataclass(frozen=True)
class PatchedCopy:
    """Where the patched package tree is and what went into it."""

    root: Path
    sys_path: Path
    patch_ids: tuple[str, ...]
    origin: str

    def owns(self, module_file: str | None) -> bool:
        """Whether an imported module's `__file__` lies inside this copy."""
        return module_file is not None and Path(module_file).resolve().is_relative_to(self.root.resolve())


def patched_copy(series: Series, patch_ids: tuple[str, ...], opts: fetch.FetchOptions = fetch.FetchOptions()) -> PatchedCopy:
    """Pinned release of `series` with the given patches (plus their Depends-On) applied, in series order."""
    by_id = series.by_id()
    unknown = [pid for pid in patch_ids if pid not in by_id]
    if unknown:
        raise KeyError(f"{', '.join(unknown)} not in patches/{series.folder} (has {', '.join(by_id) or 'none'})")
    chosen: dict[str, None] = {}
    for pid in patch_ids:
        for p in series.closure(by_id[pid]):
            chosen.setdefault(p.patch_id, None)
    patches = [p for p in series.patches if p.patch_id in chosen]
    release = fetch.fetch_release(series.base, opts)
    key = hashlib.sha256(series.base.sha256.encode())
    key.update(release.origin.split(" ")[0].encode())
    for p in patches:
        key.update(p.path.read_bytes())
    final = fetch.cache_root() / "patched" / f"{series.folder}-{series.base.version}-{key.hexdigest()[:16]}"
    prefix = series.base.repo_prefix

    def build(out: Path) -> None:
        shutil.copytree(release.tree, out / prefix if prefix else out, dirs_exist_ok=True)
        gitops.apply_to_directory(out, [p.path for p in patches])

    root = fetch.materialise(final, build)
    return PatchedCopy(root, root / prefix if prefix else root, tuple(p.patch_id for p in patches), release.origin)


def upstream_dependency_copies(series_map: dict[str, Series], patch: PatchFile,
                               opts: fetch.FetchOptions = fetch.FetchOptions()) -> list[PatchedCopy]:
    """Patched copies of the other upstreams `patch` builds on (`Depends-On: <folder>/<Patch-Id>`), one per folder,
    each with its series applied up to the named patches (their Depends-On included). The cross-upstream
    Depends-On of the patch's own Depends-On count too: their code runs in the same copy."""
    own = series_map.get(patch.folder)
    wanted: dict[str, list[str]] = {}
    for needed in own.closure(patch) if own is not None else (patch,):
        for folder, pid in needed.upstream_depends_on:
            if folder not in series_map:
                raise KeyError(f"{needed.folder}/{needed.name}: Depends-On {folder}/{pid} names no loaded upstream "
                               "folder")
            if pid not in wanted.setdefault(folder, []):
                wanted[folder].append(pid)
    return [patched_copy(series_map[folder], tuple(ids), opts) for folder, ids in wanted.items()]
