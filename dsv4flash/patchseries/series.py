"""The on-disk patch series: `patches/<upstream>/base.txt` and `NNNN-<slug>.patch` files with git trailers.

The trailers are the source of truth (docs/patches.md). This module parses them and validates everything that
can be checked without fetching the upstream release: required keys, vocabularies, dependency order,
Remove-When syntax, test files, and agreement with the runtime twin of the same Patch-Id.
"""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from dsv4flash.patching import predicate

UPSTREAM_FOLDERS = ("megatron-lm", "megatron-bridge", "vllm", "verl")
REQUIRED_TRAILERS = (
    "Patch-Id", "Target", "Base", "Touches", "Upstream-Status", "Forwarded", "Runtime-Equivalent",
    "Gate", "Depends-On", "Remove-When", "Tests", "Last-Update",
)
LIST_TRAILERS = ("Touches", "Tests", "Depends-On")
PATCH_ID_RE = re.compile(r"^[A-Z][A-Z0-9]*(-[A-Z0-9]+)+$")
STATUS_RE = re.compile(
    r"^(?P<word>Pending|Backport|Accepted|Inactive-Upstream|Submitted|Denied|Inappropriate)(\s+\[(?P<note>[^\]]+)\])?$"
)
STATUS_NEEDS_NOTE = ("Submitted", "Accepted", "Denied", "Inappropriate")
FORWARDED_RE = re.compile(r"^(no|not-needed|https?://\S+)$")
PATCH_NAME_RE = re.compile(r"^(?P<num>\d{4})-[a-z0-9][a-z0-9._-]*\.patch$")
TRAILER_LINE_RE = re.compile(r"^(?P<key>[A-Za-z0-9][A-Za-z0-9-]*):\s*(?P<value>.*)$")
# An added line that makes upstream code depend on this project (plain, from- and importlib imports).
PROJECT_IMPORT_RE = re.compile(
    r"^\s*(?:import\s+dsv4flash\w*|from\s+dsv4flash\w*(?:\.[\w.]+)?\s+import\b|.*\bimport_module\(\s*['\"]dsv4flash)"
)
# Bytecode a scratch tree writes when it is imported; upstream patches carry source only.
COMPILED_PATH_RE = re.compile(r"(^|/)__pycache__/|\.py[cod]$")
DIFF_HEADER_RE = re.compile(r"^diff --git a/(?P<old>.+) b/(?P<new>.+)$", re.M)
BINARY_HUNK_RE = re.compile(r"^(GIT binary patch|Binary files .* differ)$", re.M)
BOTH_FORMS_RE = re.compile(r"^PATCH_ID\s*=\s*['\"](?P<id>[^'\"]+)['\"]", re.M)


class SeriesError(ValueError):
    """A patch folder that cannot be read at all (bad base.txt, unparseable patch file)."""


@dataclass(frozen=True)
class Problem:
    """One finding of a check: `where` is a file (or Patch-Id), `message` says what is wrong and expected."""

    where: str
    message: str
    severity: str = "error"

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.message}"


@dataclass(frozen=True)
class Required:
    """One change a folder's series must hold (`[[required]]` in base.txt): its Patch-Id and concern."""

    patch_id: str
    concern: str


@dataclass(frozen=True)
class Base:
    """`base.txt`: the pinned upstream release a folder's patches are made against."""

    folder: str
    path: Path
    target: str
    distribution: str
    version: str
    artifact: str
    sha256: str
    packages: tuple[str, ...]
    repo_prefix: str = ""
    git: str = ""
    required: tuple[Required, ...] = ()

    @property
    def is_wheel(self) -> bool:
        """Whether the pinned artifact is a wheel (else an sdist with one top-level folder)."""
        return self.artifact.endswith(".whl")

    @property
    def label(self) -> str:
        """`distribution version`, the prefix every `Base:` trailer of this folder starts with."""
        return f"{self.distribution} {self.version}"


