"""`dsv4flash patches list|check|apply|status|base|index`: the upstream patch series and its runtime twins."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packaging.utils import canonicalize_name
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dsv4flash.patching import predicate, twins
from dsv4flash.patchseries import check as check_mod
from dsv4flash.patchseries import fetch, gitops, index, testrun
from dsv4flash.patchseries.series import UPSTREAM_FOLDERS, Problem, Series, SeriesError, load_series


def _console() -> Console:
    """Rich console; wide when not a terminal so piped tables are not folded."""
    return Console(width=None if sys.stdout.isatty() else 260, soft_wrap=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands and their options."""
    parser.add_argument("--patches-dir", type=Path, help="the series folder (default: ./patches of the checkout)")
    parser.add_argument("--twin-package", default=twins.TWIN_PACKAGE_ROOT,
                        help="package whose <integration>.patches modules hold the runtime twins")
    sub = parser.add_subparsers(dest="action", required=True)

    p = sub.add_parser("list", help="index of every Patch-Id: format-patch and runtime twin")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("check", help="fetch pinned releases; apply each patch alone and the whole series")
    p.add_argument("--upstream", action="append", default=[], metavar="FOLDER",
                   help="only this folder (megatron-lm, megatron-bridge, vllm, verl); repeatable")
    _fetch_options(p)
    p.add_argument("--run-tests", action="store_true", help="also run each patch's Tests (both forms)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON")

    p = sub.add_parser("apply", help="apply the series to DIR (git am in a checkout, git apply otherwise)")
    p.add_argument("dir", type=Path)
    p.add_argument("--target", required=True, metavar="FOLDER", help="series folder, e.g. megatron-lm")
    p.add_argument("--patch", action="append", default=[], metavar="PATCH_ID",
                   help="only this patch and its Depends-On; repeatable")
    p.add_argument("--strip", type=int, default=None,
                   help="leading path components to strip (default: 1, plus the repo prefix when DIR lacks it)")

    p = sub.add_parser("status", help="evaluate Remove-When against installed versions; flag obsolete patches")
    p.add_argument("--installed", action="append", default=[], metavar="DIST=VERSION",
                   help="pretend DIST has VERSION installed (repeatable)")
    p.add_argument("--probe", action="store_true", help="also run each twin's behavioural upstream probe")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("base", help="materialise a folder's pinned release as a git repository in DIR")
    p.add_argument("target", metavar="FOLDER")
    p.add_argument("dir", type=Path)
    _fetch_options(p)

    p = sub.add_parser("index", help="regenerate patches/README.md and patches/series.toml")
    p.add_argument("--check", action="store_true", help="only report whether they are stale (exit 1 if so)")


def _fetch_options(p: argparse.ArgumentParser) -> None:
    """Options that choose where pinned releases come from."""
    p.add_argument("--source", choices=fetch.SOURCES, default="index",
                   help="index (default): the package index; installed: rebuild a wheel base from the installed "
                        "distribution, verified against RECORD; auto: index, else installed")
    p.add_argument("--index-url", action="append", default=[], help="package index URL(s), first is primary")
    p.add_argument("--find-links", action="append", default=[], help="local folder(s) holding artifacts")
    p.add_argument("--no-index", action="store_true", help="only use --find-links")


def _opts(args: argparse.Namespace) -> fetch.FetchOptions:
    """FetchOptions from parsed arguments."""
    return fetch.FetchOptions(args.source, tuple(args.index_url), tuple(args.find_links), args.no_index)


def find_patches_dir(explicit: Path | None) -> Path:
    """--patches-dir, else `patches/` in the current directory or a parent, else next to the package."""
    if explicit is not None:
        if not explicit.is_dir():
            raise SeriesError(f"--patches-dir {explicit} is not a directory")
        return explicit.resolve()
    here = Path.cwd().resolve()
    for d in (here, *here.parents, Path(__file__).resolve().parents[2]):
        if any((d / "patches").glob("*/base.txt")):
            return d / "patches"
    raise SeriesError("no patches/ folder with */base.txt found; run inside the dsv4flash checkout or pass --patches-dir")


def _load(args: argparse.Namespace) -> tuple[Path, dict[str, Series]]:
    patches_dir = find_patches_dir(args.patches_dir)
    return patches_dir, load_series(patches_dir)


def _print_problems(console: Console, problems: list[Problem]) -> None:
    for prob in problems:
        style = "red" if prob.severity == "error" else "yellow"
        # Messages quote test ids such as `test_x[series]`: escaped, or rich would take them for markup.
        console.print(f"[{style}]{prob.severity}[/{style}] {escape(prob.where)}: {escape(prob.message)}",
                      markup=True, highlight=False)


