"""Runtime twin of DSV41-VERL-005: after a weight or adapter sync the rollout server drops vLLM's encoder cache.

Why: image embeddings depend on the vision tower and aligner weights, and with tower/connector LoRA on the
adapter. vLLM keys its encoder cache by `mm_hash` (prefixed by `lora_name` under tower LoRA), and veRL serves
every adapter version under the same name ("123"), so after a sync the engine keeps reusing image embeddings
computed with the previous weights or adapter. veRL resets the encoder cache only in HYBRID mode
(`_sleep_hybrid`); COLOCATED wake-ups reset the prefix cache only (docs/upstream.md §3.4).

How: `vLLMHttpServer.wake_up`, which follows every sync, also resets the encoder cache in every rollout mode
that wakes the engine (HYBRID, COLOCATED). Recomputing embeddings once per sync is cheap next to a rollout.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer.wake_up",)


def upstream_resets_encoder_cache() -> bool:
    """Probe: does veRL's `wake_up` itself reset the encoder cache?"""
    import inspect

    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    return "reset_encoder_cache" in inspect.getsource(vLLMHttpServer.wake_up)


@verl_twin(
    patch_id="DSV41-VERL-005",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_ENCODER_CACHE_RESET",
    tests=("tests/verl/test_encoder_cache_reset.py",),
    upstream_has_it=upstream_resets_encoder_cache,
)
def install(patcher: Patcher) -> None:
    """Wrap `wake_up`: stock behaviour, then an encoder-cache reset."""
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    wake_up = vLLMHttpServer.wake_up

    async def wake_up_and_reset(self, tags=None):
        """Wake the engine as veRL does, then drop image embeddings computed with the previous weights/adapter."""
        await wake_up(self, tags)
        if self.node_rank == 0 and self.rollout_mode != RolloutMode.STANDALONE:
            await self.engine.reset_encoder_cache()

    patcher.replace(vLLMHttpServer, "wake_up", wake_up_and_reset)