def load_base(folder: Path) -> Base:
    """Parse `folder/base.txt` (TOML), naming the file and key on any error."""
    path = folder / "base.txt"
    if not path.is_file():
        raise SeriesError(f"{path}: missing; every patch folder pins its upstream release there")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SeriesError(f"{path}: not valid TOML ({exc})") from exc
    required = ("target", "distribution", "version", "artifact", "sha256", "packages")
    missing = [k for k in required if k not in data]
    if missing:
        raise SeriesError(f"{path}: missing key(s) {', '.join(missing)}; expected {', '.join(required)}")
    if not re.fullmatch(r"[0-9a-f]{64}", str(data["sha256"])):
        raise SeriesError(f"{path}: sha256 must be 64 lowercase hex digits, got {data['sha256']!r}")
    if not isinstance(data["packages"], list) or not data["packages"]:
        raise SeriesError(f"{path}: packages must be a non-empty list of package paths inside the artifact")
    Version(str(data["version"]))
    prefix = str(data.get("repo_prefix", ""))
    if prefix and not prefix.endswith("/"):
        raise SeriesError(f"{path}: repo_prefix must end with '/', got {prefix!r}")
    return Base(
        folder=folder.name, path=path, target=str(data["target"]), distribution=str(data["distribution"]),
        version=str(data["version"]), artifact=str(data["artifact"]), sha256=str(data["sha256"]),
        packages=tuple(str(p).strip("/") for p in data["packages"]), repo_prefix=prefix,
        git=str(data.get("git", "")), required=_load_required(path, data.get("required", [])),
    )


def _load_required(path: Path, entries) -> tuple[Required, ...]:
    """`[[required]]` tables (`id`, `concern`): the changes the series must contain, in order."""
    if not isinstance(entries, list):
        raise SeriesError(f"{path}: required must be an array of tables ([[required]] with id and concern)")
    out: list[Required] = []
    for n, entry in enumerate(entries, 1):
        if not isinstance(entry, dict) or not entry.get("id") or not entry.get("concern"):
            raise SeriesError(f"{path}: [[required]] entry {n} needs a non-empty id and concern, got {entry!r}")
        if not PATCH_ID_RE.match(str(entry["id"])):
            raise SeriesError(f"{path}: [[required]] entry {n}: id {entry['id']!r} must look like DSV41-MCORE-001")
        if any(r.patch_id == entry["id"] for r in out):
            raise SeriesError(f"{path}: [[required]] lists {entry['id']} twice")
        out.append(Required(str(entry["id"]), " ".join(str(entry["concern"]).split())))
    return tuple(out)


@dataclass
class PatchFile:
    """One `git format-patch` file: headers, message, trailers and the diff."""

    path: Path
    folder: str
    subject: str
    author: str
    date: str
    message: str
    trailers: dict[str, list[str]]
    files: tuple[str, ...]
    diff: str
    parse_problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """File name, e.g. `0001-fix-moe-....patch`."""
        return self.path.name

    def one(self, key: str) -> str:
        """The single value of a trailer ('' if absent)."""
        values = self.trailers.get(key, [])
        return values[0] if values else ""

    def many(self, key: str) -> tuple[str, ...]:
        """A list trailer: repeated keys and comma-separated values, with `none` meaning empty."""
        items: list[str] = []
        for value in self.trailers.get(key, []):
            items += [v.strip() for v in value.split(",") if v.strip()]
        return tuple(i for i in items if i.lower() != "none")

    @property
    def patch_id(self) -> str:
        """The stable Patch-Id (or the file name when the trailer is missing)."""
        return self.one("Patch-Id") or self.name

    @property
    def depends_on(self) -> tuple[str, ...]:
        """Depends-On as written: `Patch-Id` (this folder) or `<folder>/<Patch-Id>` (another upstream's series)."""
        return self.many("Depends-On")

    @property
    def local_depends_on(self) -> tuple[str, ...]:
        """Patch-Ids of this folder that must be applied first (a `<this folder>/` prefix is dropped)."""
        return tuple(pid for folder, pid in map(self._split_dependency, self.depends_on) if folder == self.folder)

    @property
    def upstream_depends_on(self) -> tuple[tuple[str, str], ...]:
        """(folder, Patch-Id) of each dependency in another upstream's series (its patched tree must be there too)."""
        return tuple((folder, pid) for folder, pid in map(self._split_dependency, self.depends_on)
                     if folder != self.folder)

    @property
    def depends_on_ids(self) -> tuple[str, ...]:
        """Every dependency's bare Patch-Id (Patch-Ids are unique across folders; twins name them this way)."""
        return tuple(pid for _, pid in map(self._split_dependency, self.depends_on))

    def _split_dependency(self, dep: str) -> tuple[str, str]:
        folder, _, pid = dep.rpartition("/")
        return folder or self.folder, pid


