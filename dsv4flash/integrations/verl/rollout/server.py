"""`DSV4FlashRolloutServer`: the Ray actor veRL's agent loop and weight sync talk to, as they talk to vLLM's server.

It answers what `vLLMHttpServer` answers for veRL 0.9.1 — `generate` (token ids in, `TokenOutput` out: ids,
log-probs, routed experts), `wake_up` / `sleep` / `clear_kv_cache` / `release_kv_cache` / `resume_kv_cache`,
`abort_all_requests` / `resume_generation`, `set_global_steps`, `collective_rpc` — on the reference engine
(`engine.RolloutEngine`). There is no HTTP endpoint: veRL's token-in-token-out path calls the actor handle.

CPU memory: the base stays resident and a request's decode cache lives only while it generates, so sleep,
wake-up and the cache releases have nothing to free; they record the state and return. A weight sync arrives
in buckets (`load_weights`, sent by `adapter.ServerAdapter.update_weights`); the adapter is swapped only once
the last bucket is in, so requests never see half an adapter.
"""

from __future__ import annotations

import asyncio
import logging
import threading

log = logging.getLogger("dsv4flash.verl.rollout")


class DSV4FlashRolloutServer:
    """One replica's server on one node (`replica_rank`, `node_rank`), owning a `RolloutEngine`."""

    def __init__(self, config, model_config, rollout_mode, replica_rank: int, node_rank: int = 0) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config)  # the replica's RolloutConfig, or its DictConfig (_target_)
        self.model_config = model_config
        self.rollout_mode = rollout_mode
        self.replica_rank, self.node_rank = replica_rank, node_rank
        self.engine = None
        self.global_steps = None
        self.sleeping = False
        self._pending: dict[str, object] = {}  # adapter tensors of the sync in progress
        self._buckets = self._base_tensors = 0
        self.last_sync: dict | None = None  # kind, buckets and tensors of the last completed sync
        self._gate = asyncio.Event()
        self._gate.set()
        self._in_flight = 0
        self._compute = threading.Lock()  # one generation at a time on the shared CPU cores

    # ---- lifecycle --------------------------------------------------------------------------------
    def launch(self) -> str:
        """Load the base named by the model config's path; returns the address this server is known by."""
        from dsv4flash.integrations.verl.rollout.engine import RolloutEngine

        path = _model_path(self.model_config)
        self.engine = RolloutEngine(path, seed=int(self.config.seed or 0) + self.replica_rank,
                                    dtype=str(self.config.dtype))
        return self.address

    @property
    def address(self) -> str:
        """The load balancer's key for this server (no HTTP: veRL reaches it through the Ray handle)."""
        return f"dsv4flash-replica-{self.replica_rank}-node-{self.node_rank}"

    def get_server_address(self):
        """(host, port) as vLLM's server answers; the port is the replica's (no socket is opened)."""
        return self.address, self.replica_rank

    def get_rollout_config(self):
        """The RolloutConfig (routers read max_num_seqs / max_model_len from it)."""
        return self.config

    # ---- generation -------------------------------------------------------------------------------
    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority: int = 0, kv_transfer_params=None):
        """Token-in-token-out generation -> `verl.workers.rollout.replica.TokenOutput`."""
        from verl.workers.rollout.replica import TokenOutput

        for what, value in (("video_data", video_data), ("audio_data", audio_data),
                            ("kv_transfer_params", kv_transfer_params)):
            if value is not None:
                raise ValueError(f"dsv4flash rollout: {what} is not supported (image prompts and text only)")
        await self._gate.wait()
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        max_tokens = self._max_tokens(len(prompt_ids), params)
        if self.config.full_determinism:  # as vLLM's server: one seed per replica for every request
            params.setdefault("seed", self.replica_rank + int(self.config.seed or 0))
        want_logprobs = bool(params.pop("logprobs", False))
        ignore_eos = bool(params.pop("ignore_eos", self.config.ignore_eos))
        self._in_flight += 1
        try:
            out = await asyncio.to_thread(self._generate, prompt_ids, params, max_tokens, image_data, ignore_eos)
        finally:
            self._in_flight -= 1
        extra = {"global_steps": self.global_steps, "adapter_version": out.adapter_version}
        if out.prompt_logprobs is not None:
            extra.update(prompt_ids=out.prompt_ids, prompt_logprobs=out.prompt_logprobs)
        return TokenOutput(token_ids=out.token_ids, log_probs=out.log_probs if want_logprobs else None,
                           routed_experts=out.routed_experts, stop_reason=out.stop_reason, extra_fields=extra)

    def _generate(self, prompt_ids, params, max_tokens, images, ignore_eos):
        with self._compute:
            return self.engine.generate(prompt_ids, params, max_tokens=max_tokens, images=images,
                                        ignore_eos=ignore_eos,
                                        record_routes=bool(self.config.enable_rollout_routing_replay))

    def _max_tokens(self, prompt_len: int, params: dict) -> int:
        """vLLM server's budget: sampling max_tokens, else the response length; at least 1, within max_model_len."""
        cfg = self.config
        max_model_len = cfg.max_model_len or cfg.prompt_length + cfg.response_length
        room = max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"dsv4flash rollout: prompt length {prompt_len} leaves no room within max_model_len "
                             f"{max_model_len}")
        if "max_tokens" in params:
            wanted = params.pop("max_tokens")
        elif "max_new_tokens" in params:
            wanted = params.pop("max_new_tokens")
        else:
            wanted = min(cfg.response_length, cfg.prompt_length + cfg.response_length - prompt_len)
        return max(1, min(int(wanted), room))

    # ---- weight sync ------------------------------------------------------------------------------
    async def load_weights(self, bucket: list, peft_config: dict | None = None, base_sync_done: bool = False,
                           is_last: bool = False) -> int:
        """One bucket of a sync: adapter tensors (peft_config and base_sync_done, applied at `is_last`) or base
        tensors (loaded at once), exactly the split vLLM's worker makes."""
        self._buckets += 1
        if peft_config and base_sync_done:
            self._pending.update(bucket)
            if is_last:
                self.last_sync = {"kind": "adapter", "buckets": self._buckets, "tensors": len(self._pending)}
                self._buckets = 0
                tensors, self._pending = self._pending, {}
                await asyncio.to_thread(self.engine.set_adapter, tensors, dict(peft_config))
                log.info("dsv4flash rollout replica %d: adapter version %d (%d tensors)", self.replica_rank,
                         self.engine.version, len(tensors))
            return len(bucket)
        loaded = await asyncio.to_thread(self.engine.load_base_weights, list(bucket))
        self._base_tensors += len(bucket)
        if is_last:
            self.last_sync = {"kind": "base", "buckets": self._buckets, "tensors": self._base_tensors}
            self._buckets = self._base_tensors = 0
            self.engine.finish_base_sync()
            if not peft_config:
                self.engine.drop_adapter()  # a merged (full-weight) sync replaces any adapter
        return loaded

    def get_last_sync(self) -> dict | None:
        """Kind ("adapter" / "base"), bucket and tensor counts of the last completed sync."""
        return self.last_sync

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None):
        """Run one of this server's methods by name (the single worker is the server itself)."""
        fn = getattr(self, method, None)
        if method.startswith("_") or not callable(fn):
            raise ValueError(f"dsv4flash rollout: collective_rpc method {method!r} does not exist on the server")
        out = fn(*args, **(kwargs or {}))
        return await out if asyncio.iscoroutine(out) else out

    async def set_global_steps(self, global_steps: int) -> None:
        """The trainer step of the weights now served."""
        self.global_steps = global_steps

    # ---- memory and scheduling (CPU: nothing to release) ------------------------------------------
    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Weights and caches are resident on the host: only the state changes."""
        self.sleeping = False

    async def sleep(self) -> None:
        """Nothing to offload on CPU (the base is resident, decode caches are per request)."""
        self.sleeping = True

    async def clear_kv_cache(self) -> None:
        """No cache outlives a request (prefix sharing is within one request): nothing to clear."""

    async def release_kv_cache(self) -> None:
        """No KV pool to release on CPU."""

    async def resume_kv_cache(self) -> None:
        """No KV pool to restore on CPU."""

    async def wait_for_requests_to_drain(self) -> None:
        """Return once no request is generating."""
        while self._in_flight:
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate (new requests wait for `resume_generation`) and let running ones finish.

        A reference-engine request is not preemptible mid-token, so nothing is aborted: the count is 0."""
        self._gate.clear()
        await self.wait_for_requests_to_drain()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        """Open the gate again."""
        self._gate.set()

    async def start_profile(self, **kwargs) -> None:
        """Profiling is not wired for the reference engine (use `python -m dsv4flash.bench`)."""

    async def stop_profile(self) -> None:
        """See `start_profile`."""


def _model_path(model_config) -> str:
    """The base directory from veRL's model config (HFModelConfig or its DictConfig: local_path, else path)."""
    get = model_config.get if hasattr(model_config, "get") else lambda k, d=None: getattr(model_config, k, d)
    path = get("local_path", None) or get("path", None)
    if not path:
        raise ValueError("dsv4flash rollout: actor_rollout_ref.model.path is not set (a dsv4flash base directory)")
    from verl.utils.fs import copy_to_local

    return copy_to_local(str(path))
