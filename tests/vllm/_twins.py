"""Deterministic twin state for plain (single-form) tests: run a block with a twin applied or suspended."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def twin(patch_id: str):
    """The registered runtime twin (every twin module discovered)."""
    from dsv4flash.patching import twins

    return twins.discover().get(patch_id)


@contextlib.contextmanager
def applied(patch_id: str) -> Iterator[object]:
    """The twin (and its Depends-On) applied for the block, then restored to the previous state."""
    t = twin(patch_id)
    deps = [twin(d) for d in t.meta.depends_on]
    before = [d.applied for d in deps] + [t.applied]
    for d in deps:
        d.apply(mode="on")
    t.apply(mode="on")
    try:
        yield t
    finally:
        for p, was in reversed(list(zip([*deps, t], before))):
            if not was:
                p.revert()


@contextlib.contextmanager
def stock(*patch_ids: str) -> Iterator[None]:
    """The block runs against unpatched upstream for these Patch-Ids (reverted twins are re-applied after)."""
    with contextlib.ExitStack() as stack:
        for pid in reversed(patch_ids):
            stack.enter_context(twin(pid).suspended())
        yield
