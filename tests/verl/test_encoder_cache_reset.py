"""DSV41-VERL-005: a weight/adapter sync (followed by `wake_up`) drops vLLM's encoder cache in every waking mode."""

from __future__ import annotations

import asyncio
import types

import pytest

from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-005"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


class _Engine:
    """Records the calls veRL's server makes on vLLM's async engine client."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append(name)
        return call


def _server(mode: str, lora_rank: int):
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    server = object.__new__(vLLMHttpServer)
    server.node_rank = 0
    server.rollout_mode = RolloutMode(mode)
    server.engine = _Engine()
    server.model_config = types.SimpleNamespace(lora_rank=lora_rank, lora={})
    server._get_wake_up_tags = lambda: ["weights", "kv_cache"]
    return server


@pytest.mark.parametrize("mode", ["hybrid", "colocated"])
def test_wake_up_after_adapter_sync_resets_encoder_cache(patch_form, mode):
    server = _server(mode, lora_rank=16)
    asyncio.run(server.wake_up())
    assert "reset_encoder_cache" in server.engine.calls
    plain = _server(mode, lora_rank=0)  # merged / full-weight sync: the tower weights changed too
    asyncio.run(plain.wake_up())
    assert "reset_encoder_cache" in plain.engine.calls
    patch_form.record("calls", server.engine.calls)
    patch_form.record("plain_calls", plain.engine.calls)


def test_stock_colocated_wake_up_keeps_stale_image_embeddings():
    """docs/upstream.md §3.4 on the real code: a COLOCATED wake-up after a sync leaves the encoder cache alone."""
    from verl.workers.rollout.vllm_rollout import vllm_async_server  # noqa: F401  (imported before the block:
    # a first import inside it would run the plugin's post-import hook, which applies the twin again)

    with stock(PATCH_ID):
        server = _server("colocated", lora_rank=16)
        asyncio.run(server.wake_up())
    assert "reset_encoder_cache" not in server.engine.calls
