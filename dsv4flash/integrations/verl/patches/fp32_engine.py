"""Runtime twin of DSV41-VERL-010: veRL's Megatron engine accepts `dtype=float32` (full-precision training).

Why: `McoreEngineConfig.__post_init__` asserts `dtype in ["bfloat16", "float16"]`, while megatron-core trains
in fp32 when neither `fp16` nor `bf16` is set (no `Float16Module`, the fp32 optimizer) and the engine already
derives both flags from `dtype`. fp32 is what a CPU run needs (no bf16 GEMMs worth having), and what a
numerics check needs (rollout and actor log-probs equal to 1e-5, the unmerged-sync check of the GRPO run).

How: the check allows "float32" as well; nothing else in the engine changes (`PrecisionType.to_dtype`
already maps it, and fp16/bf16 are `False`).
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.workers.config.engine.McoreEngineConfig.__post_init__",)
STOCK_DTYPES = ("bfloat16", "float16")


def upstream_accepts_float32() -> bool:
    """Probe: does `McoreEngineConfig(dtype="float32")` construct?"""
    from verl.workers.config.engine import McoreEngineConfig

    try:
        McoreEngineConfig(dtype="float32")
    except AssertionError:
        return False
    return True


@verl_twin(
    patch_id="DSV41-VERL-010",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_FP32_ENGINE",
    tests=("tests/verl/test_fp32_engine.py",),
    upstream_has_it=upstream_accepts_float32,
)
def install(patcher: Patcher) -> None:
    """Wrap `__post_init__`: its only use of `dtype` is the check, so float32 passes it as a stock dtype would."""
    from verl.workers.config.engine import McoreEngineConfig

    stock_post_init = McoreEngineConfig.__post_init__

    def __post_init__(self) -> None:
        if self.dtype != "float32":
            return stock_post_init(self)
        # The config is frozen field by field (BaseConfig.__setattr__): swap the value in its __dict__.
        self.__dict__["dtype"] = STOCK_DTYPES[0]
        try:
            stock_post_init(self)
        finally:
            self.__dict__["dtype"] = "float32"

    patcher.replace(McoreEngineConfig, "__post_init__", __post_init__)
