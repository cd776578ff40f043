"""`dsv4flash patches check`: metadata, both forms, and each patch alone and as a series on the pinned release.

For every upstream folder with patches: fetch the pinned release (see `fetch`), build a scratch git
repository of the files the series touches at their upstream repo paths, then apply each patch alone on
the base (after its Depends-On) and finally the whole series, with `git am` (falling back to `--3way`).
Fails on a patch that does not apply, on leftover conflict markers, on touched Python files that do not
byte-compile, on a `Touches` symbol missing from the patched file, and on every metadata problem from
`series.validate` / `series.twin_problems` (missing trailers, runtime twin or tests).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dsv4flash.patchseries import fetch, gitops
from dsv4flash.patchseries.series import Problem, Series, touched_file, twin_problems, validate


@dataclass
class PatchOutcome:
    """How one patch fared: alone (with its dependencies) and inside the whole series."""

    folder: str
    patch_id: str
    file: str
    alone: str = "not run"
    in_series: str = "not run"


@dataclass
class CheckReport:
    """Everything `check` found; `ok` is False when any error-level problem exists."""

    problems: list[Problem] = field(default_factory=list)
    outcomes: list[PatchOutcome] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No error-level problems."""
        return not any(p.severity == "error" for p in self.problems)


def _verify_tree(repo: Path, series: Series, patches: list, where: str) -> list[Problem]:
    """Conflict markers, byte-compilation and Touches symbols in the files these patches changed."""
    out: list[Problem] = []
    files = sorted({f for p in patches for f in p.files})
    for hit in gitops.conflict_markers(repo, files):
        out.append(Problem(where, f"conflict marker left at {hit}"))
    for err in gitops.compile_errors(repo, files):
        out.append(Problem(where, f"does not byte-compile: {err}"))
    for patch in patches:
        for sym in patch.many("Touches"):
            rel = touched_file(sym, patch.files, series.base.repo_prefix)
            if rel is None or not rel.endswith(".py") or not (repo / rel).is_file():
                continue
            module = rel[len(series.base.repo_prefix):].removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            attrs = sym[len(module) + 1:].split(".") if sym != module else []
            try:
                if attrs and not gitops.symbol_defined(repo / rel, attrs):
                    out.append(Problem(where, f"Touches {sym}: not defined in patched {rel}"))
            except SyntaxError:
                pass  # already reported by compile_errors
    return out


def check_series(series: Series, opts: fetch.FetchOptions, report: CheckReport, log: Callable[[str], None]) -> None:
    """Apply each patch of one folder alone and then all together on its pinned release."""
    release = fetch.fetch_release(series.base, opts)
    report.origins[series.folder] = release.origin
    for note in release.notes:
        report.problems.append(Problem(series.folder, note, "warning"))
    log(f"{series.folder}: {series.base.label} from {release.origin}")
    prefix = series.base.repo_prefix
    touched = sorted({f for p in series.patches for f in p.files})
    files = {}
    for rel in touched:
        src = release.tree / rel[len(prefix):] if rel.startswith(prefix) else None
        if src is not None and src.is_file():
            files[rel] = src
    outcomes = {p.patch_id: PatchOutcome(series.folder, p.patch_id, p.name) for p in series.patches}
    report.outcomes += outcomes.values()
    with tempfile.TemporaryDirectory(prefix=f"dsv4flash-check-{series.folder}-") as tmp:
        repo = Path(tmp) / "repo"
        base_sha = gitops.init_repo(repo, files, f"{series.base.label} ({series.base.artifact})")
        for patch in series.patches:
            where = f"{series.folder}/{patch.name}"
            gitops.reset_to(repo, base_sha)
            chain = series.closure(patch)
            for step in chain:
                result = gitops.am(repo, step.path)
                if not result.ok:
                    what = "it" if step is patch else f"its dependency {step.name}"
                    report.problems.append(Problem(where, f"{what} does not apply alone to {series.base.label}:\n"
                                                          f"{result.output}"))
                    outcomes[patch.patch_id].alone = "failed"
                    break
                if result.mode == "already-applied":
                    report.problems.append(Problem(where, f"{step.name} changes nothing on {series.base.label}: "
                                                          "its change is already in the base (obsolete?)"))
                if step is patch:
                    outcomes[patch.patch_id].alone = result.mode
                    if result.mode == "3way":
                        report.problems.append(Problem(where, "applies only with a 3-way merge; refresh it", "warning"))
            else:
                report.problems += _verify_tree(repo, series, chain, where)
            log(f"  {patch.name}: alone {outcomes[patch.patch_id].alone}")
        gitops.reset_to(repo, base_sha)
        applied = []
        for patch in series.patches:
            result = gitops.am(repo, patch.path)
            outcomes[patch.patch_id].in_series = result.mode
            if not result.ok:
                report.problems.append(Problem(f"{series.folder}/{patch.name}",
                                               f"does not apply in the series after {len(applied)} patch(es):\n"
                                               f"{result.output}"))
                break
            applied.append(patch)
        else:
            report.problems += _verify_tree(repo, series, applied, f"{series.folder} (whole series)")
        log(f"  whole series: {len(applied)}/{len(series.patches)} applied")


def run_check(
    series_map: dict[str, Series],
    project_root: Path,
    registry,
    opts: fetch.FetchOptions,
    folders: tuple[str, ...] = (),
    required_folders: tuple[str, ...] | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> CheckReport:
    """The full check over the selected folders (all with patches when `folders` is empty)."""
    report = CheckReport()
    kwargs = {} if required_folders is None else {"required_folders": required_folders}
    if folders:  # only the chosen folders' metadata, and the twins of their distributions
        chosen = {n: s for n, s in series_map.items() if n in folders}
        report.problems += validate(chosen, project_root, required_folders=(), every_series=series_map)
    else:
        report.problems += validate(series_map, project_root, **kwargs)
    report.problems += twin_problems(series_map, registry, folders)
    for name, series in series_map.items():
        if folders and name not in folders:
            continue
        if not series.patches:
            log(f"{name}: no patches against {series.base.label}")
            continue
        try:
            check_series(series, opts, report, log)
        except (fetch.FetchError, gitops.GitError) as exc:
            report.problems.append(Problem(name, str(exc)))
    unknown = [f for f in folders if f not in series_map]
    if unknown:
        report.problems.append(Problem("patches", f"no such upstream folder(s): {', '.join(unknown)}"))
    return report
