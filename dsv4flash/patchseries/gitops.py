"""Scratch git repositories for patch checks: base commit, `git am` (plain, then --3way), scans.

Every git call runs with the user's global/system config switched off and a fixed identity and date, so
the base commit of a given tree is reproducible and nothing on the machine changes the result.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "dsv4flash patches",
    "GIT_AUTHOR_EMAIL": "patches@dsv4flash.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "dsv4flash patches",
    "GIT_COMMITTER_EMAIL": "patches@dsv4flash.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "LC_ALL": "C",
}
CONFLICT_RE = re.compile(r"^(<{7}|>{7})( |$)", re.M)
# Importing a scratch tree (running its tests) writes bytecode next to the sources; `git add -A` must not
# pick it up, or `git format-patch` ships binary hunks no upstream reviewer would take.
SCRATCH_EXCLUDES = ("__pycache__/", "*.py[cod]")


class GitError(RuntimeError):
    """A git command failed; the message carries its output."""


def git(cwd: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `git args...` in `cwd` with the isolated environment."""
    full_env = {**os.environ, **GIT_ENV, **(env or {})}
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=full_env)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed in {cwd}:\n{(proc.stdout + proc.stderr).strip()}")
    return proc


def init_repo(repo: Path, files: dict[str, Path], message: str) -> str:
    """Create `repo` holding `files` (repo path -> source file) in one commit; returns its sha.

    The repository ignores `SCRATCH_EXCLUDES` (bytecode), so commits made in it stay source-only.
    """
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q", "-b", "base")
    git(repo, "config", "core.autocrlf", "false")
    exclude = repo / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    exclude.write_text("".join(f"{pattern}\n" for pattern in SCRATCH_EXCLUDES))
    for rel, src in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, repo / rel)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return git(repo, "rev-parse", "HEAD").stdout.strip()


def reset_to(repo: Path, commit: str) -> None:
    """Detach at `commit` with a pristine work tree (scratch repositories only)."""
    if (repo / ".git" / "rebase-apply").exists():
        git(repo, "am", "--abort", check=False)
    git(repo, "checkout", "-q", "-f", "--detach", commit)
    git(repo, "clean", "-q", "-fdx")


@dataclass
class AmResult:
    """Outcome of applying one patch file with `git am`."""

    mode: str  # "clean", "3way", "already-applied" (3-way merge found nothing to change) or "failed"
    output: str

    @property
    def ok(self) -> bool:
        """Whether the patch went in."""
        return self.mode != "failed"


def am(repo: Path, patch: Path) -> AmResult:
    """`git am` one patch; on failure retry with --3way; on failure again abort and report git's words."""
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    first = git(repo, "am", "-q", "--keep-cr", str(patch), check=False)
    if first.returncode == 0:
        return AmResult("clean", "")
    git(repo, "am", "--abort", check=False)
    second = git(repo, "am", "-q", "--keep-cr", "--3way", str(patch), check=False)
    if second.returncode == 0:
        moved = git(repo, "rev-parse", "HEAD").stdout.strip() != head
        return AmResult("3way" if moved else "already-applied", (first.stdout + first.stderr).strip())
    git(repo, "am", "--abort", check=False)
    return AmResult("failed", _summarise(second.stdout + second.stderr or first.stdout + first.stderr))


def _summarise(output: str) -> str:
    """git's own error lines, without the 'use git am --continue' advice."""
    keep = [ln for ln in output.splitlines() if ln.startswith(("error:", "fatal:", "CONFLICT", "Patch failed"))]
    return "\n".join(keep or output.strip().splitlines()[:6])


def conflict_markers(root: Path, paths: list[str]) -> list[str]:
    """`path:line` of every `<<<<<<<`/`>>>>>>>` line in the given files (missing files are skipped)."""
    hits = []
    for rel in paths:
        path = root / rel
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for match in CONFLICT_RE.finditer(text):
            hits.append(f"{rel}:{text.count(chr(10), 0, match.start()) + 1}")
    return hits


def compile_errors(root: Path, paths: list[str]) -> list[str]:
    """Byte-compile each existing `.py` file in memory; returns `path:line: message` per failure."""
    errors = []
    for rel in paths:
        path = root / rel
        if rel.endswith(".py") and path.is_file():
            try:
                compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
            except SyntaxError as exc:
                errors.append(f"{rel}:{exc.lineno}: {exc.msg}")
    return errors


def symbol_defined(path: Path, attrs: list[str]) -> bool:
    """Whether `A.B.c` (attrs) is defined in the Python file: class/def/assignment, nested by class."""
    body = ast.parse(path.read_bytes()).body
    for name in attrs:
        found = None
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def apply_to_directory(target: Path, patches: list[Path], strip: int = 1, three_way: bool = True) -> list[str]:
    """Apply patches to a directory: `git am` if it is the top of a git work tree, else `git apply`.

    Returns one line per patch. Raises GitError naming the first patch that does not apply.
    """
    target = target.resolve()
    top = git(target, "rev-parse", "--show-toplevel", check=False)
    lines = []
    if top.returncode == 0 and Path(top.stdout.strip()).resolve() == target and strip == 1:
        for patch in patches:
            result = am(target, patch) if three_way else AmResult(
                "clean" if git(target, "am", "-q", str(patch), check=False).returncode == 0 else "failed", "")
            if not result.ok:
                git(target, "am", "--abort", check=False)
                raise GitError(f"{patch.name} does not apply to {target}:\n{result.output}")
            lines.append(f"{patch.name}: " + ("already applied, skipped" if result.mode == "already-applied"
                                              else f"committed ({result.mode})"))
        return lines
    # Not a checkout: keep git from discovering an enclosing repository (e.g. a venv inside a project).
    ceiling = {"GIT_CEILING_DIRECTORIES": str(target.parent)}
    for patch in patches:
        reverse = git(target, "apply", f"-p{strip}", "--reverse", "--check", str(patch), check=False, env=ceiling)
        if reverse.returncode == 0:
            lines.append(f"{patch.name}: already applied, skipped")
            continue
        proc = git(target, "apply", f"-p{strip}", "--whitespace=nowarn", str(patch), check=False, env=ceiling)
        if proc.returncode != 0:
            raise GitError(f"{patch.name} does not apply to {target}:\n{_summarise(proc.stdout + proc.stderr)}")
        lines.append(f"{patch.name}: applied")
    return lines
