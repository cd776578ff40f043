"""CPU development mode for megatron-bridge 0.6.2: let the real package import on a CPU-only Python 3.11 machine.

megatron-bridge declares Python >= 3.12 and imports Transformer Engine unconditionally (docs/upstream.md §0,
ci/install_sides.md): `megatron.training` does `from typing import override` (3.12+), and `import megatron.bridge`
reaches `peft/lora_layers.py: import transformer_engine.pytorch`. `install()`:

1. backports `typing.override` from `typing_extensions`;
2. imports the megatron-core modules the bridge needs *before* any stub exists (so they take their own
   no-TE paths);
3. serves `transformer_engine` and every submodule from a `sys.meta_path` finder as dummy modules whose
   attributes are dummy classes that raise when instantiated or called, so a stray TE code path fails loudly;
4. imports `megatron.bridge` and resets every bridge module's `HAVE_TE` flag to False.

It changes global interpreter state, so nothing installs it implicitly except veRL's CPU development
platform (`VERL_PLATFORM=cpu`, `dsv4flash.integrations.verl.cpu_platform`) in its own worker processes, and
only where no CUDA device is visible (checked there; a GPU machine has the real Transformer Engine); the
tests use it through `tests.mbridge.shim` (the same module state).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import typing

_MCORE_FIRST = ("megatron.core", "megatron.core.models.gpt", "megatron.core.models.hybrid.hybrid_block",
                "megatron.core.transformer.moe.router")
_installed = False


class _Unavailable:
    """Any Transformer Engine class: importable, never usable on this machine."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{type(self).__qualname__}: Transformer Engine is stubbed out in CPU development mode")

    def __init_subclass__(cls, **kwargs) -> None:  # TE base classes get subclassed at import time
        super().__init_subclass__()


class _StubModule(types.ModuleType):
    """A `transformer_engine.*` module: every missing attribute is a fresh unusable class."""

    __path__: list[str] = []  # a package, so submodule imports go through the finder too

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # `te.ops`, `te.pytorch`: namespaces (a call to one fails loudly too)
            value = _StubModule(f"{self.__name__}.{name}")
            sys.modules.setdefault(value.__name__, value)
        else:
            value = type(name, (_Unavailable,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `transformer_engine` and its submodules as `_StubModule`s."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cpu-stub"
        return module

    def exec_module(self, module) -> None:
        return None


def install() -> None:
    """Make `import megatron.bridge` work on CPU/3.11 (idempotent)."""
    global _installed
    if _installed:
        return
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    for name in _MCORE_FIRST:
        importlib.import_module(name)
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.append(_StubFinder())
    importlib.import_module("megatron.bridge")
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.bridge") and getattr(module, "HAVE_TE", None) is True:
            module.HAVE_TE = False
    _installed = True
