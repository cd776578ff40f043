"""What fault cases run in: a fresh directory per case, shared inputs built once, and the ways to watch a fault
(`must_fail`, the CLI in-process, a forked child that may be killed)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsv4flash.faultcases import Failure, LeftBehind, SilentWrong

__all__ = ["FaultContext", "CliRun", "fork_run"]


@dataclass
class CliRun:
    """One in-process `dsv4flash ...` run."""

    code: int
    out: str
    err: str
    traceback: bool


def fork_run(fn: Callable[[], object], *, crash_at: str | None = None, fsize_limit: int | None = None,
             stderr_to: Path | None = None) -> int:
    """Run `fn()` in a forked child, optionally with a crash point armed or a file-size limit; its wait status.

    The child exits 0 on success, 3 on an exception, or fn's int return value; tensors should be built before
    the fork (the child does file and database work only).
    """
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if stderr_to is not None:  # both the fd (C code) and sys.stderr (which a test runner may have replaced)
                fd = os.open(stderr_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 2)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
            if crash_at:
                os.environ["DSV4FLASH_CRASH_AT"] = crash_at
            if fsize_limit is not None:
                import resource
                import signal

                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
            returned = fn()
            code = returned if isinstance(returned, int) else 0
        except BaseException:  # noqa: BLE001 - reported through the exit code
            traceback.print_exc()
            code = 3
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


class FaultContext:
    """Per-run state of the fault cases: the work root, the current case's directory, cached inputs."""

    def __init__(self, root: str | os.PathLike, *, postgres_server: str | None = None, keep: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.postgres_server = postgres_server
        self.keep = keep
        self.tmp = self.root
        self._cache: dict[str, object] = {}

    @contextmanager
    def fresh(self, case_id: str):
        """Make `self.tmp` an empty directory for one case (removed afterwards unless `keep`)."""
        self.tmp = self.root / re.sub(r"[^A-Za-z0-9_.-]", "_", case_id)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        try:
            yield self.tmp
        finally:
            if not self.keep:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def cached(self, key: str, build: Callable[[], object]):
        """`build()` once per context."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # ---- shared inputs ----
    def release(self) -> Path:
        """The tiny config's release-layout checkpoint in 3 shards (written once, never modified)."""
        from dsv4flash_bridge.synthetic import write_release_checkpoint

        return self.cached("release", lambda: write_release_checkpoint(self.root / "_shared" / "release", "tiny",
                                                                       shards=3, seed=1))

    def imported(self) -> Path:
        """An import of `release()` with release naming (written once, never modified)."""
        from dsv4flash_bridge.convert import import_release

        def build():
            out = self.root / "_shared" / "imported"
            import_release(self.release(), out, progress=False)
            return out
        return self.cached("imported", build)

    def copy_of(self, path: Path, name: str | None = None) -> Path:
        """A private copy (in this case's directory) to damage."""
        return Path(shutil.copytree(path, self.tmp / (name or path.name), symlinks=True))

    def resident(self):
        """The resident tiny base every service case shares."""
        from dsv4flash.engine.resident import ResidentBase

        return self.cached("resident", lambda: ResidentBase("tiny", seed=0, device="cpu"))

    def service(self):
        """A service client over the shared resident base, storing under this case's directory."""
        import dsv4flash.service as tinker

        return tinker.ServiceClient(root=self.tmp / "service", resident=self.resident())

    def postgres(self) -> str:
        """A fresh, empty database on the run's PostgreSQL server (libpq DSN)."""
        import uuid

        import psycopg

        if self.postgres_server is None:
            raise RuntimeError("this case needs a PostgreSQL server (FaultContext(postgres_server=DSN))")
        name = f"f_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.postgres_server, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.postgres_server.replace("dbname=postgres", f"dbname={name}")

    # ---- watching a fault ----
    @staticmethod
    def must_fail(operation: Callable[[], object]) -> Failure:
        """The exception `operation()` raises; completing without one is a silent wrong result."""
        try:
            operation()
        except Exception as exc:  # noqa: BLE001 - classified by Failure.is_clean
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            return Failure(str(message), exception=exc)
        raise SilentWrong("completed without an error")

    @staticmethod
    def cli(*argv: str) -> CliRun:
        """`dsv4flash ARGV` in this process, stdout/stderr captured; an escaping exception is a traceback."""
        from dsv4flash.cli import main

        out, err = io.StringIO(), io.StringIO()
        tb = False
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # noqa: BLE001 - what a user would see as a traceback
                traceback.print_exc()
                code, tb = 1, True
        return CliRun(int(code), out.getvalue(), err.getvalue(), tb)

    def cli_must_fail(self, *argv: str) -> Failure:
        """The CLI's refusal; exit status 0 is a silent wrong result."""
        run = self.cli(*argv)
        if run.code == 0:
            raise SilentWrong(f"`dsv4flash {' '.join(map(str, argv))}` exited 0")
        return Failure(run.err.strip() if not run.traceback else run.err, exit_code=run.code, traceback=run.traceback)

    @staticmethod
    def nothing_at(*paths: Path) -> None:
        """Raise LeftBehind if any of the paths exists."""
        for p in paths:
            if p.exists() or p.is_symlink():
                raise LeftBehind(f"{p} was left behind")
