"""Embedded local engine: single-process CPU training of the tiny model (pretrain, SFT, DPO, GRPO)."""

from dsv4flash.engine.local import LocalResult, run_local

__all__ = ["LocalResult", "run_local"]
