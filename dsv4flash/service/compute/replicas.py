"""Sampler replicas of `dsv4flash serve --sampler dsv4flash|vllm`: engines on Ray actors, fed revisions.

Each replica holds the base once (`ResidentBase`, fp32 on the CPU, as the project's veRL rollout replicas do) and
an LRU of adapters named `<policy>@<revision>`: every name is one immutable revision, so no cache can serve one
revision's weights for another. A sampling call names the revision; a replica that does not hold it (never
loaded, or evicted) reads it from the lifecycle store first, hash-verified against the base, so an evicted
adapter costs a reload, never a 404. The server publishes what it samples as adapter-only revisions
(`save_weights_for_sampler`, and the snapshots of `save_weights_and_get_sampling_client`) and keeps the rest of
sampling its own: request checks, seeds, stop sequences, recorded sequences, responses
(`ReplicaSamplingClient` is `SamplingClient` with its model calls on a replica, the same `sample_rows` /
`prompt_logprobs` code, so a replica samples the tokens the server's own base samples). `--sampler vllm` runs
vLLM engines on GPUs instead (`VLLMReplica`, on the release-layout checkpoint `--sampler-model`), fed by the
catalog resolver the vLLM plugin registers; it is GPU-only and its test is `gpu`-marked.
"""

from __future__ import annotations

import collections
import threading
import time
import zlib
from pathlib import Path

from dsv4flash.service.compute.sampling import (DEFAULT_MAX_TOKENS, SamplingClient, check_sample_request,
                                                prompt_logprobs, sample_rows)


class SamplerReplica:
    """One sampler replica (a Ray actor): the base, and up to `max_adapters` revisions by version-qualified name."""

    def __init__(self, base_dir: str, store: str, fingerprint: dict, max_adapters: int = 8) -> None:
        import torch

        from dsv4flash.engine.resident import ResidentBase
        from dsv4flash.lifecycle import AdapterStore
        from dsv4flash.lifecycle.fingerprint import BaseFingerprint

        torch.set_num_threads(1)
        self.base = ResidentBase(str(Path(base_dir) / "config.json"), base_dir=base_dir, device="cpu",
                                 dtype="float32")
        self.store = AdapterStore(store)
        self.fingerprint = BaseFingerprint.from_json(fingerprint)
        self.max_adapters = int(max_adapters)
        self._adapters: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.loads: dict[str, int] = collections.Counter()
        self.load_s = 0.0

    def _adapter(self, name: str, revision: str):
        """(placement, tensors) of a revision, loaded from the store when this replica does not hold it."""
        from dsv4flash.service.compute.serving import decode_loaded

        with self._lock:
            if name in self._adapters:
                self._adapters.move_to_end(name)
                return self._adapters[name]
        t0 = time.perf_counter()
        loaded = self.store.load(revision, resident_base=self.fingerprint)
        tensors, placement = decode_loaded(loaded, f"revision {revision[:12]}")
        with self._lock:
            self._adapters[name] = (placement, tensors)
            self.loads[name] += 1
            self.load_s += time.perf_counter() - t0
            while len(self._adapters) > self.max_adapters:
                self._adapters.popitem(last=False)
        return placement, tensors

    def _model(self, name: str | None, revision: str | None):
        if name is None:
            return self.base.bare()
        return self.base.bind(*self._adapter(name, revision))

    def sample(self, name, revision, ids, n, params, seed, stops, topk, max_tokens):
        """`sample_rows` under the named revision (None: the bare base) -> the engine's Rollout."""
        with self._model(name, revision) as model:
            return sample_rows(model, ids, n, params, seed, stops, topk, self.base.cfg.pad_token_id, max_tokens)

    def prompt_logprobs(self, name, revision, ids, topk):
        """`prompt_logprobs` under the named revision."""
        with self._model(name, revision) as model:
            return prompt_logprobs(model, ids, topk)

    def evict(self, name: str) -> bool:
        """Drop an adapter (it is reloaded from the store when next named)."""
        with self._lock:
            return self._adapters.pop(name, None) is not None

    def stats(self) -> dict:
        """Names held (least recent first), loads per name, seconds spent loading."""
        with self._lock:
            return {"held": list(self._adapters), "loads": dict(self.loads), "load_s": self.load_s}


