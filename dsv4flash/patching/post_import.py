"""Run a callback right after a module finishes importing (or now, if it already has).

Used wherever dsv4flash must act on a third-party module without importing it first: `import verl` loads
plugins before any veRL submodule, and each veRL twin patches a module that only some processes import (the
rollout worker, the Megatron engine); `import dsv4flash` registers the transformers classes (`dsv4flash.hf`)
only once transformers' auto classes are imported. Acting when the module arrives keeps every process from
importing what it does not use.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("dsv4flash.verl")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder that only wraps the loaders of watched modules."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[], None]]] = {}
        self.lock = threading.RLock()

    def find_spec(self, fullname, path, target=None):
        """Find the spec with the other finders; make its loader run the callbacks after `exec_module`."""
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_callbacks(module) -> None:
            exec_module(module)
            self.fire(fullname)

        loader.exec_module = exec_then_callbacks
        return spec

    def fire(self, name: str) -> None:
        """Run and forget the callbacks of `name` (errors are logged, never raised into an import)."""
        with self.lock:
            callbacks = self.pending.pop(name, [])
        for callback in callbacks:
            try:
                callback()
            except Exception:  # pragma: no cover - a twin that fails must not break the import it rides on
                log.warning("post-import callback for %s failed", name, exc_info=True)


_finder = _PostImportFinder()


def when_imported(module: str, callback: Callable[[], None]) -> None:
    """Call `callback` once `module` is imported: now if it already is, else right after its import."""
    if module in sys.modules and getattr(sys.modules[module], "__spec__", None) is not None \
            and not getattr(sys.modules[module].__spec__, "_initializing", False):
        callback()
        return
    with _finder.lock:
        _finder.pending.setdefault(module, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
