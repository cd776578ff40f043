"""Fixtures of the Megatron-Core model tests."""

from __future__ import annotations

import pytest


def _for_the_process(registry) -> set[str]:
    """Twins that stay applied for the process, as they do where the product runs: the veRL plugin's (applied
    when a veRL module is imported) and the CSA2 stack's upstream-form modules (`mcore.require_stack_modules`)."""
    import sys

    from dsv4flash.integrations.mcore import STACK_TWINS

    keep = {t.meta.patch_id for t in registry.all() if t.meta.distribution == "verl"}
    if "dsv4flash.integrations.mcore.csa2" in sys.modules:
        keep |= registry.with_dependencies(STACK_TWINS)
    return keep


@pytest.fixture(scope="module", autouse=True)
def revert_twins_applied_here():
    """Revert, after each module, the runtime twins its tests applied: building a V4.1 model with a vision tower
    applies DSV41-MBRIDGE-006 and what it depends on (the ViT is megatron-bridge's upstream-form module). The
    twins of `_for_the_process` stay: later tests (and veRL's own imports) rely on them as a worker would."""
    from dsv4flash.patching import twins

    before = {t.meta.patch_id for t in twins.REGISTRY.all() if t.applied}
    yield
    keep = before | _for_the_process(twins.REGISTRY)
    for twin in reversed(twins.REGISTRY.all()):
        if twin.applied and twin.meta.patch_id not in keep:
            twin.revert()