def _unfold(value: str) -> str:
    """RFC 2822 header unfolding."""
    return re.sub(r"\r?\n[ \t]+", " ", value).strip()


def _parse_trailers(message: str) -> tuple[dict[str, list[str]], list[str]]:
    """Trailers = the last paragraph of the message if every line is `Key: value` or a continuation."""
    paragraphs = [p for p in re.split(r"\n\s*\n", message.strip()) if p.strip()]
    if not paragraphs:
        return {}, ["commit message is empty"]
    trailers: dict[str, list[str]] = {}
    last_key = None
    for line in paragraphs[-1].splitlines():
        match = TRAILER_LINE_RE.match(line)
        if match:
            last_key = match.group("key")
            trailers.setdefault(last_key, []).append(match.group("value").strip())
        elif line[:1] in (" ", "\t") and last_key is not None:
            trailers[last_key][-1] = f"{trailers[last_key][-1]} {line.strip()}".strip()
        else:
            return {}, [f"the last paragraph of the message is not a trailer block (line {line!r})"]
    return trailers, []


def parse_patch(path: Path) -> PatchFile:
    """Parse a format-patch file; structural problems are kept in `parse_problems`, not raised."""
    text = path.read_text()
    problems: list[str] = []
    lines = text.split("\n")
    if not lines[0].startswith("From "):
        problems.append("not a git format-patch file (first line must be 'From <sha> ...')")
    headers: dict[str, str] = {}
    i, last = 1, None
    while i < len(lines) and lines[i] != "":
        if lines[i][:1] in (" ", "\t") and last:
            headers[last] += "\n" + lines[i]
        elif ":" in lines[i]:
            name, _, value = lines[i].partition(":")
            last = name.strip().lower()
            headers[last] = value.strip()
        i += 1
    try:
        sep = lines.index("---", i)
    except ValueError:
        sep = len(lines)
        problems.append("no '---' line separating the message from the diff")
    message = "\n".join(lines[i + 1 : sep])
    diff = "\n".join(lines[sep + 1 :])
    trailers, trailer_problems = _parse_trailers(message)
    problems += trailer_problems
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", _unfold(headers.get("subject", "")))
    if not subject:
        problems.append("no Subject header")
    files: list[str] = []
    for line in diff.splitlines():
        match = re.match(r"^(?:---|\+\+\+) (?:a|b)/(.+)$", line)
        if match and match.group(1) not in files:
            files.append(match.group(1))
    if not files:
        problems.append("the diff touches no files")
    return PatchFile(
        path=path, folder=path.parent.name, subject=subject, author=_unfold(headers.get("from", "")),
        date=_unfold(headers.get("date", "")), message=message, trailers=trailers, files=tuple(files),
        diff=diff, parse_problems=problems,
    )


@dataclass
class Series:
    """One upstream folder: its base and its patches in application order (file-name order)."""

    folder: str
    base: Base
    patches: list[PatchFile]

    def by_id(self) -> dict[str, PatchFile]:
        """Patch-Id -> PatchFile."""
        return {p.patch_id: p for p in self.patches}

    def closure(self, patch: PatchFile) -> list[PatchFile]:
        """`patch` preceded by its transitive Depends-On, in series order."""
        by_id, wanted, stack = self.by_id(), set(), [patch.patch_id]
        while stack:
            pid = stack.pop()
            if pid in wanted or pid not in by_id:
                continue
            wanted.add(pid)
            stack.extend(by_id[pid].local_depends_on)
        return [p for p in self.patches if p.patch_id in wanted]


