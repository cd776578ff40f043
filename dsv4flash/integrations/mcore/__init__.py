"""megatron-core integration: `register()` applies the megatron-core runtime twins (lazy, idempotent).

Call `dsv4flash.integrations.mcore.register()` in each process before building Megatron models. It imports
nothing from megatron-core until called and is safe to call repeatedly (each twin's apply is idempotent);
each twin decides from its gate variable, the installed release and an upstream probe whether it is needed.
"""

from __future__ import annotations

# megatron-core writes these into os.environ for the attention backend of every model a process builds
# (`LanguageModule._set_attention_backend`) and asserts on inherited values that disagree with a later model's.
ATTENTION_BACKEND_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without the attention-backend values megatron-core wrote for this process's own models: for a child
    process (a server, a training run) that builds its models with the backend its own config picks."""
    return {k: v for k, v in environ.items() if k not in ATTENTION_BACKEND_ENV}


def register() -> dict:
    """Apply every megatron-core runtime twin; returns Patch-Id -> `dsv4flash.patching.twins.Outcome`."""
    from dsv4flash.patching import twins

    twins.discover()
    return twins.REGISTRY.apply_all(distribution="megatron-core")


# The twins whose upstream-form modules the CSA2 stack (`integrations.mcore.csa2`) is built from; on a release
# that ships them (a patched tree) applying them is a no-op.
STACK_TWINS = ("DSV41-MCORE-010", "DSV41-MCORE-009")


def require_stack_modules() -> None:
    """Make the upstream-form modules of `STACK_TWINS` importable (apply those twins, Depends-On first)."""
    from dsv4flash.patching import twins

    registry = twins.discover()
    for patch_id in STACK_TWINS:
        twin = registry.get(patch_id)
        outcome = twin.apply()
        if not outcome.active:
            raise ImportError(f"the CSA2 stack needs {patch_id} ({twin.meta.gate}={twin.gate_mode()!r} gave "
                              f"{outcome.value}); leave the gate unset or 'auto', or install a patched megatron-core")
