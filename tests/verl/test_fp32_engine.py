"""DSV41-VERL-010: veRL's Megatron engine config accepts dtype=float32 (and still refuses what it cannot run)."""

from __future__ import annotations

import pytest
import torch

from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-010"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


def _engine_config(dtype: str):
    """`actor_rollout_ref.actor.megatron` as veRL's Megatron engine receives it."""
    from verl.workers.config.engine import McoreEngineConfig

    return McoreEngineConfig(dtype=dtype)


def test_float32_engine_config(patch_form):
    from verl.utils.torch_dtypes import PrecisionType

    config = _engine_config("float32")
    dtype = PrecisionType.to_dtype(config.dtype)
    assert dtype == torch.float32 and config.sequence_parallel is False  # the rest of __post_init__ still ran
    with pytest.raises(Exception, match="dtype float64 not supported"):
        _engine_config("float64")
    patch_form.record("dtype", [config.dtype, str(dtype)])
    patch_form.record("bf16_still", _engine_config("bfloat16").dtype)


def test_stock_engine_refuses_float32():
    with stock(PATCH_ID):
        with pytest.raises(Exception, match="dtype float32 not supported"):
            _engine_config("float32")