def cmd_list(args: argparse.Namespace) -> int:
    """Print one row per Patch-Id covering both forms."""
    _, series_map = _load(args)
    registry = twins.discover(args.twin_package)
    rows: dict[str, dict] = {}
    for name, s in series_map.items():
        for p in s.patches:
            rows[p.patch_id] = {
                "patch_id": p.patch_id, "folder": name, "target": p.one("Target"), "file": p.name,
                "subject": p.subject, "status": p.one("Upstream-Status"), "remove_when": p.one("Remove-When"),
                "runtime_twin": None, "tests": list(p.many("Tests")), "depends_on": list(p.depends_on),
            }
    for twin in registry.all():
        row = rows.setdefault(twin.meta.patch_id, {
            "patch_id": twin.meta.patch_id, "folder": None, "target": twin.meta.target, "file": None,
            "subject": twin.meta.summary, "status": twin.meta.upstream_status,
            "remove_when": twin.meta.remove_when, "tests": list(twin.meta.tests),
            "depends_on": list(twin.meta.depends_on)})
        row["runtime_twin"] = twin.meta.module
        row["gate"] = twin.meta.gate
    for row in rows.values():
        row["forms"] = "both" if row["file"] and row["runtime_twin"] else (
            "format-patch only" if row["file"] else "runtime twin only")
    if args.json:
        print(json.dumps(list(rows.values()), indent=2))
        return 0
    table = Table(title="dsv4flash upstream patches", show_lines=False)
    for col in ("Patch-Id", "Target", "Subject", "Status", "Remove-When", "Runtime twin", "Tests", "Forms"):
        table.add_column(col, overflow="fold")
    for row in rows.values():
        cells = (row["patch_id"], row["target"], row["subject"], row["status"], row["remove_when"],
                 row["runtime_twin"] or "MISSING", ", ".join(row["tests"]), row["forms"])
        table.add_row(*(Text(c) for c in cells))
    console = _console()
    console.print(table)
    if not rows:
        console.print("no patches")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """The CI gate: metadata, both forms present, generated index fresh, patches apply alone and in series."""
    console = _console()
    patches_dir, series_map = _load(args)
    registry = twins.discover(args.twin_package)
    # The project's own series must have all four upstream folders; an explicit --patches-dir may hold any.
    required = UPSTREAM_FOLDERS if args.patches_dir is None else ()
    report = check_mod.run_check(series_map, patches_dir.parent, registry, _opts(args), tuple(args.upstream),
                                 required_folders=required,
                                 log=lambda line: console.print(line, highlight=False, markup=False))
    for path in index.stale_files(patches_dir, series_map):
        report.problems.append(Problem(str(path), "generated file is stale; run `dsv4flash patches index`"))
    if args.run_tests:
        chosen = {n: s for n, s in series_map.items() if not args.upstream or n in args.upstream}
        files = {t for s in chosen.values() for p in s.patches for t in p.many("Tests")}
        console.print(f"running {len(files)} test file(s) for both forms", highlight=False)
        report.problems += testrun.check_tests(chosen, patches_dir.parent, args.twin_package)
    _print_problems(console, report.problems)
    if args.json:
        args.json.write_text(json.dumps({
            "ok": report.ok, "origins": report.origins,
            "patches": [vars(o) for o in report.outcomes],
            "problems": [vars(p) for p in report.problems]}, indent=2))
    errors = sum(p.severity == "error" for p in report.problems)
    console.print(f"{'OK' if report.ok else 'FAILED'}: {len(report.outcomes)} patch(es) checked, {errors} error(s)",
                  highlight=False)
    return 0 if report.ok else 1


def cmd_apply(args: argparse.Namespace) -> int:
    """Apply the chosen folder's series (or some patches plus their dependencies) to a directory."""
    _, series_map = _load(args)
    if args.target not in series_map:
        raise SeriesError(f"--target {args.target}: no such folder (have {', '.join(series_map)})")
    series = series_map[args.target]
    patches = series.patches
    if args.patch:
        by_id = series.by_id()
        missing = [p for p in args.patch if p not in by_id]
        if missing:
            raise SeriesError(f"{', '.join(missing)} not in patches/{args.target}")
        wanted = {q.patch_id for pid in args.patch for q in series.closure(by_id[pid])}
        patches = [p for p in series.patches if p.patch_id in wanted]
    if not args.dir.is_dir():
        raise SeriesError(f"{args.dir} is not a directory")
    strip = args.strip
    prefix = series.base.repo_prefix
    if strip is None:
        strip = 1 + (prefix.count("/") if prefix and not (args.dir / prefix).is_dir() else 0)
    for line in gitops.apply_to_directory(args.dir, [p.path for p in patches], strip=strip):
        print(line)
    print(f"{len(patches)} patch(es) from patches/{args.target} applied to {args.dir}")
    return 0