def load_series(patches_dir: Path) -> dict[str, Series]:
    """Every upstream folder under `patches_dir` that has a base.txt, in UPSTREAM_FOLDERS order."""
    out: dict[str, Series] = {}
    folders = sorted(d for d in patches_dir.iterdir() if d.is_dir()) if patches_dir.is_dir() else []
    folders.sort(key=lambda d: (UPSTREAM_FOLDERS.index(d.name) if d.name in UPSTREAM_FOLDERS else 99, d.name))
    for folder in folders:
        if not (folder / "base.txt").exists() and not list(folder.glob("*.patch")):
            continue
        base = load_base(folder)
        patches = [parse_patch(p) for p in sorted(folder.glob("*.patch"))]
        out[folder.name] = Series(folder.name, base, patches)
    return out


def validate(
    series_map: dict[str, Series], project_root: Path, required_folders: tuple[str, ...] = UPSTREAM_FOLDERS,
    every_series: dict[str, Series] | None = None,
) -> list[Problem]:
    """Every metadata problem findable without the upstream source; empty list means clean.

    `every_series` (default `series_map`) is where `<folder>/<Patch-Id>` dependencies are looked up, so
    checking one folder still resolves the other upstreams it depends on.
    """
    problems: list[Problem] = []
    seen_ids: dict[str, str] = {}
    for name in required_folders:
        if name not in series_map:
            problems.append(Problem(f"patches/{name}", "folder or its base.txt is missing"))
    for series in series_map.values():
        problems += missing_required(series)
        for index, patch in enumerate(series.patches):
            problems += _validate_patch(series, index, patch, project_root)
            problems += upstream_dependency_problems(every_series or series_map, patch)
            where = f"{series.folder}/{patch.name}"
            if patch.patch_id in seen_ids:
                problems.append(Problem(where, f"Patch-Id {patch.patch_id} also used by {seen_ids[patch.patch_id]}"))
            seen_ids[patch.patch_id] = where
    return problems


def missing_required(series: Series) -> list[Problem]:
    """One error per `[[required]]` change of base.txt that no patch of the folder carries."""
    present = {p.patch_id for p in series.patches}
    return [Problem(f"patches/{series.folder}", f"required change {r.patch_id} ({r.concern}) has no patch; "
                                                f"base.txt lists it under [[required]]")
            for r in series.base.required if r.patch_id not in present]


def project_imports(patch: PatchFile) -> list[str]:
    """`file:line` of every line the diff adds that imports dsv4flash (upstream must never depend on us)."""
    hits, current, line_no = [], None, 0
    for line in patch.diff.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("@@"):
            match = re.match(r"^@@ -\d+(?:,\d+)? \+(\d+)", line)
            line_no = int(match.group(1)) if match else 0
        elif current is not None and line.startswith("+"):
            if PROJECT_IMPORT_RE.match(line[1:]):
                hits.append(f"{current}:{line_no}")
            line_no += 1
        elif current is not None and not line.startswith("-"):
            line_no += 1
    return hits


def compiled_or_binary(patch: PatchFile) -> list[tuple[str, str]]:
    """(path, kind) of every file the diff adds or modifies that is bytecode, under `__pycache__/`, or binary."""
    hits = []
    headers = list(DIFF_HEADER_RE.finditer(patch.diff))
    for n, header in enumerate(headers):
        end = headers[n + 1].start() if n + 1 < len(headers) else len(patch.diff)
        section = patch.diff[header.end():end]
        if re.search(r"^deleted file mode ", section, re.M):
            continue  # removing such a file is what a clean-up patch does
        path = header.group("new")
        if COMPILED_PATH_RE.search(path):
            hits.append((path, "compiled Python file"))
        elif BINARY_HUNK_RE.search(section):
            hits.append((path, "binary file"))
    return hits


def both_forms_tests(patch: PatchFile, root: Path) -> list[str]:
    """The patch's Tests files that declare its Patch-Id and use the `patch_form` harness (both forms)."""
    out = []
    for test in patch.many("Tests"):
        path = root / test.split("::")[0]
        if not path.is_file():
            continue
        text = path.read_text()
        ids = {m.group("id") for m in BOTH_FORMS_RE.finditer(text)}
        if patch.patch_id in ids and "patch_form" in text:
            out.append(test)
    return out


