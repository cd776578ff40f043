"""megatron-core integration: `register()` applies the megatron-core runtime twins (lazy, idempotent).

Call `dsv4flash.integrations.mcore.register()` in each process before building Megatron models. It imports
nothing from megatron-core until called and is safe to call repeatedly (each twin's apply is idempotent);
each twin decides from its gate variable, the installed release and an upstream probe whether it is needed.
"""

from __future__ import annotations


def register() -> dict:
    """Apply every megatron-core runtime twin; returns Patch-Id -> `dsv4flash._patching.Outcome`."""
    from dsv4flash import _patching

    _patching.discover()
    return _patching.REGISTRY.apply_all(distribution="megatron-core")