class VLLMReplica:
    """One vLLM sampler replica (a Ray actor on a GPU, `--sampler vllm`): a vLLM engine on the release-layout
    checkpoint `model`, with the project's LoRA paths; revisions arrive through the catalog resolver
    (`dsv4flash.integrations.vllm.lora_resolver`: read from the store, hash-verified, exported once per revision in
    vLLM's layout), named `<policy>@<revision>` with the LoRA id derived from the revision id."""

    def __init__(self, model: str, store: str, max_adapters: int = 8, max_rank: int = 16) -> None:
        from vllm import LLM

        from dsv4flash.integrations.vllm.lora_resolver import CatalogLoRAResolver

        self.model = model
        self.resolver = CatalogLoRAResolver(store)
        self.llm = LLM(model=model, enable_lora=True, max_loras=max_adapters, max_lora_rank=max_rank,
                       max_cpu_loras=4 * max_adapters, enforce_eager=True, skip_tokenizer_init=True,
                       trust_remote_code=False, limit_mm_per_prompt={"image": 0})
        self.loads: dict[str, int] = collections.Counter()

    def _lora(self, name: str | None):
        if name is None:
            return None
        from dsv4flash.lifecycle.refs import parse_model_name

        request = self.resolver._resolve(self.model, name, parse_model_name(name))
        if request is None:
            raise ValueError(f"adapter {name}: not a revision of the served base in the store")
        self.loads[name] += 1
        return request

    def sample(self, name, revision, ids, n, params, seed, stops, topk, max_tokens):
        """`n` samples as the engine's `Rollout` (tokens, sampled log-probs, stopped)."""
        import torch
        from vllm import SamplingParams

        from dsv4flash.engine.sampling import Rollout

        sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p, seed=seed, logprobs=max(1, topk), detokenize=False,
                            stop_token_ids=[s[0] for s in stops if len(s) == 1])
        out = self.llm.generate([{"prompt_token_ids": list(ids)}], sp, lora_request=self._lora(name),
                                use_tqdm=False)[0].outputs
        width = max((len(o.token_ids) for o in out), default=0)
        tokens = torch.zeros((n, width), dtype=torch.int64)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        mask = torch.zeros((n, width), dtype=torch.bool)
        top = [] if topk else None
        for r, o in enumerate(out):
            k = len(o.token_ids)
            tokens[r, :k] = torch.tensor(o.token_ids)
            logprobs[r, :k] = torch.tensor([lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
            mask[r, :k] = True
            if topk:
                top.append([sorted(((int(i), float(v.logprob)) for i, v in lp.items()), key=lambda x: -x[1])[:topk]
                            for lp in o.logprobs])
        stopped = torch.tensor([o.finish_reason == "stop" for o in out])
        return Rollout(tokens, logprobs, mask, stopped, top)

    def prompt_logprobs(self, name, revision, ids, topk):
        """vLLM's prompt log-probs in `prompt_logprobs`' form (None first)."""
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, prompt_logprobs=max(1, topk), detokenize=False)
        rows = self.llm.generate([{"prompt_token_ids": list(ids)}], sp, lora_request=self._lora(name),
                                 use_tqdm=False)[0].prompt_logprobs
        lp = [None] + [float(row[t].logprob) for row, t in zip(rows[1:], ids[1:])]
        if not topk:
            return lp
        tops = [None] + [sorted(((int(i), float(v.logprob)) for i, v in row.items()), key=lambda x: -x[1])[:topk]
                         for row in rows[1:]]
        return lp, tops

    def evict(self, name: str) -> bool:
        """vLLM evicts by its own LRU (max_loras on the GPU, max_cpu_loras on the host)."""
        return False

    def stats(self) -> dict:
        """Requests per adapter name (vLLM keeps its own cache)."""
        return {"held": [], "loads": dict(self.loads), "load_s": 0.0}


class ReplicaPool:
    """The server's sampler replicas on Ray; a name always goes to the same replica (its adapter stays warm)."""

    def __init__(self, plane, *, base_dir: Path, store: str, fingerprint, replicas: int = 1,
                 max_adapters: int = 8) -> None:
        import ray

        from dsv4flash.service.compute.megatron import cluster

        cluster.connect(plane.ray_address)
        if plane.sampler == "vllm":
            actor = ray.remote(num_gpus=1)(VLLMReplica)
            self.replicas = [actor.remote(str(plane.sampler_model), str(store), max_adapters, plane.max_rank)
                             for _ in range(int(replicas))]
        else:
            actor = ray.remote(num_cpus=1)(SamplerReplica)
            self.replicas = [actor.remote(str(base_dir), str(store), fingerprint.to_json(), max_adapters)
                             for _ in range(int(replicas))]
        ray.get([r.stats.remote() for r in self.replicas])  # built: a broken base fails the server's start

    def replica(self, name: str | None):
        """The replica that serves `name`."""
        return self.replicas[zlib.crc32((name or "").encode()) % len(self.replicas)]

    def call(self, method: str, name, *args):
        """Run a replica method for `name` and wait for it."""
        import ray

        return ray.get(getattr(self.replica(name), method).remote(name, *args))

    def stats(self) -> list[dict]:
        """Every replica's `SamplerReplica.stats`."""
        import ray

        return ray.get([r.stats.remote() for r in self.replicas])

    def prometheus(self) -> str:
        """Adapters held and loads per version-qualified name, in Prometheus text format."""
        stats = self.stats()
        lines = ["# HELP dsv4flash_sampler_adapters_held Adapters loaded on each sampler replica.",
                 "# TYPE dsv4flash_sampler_adapters_held gauge"]
        lines += [f'dsv4flash_sampler_adapters_held{{replica="{i}"}} {len(st["held"])}' for i, st in enumerate(stats)]
        lines += ["# HELP dsv4flash_sampler_adapter_loads_total Loads of each adapter from the store (a second load: "
                  "it was evicted and named again).", "# TYPE dsv4flash_sampler_adapter_loads_total counter"]
        lines += [f'dsv4flash_sampler_adapter_loads_total{{replica="{i}",adapter="{name}"}} {count}'
                  for i, st in enumerate(stats) for name, count in sorted(st["loads"].items())]
        lines += ["# HELP dsv4flash_sampler_load_seconds_total Seconds sampler replicas spent loading adapters.",
                  "# TYPE dsv4flash_sampler_load_seconds_total counter",
                  f"dsv4flash_sampler_load_seconds_total {sum(st['load_s'] for st in stats):g}"]
        return "\n".join(lines) + "\n"


class ReplicaSamplingClient(SamplingClient):
    """A `SamplingClient` whose model calls run on a sampler replica, by revision (None: the bare base)."""

    remote = True
    resource = "samplers"

    def __init__(self, service, placement, revision: str | None, name: str) -> None:
        super().__init__(service, placement, None, name, revision=revision)
        self.qualified = None if revision is None else name

    def _prompt_logprobs(self, ids: list[int], topk: int = 0):
        self._check_prompt(ids)
        return self.service.replicas.call("prompt_logprobs", self.qualified, self.revision, ids, topk)

    def _sample(self, ids, n, params, seed, prompt_lp, prefill=None, topk=0, sequence_ids=None, record_for=None,
                stability=False, topk_prompt=0, on_tokens=None):
        text = self.service.base.cfg.text
        check_sample_request(ids, n, params, text.vocab_size, text.max_position_embeddings)
        stops = self.service.stop_sequences(params.stop)
        max_tokens = params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS
        out = self.service.replicas.call("sample", self.qualified, self.revision, ids, n, params, seed, stops, topk,
                                         max_tokens)
        return self._response(ids, n, out, sequence_ids, record_for, stability, topk_prompt, prompt_lp, None)


def qualified_name(policy: str, revision: str) -> str:
    """The version-qualified adapter name of a revision: `<policy>@<revision id>`."""
    return f"{policy}@{revision}"