def _validate_patch(series: Series, index: int, patch: PatchFile, root: Path) -> list[Problem]:
    """Trailer-level validation of one patch (see module docstring)."""
    where = f"{series.folder}/{patch.name}"
    out = [Problem(where, msg) for msg in patch.parse_problems]
    if not PATCH_NAME_RE.match(patch.name):
        out.append(Problem(where, "file name must be NNNN-<lowercase-slug>.patch (git format-patch naming)"))
    missing = [k for k in REQUIRED_TRAILERS if not patch.one(k)]
    if missing:
        out.append(Problem(where, f"missing required trailer(s): {', '.join(missing)}"))
    for key, values in patch.trailers.items():
        if key in REQUIRED_TRAILERS and key not in LIST_TRAILERS and len(values) > 1:
            out.append(Problem(where, f"trailer {key} appears {len(values)} times; it takes one value"))
    pid = patch.one("Patch-Id")
    if pid and not PATCH_ID_RE.match(pid):
        out.append(Problem(where, f"Patch-Id {pid!r} must look like DSV41-MCORE-001 (upper-case, dash-separated)"))
    if patch.one("Target") and patch.one("Target") != series.base.target:
        out.append(Problem(where, f"Target {patch.one('Target')!r} differs from base.txt target {series.base.target!r}"))
    if patch.one("Base") and not patch.one("Base").startswith(series.base.label):
        out.append(Problem(where, f"Base {patch.one('Base')!r} must start with {series.base.label!r} (base.txt)"))
    status = patch.one("Upstream-Status")
    match = STATUS_RE.match(status) if status else None
    if status and not match:
        out.append(Problem(where, f"Upstream-Status {status!r} is not one of Pending | Submitted [url] | "
                                  "Accepted [version] | Backport [url] | Denied [reason] | Inappropriate [reason]"))
    elif match and match.group("word") in STATUS_NEEDS_NOTE and not match.group("note"):
        out.append(Problem(where, f"Upstream-Status {match.group('word')} needs a [where/why] note"))
    if patch.one("Forwarded") and not FORWARDED_RE.match(patch.one("Forwarded")):
        out.append(Problem(where, f"Forwarded {patch.one('Forwarded')!r} must be no, not-needed or a URL"))
    if patch.one("Remove-When"):
        try:
            predicate.parse(patch.one("Remove-When"))
        except predicate.PredicateError as exc:
            out.append(Problem(where, str(exc)))
    if patch.one("Last-Update"):
        try:
            dt.date.fromisoformat(patch.one("Last-Update"))
        except ValueError:
            out.append(Problem(where, f"Last-Update {patch.one('Last-Update')!r} must be YYYY-MM-DD"))
    earlier = {p.patch_id for p in series.patches[:index]}
    for dep in patch.local_depends_on:
        if dep not in earlier:
            out.append(Problem(where, f"Depends-On {dep} is not an earlier patch of {series.folder}"))
    if "Tests" in patch.trailers and not patch.many("Tests"):
        out.append(Problem(where, "Tests names no test file; every patch needs tests"))
    for test in patch.many("Tests"):
        if not (root / test.split("::")[0]).is_file():
            out.append(Problem(where, f"Tests file {test} does not exist under {root}"))
    existing = [t for t in patch.many("Tests") if (root / t.split("::")[0]).is_file()]
    if existing and not both_forms_tests(patch, root):
        out.append(Problem(where, f"no Tests file declares PATCH_ID = \"{patch.patch_id}\" with patch_form tests; "
                                  "every patch is tested in both forms (runtime twin and patched upstream)"))
    for hit in project_imports(patch):
        out.append(Problem(where, f"adds an import of dsv4flash at {hit}; an upstream patch must not depend on "
                                  "dsv4flash"))
    for path, kind in compiled_or_binary(patch):
        out.append(Problem(where, f"adds or modifies {kind} {path}; an upstream patch carries source only "
                                  "(rebuild it in a `dsv4flash patches base` tree, which ignores bytecode)"))
    for sym in patch.many("Touches"):
        if touched_file(sym, patch.files, series.base.repo_prefix) is None:
            out.append(Problem(where, f"Touches {sym} is not in any file the diff changes ({', '.join(patch.files)})"))
    return out


