"""Embedded local engine: single-process CPU training of the tiny model (pretrain, SFT, DPO, GRPO).

`run_local` and `LocalResult` are imported when first used, so `dsv4flash.engine.progress` and
`dsv4flash.engine.fingerprint` load without torch.
"""

from __future__ import annotations

__all__ = ["LocalResult", "run_local"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'dsv4flash.engine' has no attribute {name!r}")
    from dsv4flash.engine import local

    return getattr(local, name)