def _parse_installed(values: list[str]) -> dict[str, str]:
    out = {}
    for item in values:
        dist, sep, version = item.partition("=")
        if not sep or not dist or not version:
            raise SeriesError(f"--installed {item!r}: expected DIST=VERSION, e.g. megatron-core=0.20.0")
        out[dist.strip()] = version.strip()
    return out


def cmd_status(args: argparse.Namespace) -> int:
    """Evaluate each Remove-When; exit 1 if any patch is obsolete (its removal condition holds)."""
    _, series_map = _load(args)
    registry = twins.discover(args.twin_package)
    overrides = _parse_installed(args.installed)
    rows = []
    entries = {p.patch_id: (p.one("Remove-When"), s.base.distribution) for s in series_map.values() for p in s.patches}
    for twin in registry.all():
        entries.setdefault(twin.meta.patch_id, (twin.meta.remove_when, twin.meta.distribution))
    for pid, (remove_when, _dist) in entries.items():
        pred = predicate.parse(remove_when)
        versions = predicate.installed_versions(pred.distributions)
        versions.update({canonicalize_name(k): v for k, v in overrides.items()})
        row = {"patch_id": pid, "remove_when": remove_when,
               "installed": {d: versions.get(canonicalize_name(d)) for d in pred.distributions},
               "obsolete": pred.evaluate(versions), "upstream_has_it": None}
        if args.probe and pid in registry and not overrides:
            try:
                row["upstream_has_it"] = registry.get(pid).upstream_has_it()
            except Exception as exc:  # a probe that cannot run says so in its row; the table still prints
                row["probe_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if row["upstream_has_it"]:
                row["obsolete"] = True
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        table = Table(title="Remove-When against installed versions")
        for col in ("Patch-Id", "Remove-When", "Installed", "Probe", "Status"):
            table.add_column(col, overflow="fold")
        for r in rows:
            installed = ", ".join(f"{d} {v or 'not installed'}" for d, v in r["installed"].items())
            probe = {None: "–", True: "fixed upstream", False: "still needed"}[r["upstream_has_it"]]
            if "probe_error" in r:
                probe = f"probe failed: {r['probe_error']}"
            status = {True: "OBSOLETE: remove both forms", False: "needed", None: "unknown"}[r["obsolete"]]
            table.add_row(*(Text(c) for c in (r["patch_id"], r["remove_when"], installed, probe, status)))
        _console().print(table)
    return 1 if any(r["obsolete"] for r in rows) else 0


def cmd_base(args: argparse.Namespace) -> int:
    """Write the pinned release of one folder as a git repository (base commit) for editing patches."""
    _, series_map = _load(args)
    if args.target not in series_map:
        raise SeriesError(f"no such folder {args.target} (have {', '.join(series_map)})")
    series = series_map[args.target]
    if args.dir.exists() and any(args.dir.iterdir()):
        raise SeriesError(f"{args.dir} exists and is not empty")
    release = fetch.fetch_release(series.base, _opts(args))
    prefix = series.base.repo_prefix
    files = {prefix + rel: release.tree / rel for rel in release.files()}
    sha = gitops.init_repo(args.dir, files, f"{series.base.label} ({series.base.artifact})")
    print(f"{args.dir}: {series.base.label} from {release.origin}, base commit {sha}")
    print(f"next: dsv4flash patches apply {args.dir} --target {args.target}; edit, commit, then "
          f"git format-patch --zero-commit --no-signature -N -o patches/{args.target} {sha}..HEAD")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    """Regenerate (or with --check, verify) patches/README.md and patches/series.toml."""
    patches_dir, series_map = _load(args)
    if args.check:
        stale = index.stale_files(patches_dir, series_map)
        for path in stale:
            print(f"stale: {path} (run `dsv4flash patches index`)")
        return 1 if stale else 0
    written = index.write_index(patches_dir, series_map)
    print("\n".join(f"wrote {p}" for p in written) or "index up to date")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch; errors about the series or fetching print one clear line and exit 1."""
    handler = {"list": cmd_list, "check": cmd_check, "apply": cmd_apply, "status": cmd_status,
               "base": cmd_base, "index": cmd_index}[args.action]
    try:
        return handler(args)
    except (SeriesError, fetch.FetchError, gitops.GitError, predicate.PredicateError,
            twins.UnknownPatch) as exc:
        print(f"dsv4flash patches {args.action}: {exc}", file=sys.stderr)
        return 1
