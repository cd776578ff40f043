"""Multi-adapter sampling with a shared encoder: one prompt, N sampling clients, the prefill shared.

`sample_shared(clients, prompt, n, params)` gives each client exactly what `client.sample(prompt, n, params)`
gives (same seed sequence, same tokens, same log-probs: tested), but the prompt prefill runs the encoder half
and the source compressed KV once for every decoder-only, KV-write-frozen adapter
(`shared_encoder.multi_adapter_logits(..., caches=True)`) and only the decoder half per adapter. Each client
then decodes its own continuations from a prompt cache whose encoder window KV and compressed-KV segments
are the same tensors for every sharing adapter (each adapter owns only its decoder layers' window KV).
Clients that cannot share (not decoder-only, KV write trained, or the bare base) take their own prefill; the
reasons are reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4flash.service.futures import APIFuture, OrderedExecutor
from dsv4flash.service.types import ModelInput, SamplingParams

_PREFILL: OrderedExecutor | None = None  # one worker for every shared prefill, started on first use


def _prefill_executor() -> OrderedExecutor:
    global _PREFILL
    if _PREFILL is None:
        _PREFILL = OrderedExecutor("shared-prefill")
    return _PREFILL


@dataclass
class SharedSampling:
    """One future per client (SampleResponse, in client order) and which clients shared the prefill."""

    futures: list[APIFuture]
    shared: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)

    def result(self, timeout: float | None = None) -> list:
        """Every client's SampleResponse."""
        return [f.result(timeout) for f in self.futures]


def sample_shared(clients: list, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
                  include_prompt_logprobs: bool = False) -> SharedSampling:
    """`client.sample(prompt, num_samples, sampling_params)` for every client, sharing the encoder prefill."""
    from dsv4flash.service.compute.sampling import check_sample_request
    from dsv4flash.service.compute.shared_encoder import sharing_refusal

    if not clients:
        raise ValueError("sample_shared: no sampling clients given")
    service = clients[0].service
    if any(c.service.base is not service.base for c in clients):
        raise ValueError("sample_shared: every client must sample from the same resident base")
    ids = prompt.to_ints()
    text = service.base.cfg.text
    check_sample_request(ids, int(num_samples), sampling_params, text.vocab_size, text.max_position_embeddings)
    out = SharedSampling([])
    for i, c in enumerate(clients):
        reason = ("no adapter: the bare base runs its own prefill" if c.adapter is None
                  else sharing_refusal(service.base, c.placement))
        if reason is None:
            out.shared.append(i)
        else:
            out.refused[i] = reason
    prefill = None
    if out.shared:
        rows = torch.tensor([ids])  # [1, P]: the prompt `sample` prefills before fanning out to its samples
        adapters = [(clients[i].placement, clients[i].adapter) for i in out.shared]
        prefill = _prefill_executor().submit(_prefill, service.base, rows, adapters)
    for i, c in enumerate(clients):
        first = _Pick(prefill, out.shared.index(i)) if i in out.shared else None
        out.futures.append(c._exec.submit(c._sample, ids, int(num_samples), sampling_params,
                                          c.next_seed(sampling_params), include_prompt_logprobs, first))
    return out


def _prefill(base, rows: torch.Tensor, adapters: list[tuple]) -> list[tuple]:
    """(last-position logits [1, V], prompt DecodeCache) per shared adapter (encoder once: bit-equal)."""
    from dsv4flash.service.compute.shared_encoder import multi_adapter_logits

    result = multi_adapter_logits(base, rows, adapters, caches=True)
    return [(logits[:, -1], cache) for logits, cache in zip(result.logits, result.caches)]


class _Pick:
    """One adapter's slice of the shared prefill future (what `_sample` waits on)."""

    def __init__(self, prefill: APIFuture, index: int) -> None:
        self.prefill, self.index = prefill, index

    def result(self, timeout: float | None = None) -> tuple:
        """That adapter's prompt prefill: (last-position logits [1, V], DecodeCache)."""
        return self.prefill.result(timeout)[self.index]