def upstream_dependency_problems(series_map: dict[str, Series], patch: PatchFile) -> list[Problem]:
    """A `<folder>/<Patch-Id>` Depends-On must name a patch of another loaded upstream folder."""
    where = f"{patch.folder}/{patch.name}"
    out = []
    for folder, pid in patch.upstream_depends_on:
        dep = f"{folder}/{pid}"
        if folder not in series_map:
            known = ", ".join(n for n in series_map if n != patch.folder) or "none"
            out.append(Problem(where, f"Depends-On {dep}: no upstream folder patches/{folder} (expected "
                                      f"<folder>/<Patch-Id> with folder one of: {known})"))
        elif pid not in series_map[folder].by_id():
            out.append(Problem(where, f"Depends-On {dep}: patches/{folder} has no patch {pid}"))
    return out


def touched_file(symbol: str, files: tuple[str, ...], prefix: str) -> str | None:
    """The diff file that defines the module part of a dotted `symbol`, if any."""
    parts = symbol.split(".")
    for cut in range(len(parts), 0, -1):
        module = "/".join(parts[:cut])
        for candidate in (f"{prefix}{module}.py", f"{prefix}{module}/__init__.py"):
            if candidate in files:
                return candidate
    return None


def twin_problems(series_map: dict[str, Series], registry, folders: tuple[str, ...] = ()) -> list[Problem]:
    """Both forms must exist and agree: every patch has a registered twin with matching metadata, and back.

    With `folders`, only those folders' patches and the twins of their distributions are looked at.
    """
    out: list[Problem] = []
    patch_ids = set()
    chosen = {n: s for n, s in series_map.items() if not folders or n in folders}
    for series in chosen.values():
        for patch in series.patches:
            patch_ids.add(patch.patch_id)
            out += _twin_agrees(series, patch, registry)
    distributions = {s.base.distribution for s in chosen.values()}
    for twin in registry.all():
        if folders and twin.meta.distribution not in distributions:
            continue
        if twin.meta.patch_id not in patch_ids:
            out.append(Problem(twin.meta.module, f"runtime twin {twin.meta.patch_id} has no format-patch in patches/"))
    return out


def _twin_agrees(series: Series, patch: PatchFile, registry) -> list[Problem]:
    """Compare one patch's trailers with its runtime twin's metadata."""
    where = f"{series.folder}/{patch.name}"
    module = patch.one("Runtime-Equivalent")
    if not module or module.lower().startswith("none"):
        return [Problem(where, "Runtime-Equivalent names no runtime twin; both forms are required")]
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        return [Problem(where, f"Runtime-Equivalent {module} cannot be imported ({exc})")]
    if patch.patch_id not in registry:
        return [Problem(where, f"{module} does not register a runtime twin for {patch.patch_id}")]
    meta = registry.get(patch.patch_id).meta
    out = []
    if meta.module != module:
        out.append(Problem(where, f"{patch.patch_id} is registered by {meta.module}, not {module}"))
    pairs = {
        "Target": (patch.one("Target"), meta.target),
        "Upstream-Status": (patch.one("Upstream-Status"), meta.upstream_status),
        "Forwarded": (patch.one("Forwarded"), meta.forwarded),
        "Remove-When": (patch.one("Remove-When"), meta.remove_when),
        "Gate": (patch.one("Gate").split()[0] if patch.one("Gate") else "", meta.gate),
        "Touches": (sorted(patch.many("Touches")), sorted(meta.touches)),
        "Tests": (sorted(patch.many("Tests")), sorted(meta.tests)),
        "Depends-On": (sorted(patch.depends_on_ids), sorted(meta.depends_on)),
    }
    for key, (trailer, twin) in pairs.items():
        if trailer != twin:
            out.append(Problem(where, f"{key} differs between the patch ({trailer!r}) and the twin {module} ({twin!r})"))
    if meta.distribution != series.base.distribution:
        out.append(Problem(where, f"twin patches {meta.distribution}, base.txt pins {series.base.distribution}"))
    elif not SpecifierSet(meta.versions).contains(Version(series.base.version), prereleases=True):
        out.append(Problem(where, f"twin range {meta.versions} excludes the pinned {series.base.label}"))
    return out
