"""Gloo process groups and Megatron model-parallel state for CPU tests (single rank or spawned ranks)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from tests.mcore_cpu import shim


@contextlib.contextmanager
def gloo_group(rank: int = 0, world_size: int = 1, init_file: str | os.PathLike | None = None) -> Iterator[None]:
    """Initialise the default process group over gloo (file rendezvous), tearing down only what it created."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"a default process group of world size {dist.get_world_size()} already exists; "
                f"cannot open one of size {world_size}"
            )
        yield
        return
    with contextlib.ExitStack() as stack:
        if init_file is None:
            init_file = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gloo-"))) / "rendezvous"
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def model_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    seed: int = 1234,
    rank: int = 0,
    world_size: int | None = None,
    init_file: str | os.PathLike | None = None,
) -> Iterator[None]:
    """CUDA redirect + gloo group + `initialize_model_parallel` + Megatron RNG seeding, undone on exit."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    world_size = world_size if world_size is not None else tp * pp * cp
    with shim.cuda_redirect(), gloo_group(rank, world_size, init_file):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
        )
        try:
            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
            # The aux/z-loss backward scale is a class attribute that megatron-core's schedules set to the
            # loss scale over micro-batches; one left by an earlier schedule in the process would scale these
            # grads. None is a fresh process's state (1.0 on first use).
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
            yield
        finally:
            parallel_state.destroy_model_parallel()
            # The MoE metrics tracker is process-global; a stale one breaks the next model's aux-loss logging.
            moe_logging.set_moe_metrics_tracker(None)
            MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _spawned_entry(rank: int, fn: Callable[..., Any], world_size: int, init_file: str, args: tuple) -> None:
    """Body of one rank: CUDA redirect and gloo group around the user function."""
    with shim.cuda_redirect(), gloo_group(rank, world_size, init_file):
        fn(rank, world_size, *args)


TESTS_DIR = str(Path(__file__).resolve().parents[1])
# Preloaded once by the fork server, so each rank starts as a cheap fork of a process that has imported
# megatron-core but never touched c10d or the OpenMP pool (forking the pytest process itself after a gloo
# group existed hangs or segfaults the children).
PRELOAD = ["torch", "torch.distributed", "megatron.core.tensor_parallel", "megatron.core.parallel_state",
           "megatron.core.models.gpt.gpt_model", "megatron.core.transformer.moe.moe_layer"]
# A rank resolves `tests` to this repository first: the verl wheel installs a regular top-level `tests`
# package, which would otherwise shadow pytest's namespace mapping in a fresh interpreter.
_BOOTSTRAP = """
import importlib, importlib.machinery, importlib.util, sys
_tests = sys.modules.get("tests")
if _tests is None or list(getattr(_tests, "__path__", [])) != [TESTS_DIR]:
    for _name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
        del sys.modules[_name]
    _tests = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("tests", None, is_package=True))
    _tests.__path__ = [TESTS_DIR]
    sys.modules["tests"] = _tests
_fn = importlib.import_module(MODULE)
for _part in QUALNAME.split("."):
    _fn = getattr(_fn, _part)
importlib.import_module("tests.mcore_cpu.parallel")._spawned_entry(RANK, _fn, WORLD_SIZE, INIT_FILE, ARGS)
"""


def spawn_gloo(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> None:
    """Run module-level `fn(rank, world_size, *args)` on `world_size` gloo ranks; raise if any rank fails.

    Ranks are forked from a multiprocessing fork server that preloads torch and megatron-core (started once
    per process, ~5 s), so later calls cost milliseconds per rank. `args` must be picklable. A failing rank
    prints its traceback to stderr; the others are stopped and the exit codes are reported here.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
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
        raise RuntimeError(f"{fn.__qualname__}: gloo rank(s) failed ({', '.join(failed)}); their tracebacks "
                           "are in the captured stderr")


def _join_all(procs: list, timeout: float) -> list[str]:
    """Wait for every rank; once one fails (or time runs out) stop the rest. Returns failure descriptions."""
    import time

    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            # Survivors may wait forever in their next collective: give them a moment to fail (and report
            # their own traceback) on their own, then stop them.
            grace = time.monotonic() + 5.0
            for p in procs:
                p.join(timeout=max(0.0, grace - time.monotonic()))
            break
        procs[0].join(timeout=0.05)
    failed = []
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
            failed.append(f"{p.name} stopped")
        elif p.exitcode != 0:
            failed.append(f"{p.name} exit code {p.exitcode}")
    return failed
