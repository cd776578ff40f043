"""Start gloo ranks for multi-process megatron-core tests, fast and with the right `tests` package.

Two problems with `tests.mcore_cpu.parallel.spawn_gloo` (torch `mp.spawn`):

- it pickles functions by reference, so each fresh child must `import tests...`; the verl 0.9.1 wheel
  installs a regular top-level `tests` package in site-packages, and a regular package always wins over this
  repository's namespace `tests/` directory, so those imports fail (pytest's importlib mode fixes only the
  parent);
- every fresh child pays megatron-core's ~5 s import, twice over on a 2-core machine.

Ranks therefore start from a `forkserver` that imported megatron-core once (forking the test process
itself crashes in gloo once it has opened and closed process groups). Each child begins in builtin `exec`
with plain data, binds `tests` to this repository first, then runs the same `_spawned_entry` (CUDA
redirect + gloo group). `start_method="spawn"` does the same from scratch, without the shared imports.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from pathlib import Path
from typing import Any, Callable

TESTS_DIR = str(Path(__file__).resolve().parents[1])
# Imported once by the fork server, so ranks start with them loaded (megatron-core takes ~5 s to import).
PRELOAD = (
    "torch",
    "megatron.core.tensor_parallel",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.distributed",
    "megatron.core.transformer.moe.moe_layer",
)

_BOOTSTRAP = """
import importlib, importlib.machinery, importlib.util, sys
_pkg = sys.modules.get("tests")
if _pkg is None or list(getattr(_pkg, "__path__", [])) != [TESTS_DIR]:
    for _name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
        del sys.modules[_name]
    _pkg = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("tests", None, is_package=True))
    _pkg.__path__ = [TESTS_DIR]
    sys.modules["tests"] = _pkg
from tests.mcore_cpu import parallel as _parallel
_fn = importlib.import_module(MODULE)
for _part in QUALNAME.split("."):
    _fn = getattr(_fn, _part)
_parallel._spawned_entry(RANK, _fn, WORLD_SIZE, INIT_FILE, ARGS)
"""


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
               start_method: str = "forkserver") -> None:
    """Run module-level `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise if any fails.

    `args` must be picklable plain data. A rank that fails prints its traceback to stderr; the others are
    stopped (they would wait forever in a collective) and the exit codes are reported here.
    """
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    with tempfile.TemporaryDirectory(prefix="gloo-spawn-") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        procs = []
        for rank in range(world_size):
            env = dict(TESTS_DIR=TESTS_DIR, MODULE=fn.__module__, QUALNAME=fn.__qualname__, RANK=rank,
                       WORLD_SIZE=world_size, INIT_FILE=init_file, ARGS=tuple(args))
            proc = ctx.Process(target=exec, args=(_BOOTSTRAP, env), name=f"gloo-rank{rank}")
            proc.start()
            procs.append(proc)
        failed = _join_all(procs, timeout)
    if failed:
        raise RuntimeError(f"{fn.__qualname__}: gloo ranks failed ({', '.join(failed)}); see their "
                           "tracebacks in the captured stderr")


def _join_all(procs: list, timeout: float) -> list[str]:
    """Wait for every rank; once one fails or the deadline passes, stop the rest. Returns failure notes."""
    import time

    deadline = time.monotonic() + timeout
    failed: list[str] = []
    pending = list(procs)
    while pending:
        for proc in list(pending):
            proc.join(timeout=0.05)
            if proc.exitcode is not None:
                pending.remove(proc)
                if proc.exitcode != 0:
                    failed.append(f"{proc.name} exit code {proc.exitcode}")
        if pending and (failed or time.monotonic() > deadline):
            for proc in pending:
                proc.terminate()
                proc.join(timeout=10)
                failed.append(f"{proc.name} stopped" + ("" if failed else f" after {timeout:.0f} s timeout"))
            pending = []
    return failed
