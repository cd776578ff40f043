"""Runtime twins for megatron-core, one module per upstream change (Patch-Id `DSV41-MCORE-NNN`).

Every module here registers itself with `dsv4flash.patching.twins.runtime_patch`; `twins.discover()`
imports them all. The upstream form of each lives in `patches/megatron-lm/` under the same Patch-Id.
"""

import functools
import importlib
import importlib.util
from pathlib import Path

from dsv4flash.patching.twins import MARKER, runtime_patch

# What every megatron-core 0.19 twin shares: target, distribution, upstream status, when to remove it (a twin
# passes its own version window, and overrides the status where it is a backport).
mcore_twin = functools.partial(runtime_patch, target="NVIDIA/Megatron-LM", distribution="megatron-core",
                               upstream_status="Pending", forwarded="no", remove_when="megatron-core>=0.20.0")

# The files that format-patches add as new megatron-core modules, at their Megatron-LM repository paths. Twins of
# such patches execute these files instead of keeping a copy of their code (tests compare them with the patches).
UPSTREAM_SOURCES = Path(__file__).resolve().parent / "_upstream"


def provide_upstream_files(patcher, modules: dict[str, str], root: Path = UPSTREAM_SOURCES) -> None:
    """Make each upstream module name import the file `root / path` (in the given order; megatron-bridge twins
    pass their own `_upstream` root)."""
    for name, rel in modules.items():
        spec = importlib.util.spec_from_file_location(name, root / rel)
        module = importlib.util.module_from_spec(spec)
        patcher.provide_module(name, module)  # registered before it runs: dataclasses look their module up
        spec.loader.exec_module(module)


def upstream_ships(modules) -> bool:
    """Probe: do these modules import from the installed megatron-core itself (not from a twin's provided files)?"""
    try:
        loaded = [importlib.import_module(name) for name in modules]
    except ImportError:
        return False
    return not any(getattr(m, MARKER, None) for m in loaded)
