"""`SamplingClient`: sampling and prompt log-probs with one adapter snapshot (or the bare base) on the resident base."""

from __future__ import annotations

import itertools
import uuid

import torch
import torch.nn.functional as F

from dsv4flash.service.compute.stability import LOCAL_OWNER
from dsv4flash.service.futures import APIFuture, OrderedExecutor
from dsv4flash.service.types import ModelInput, SampledSequence, SampleResponse, SamplingParams, check_token_ids

_ids = itertools.count()


def check_sample_request(ids: list[int], num_samples: int, params: SamplingParams, vocab_size: int) -> None:
    """Raise naming the field or prompt position when a sample request is malformed."""
    if not ids:
        raise ValueError("sample: empty prompt")
    check_token_ids(ids, vocab_size, "sample: prompt")
    if num_samples < 1:
        raise ValueError(f"sample: num_samples must be ≥ 1, got {num_samples}")
    params.check()


def process_logits(last: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R,V] logits -> [R,V] log-probs of the sampling distribution (temperature, top-k, top-p applied)."""
    logits = last.float() / max(params.temperature, 1e-8)
    if params.top_k and params.top_k > 0:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return F.log_softmax(logits, dim=-1)


class SamplingClient:
    """Samples from a fixed adapter snapshot; calls return futures and run in submission order.

    `sample` prefills the prompt once and decodes every further token with the model's CSA2 cache
    (`use_cache = False` recomputes the whole sequence per token instead: the same tokens and log-probs).
    """

    use_cache = True

    def __init__(self, service, placement, adapter: dict[str, torch.Tensor] | None, name: str) -> None:
        self.service, self.placement, self.adapter, self.name = service, placement, adapter, name
        self._exec = OrderedExecutor(f"sampler-{name}-{next(_ids)}")
        self._calls = 0

    def schedule_with(self, scheduler, policy: str) -> None:
        """Run each of this client's calls as one rollout turn of `scheduler` (a `PhaseScheduler`)."""
        self._exec.gate = lambda fn: scheduler.turn(policy, "rollout")

    def get_base_model(self) -> str:
        """The base this client samples from."""
        return self.service.base.base_model

    def get_tokenizer(self):
        """The base model's tokenizer."""
        return self.service.get_tokenizer()

    record_stability_info = False  # Tinker: set per client; every sample it takes is then recorded

    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, *,
               topk_sample_logprobs: int = 0, record_stability_info: bool | None = None,
               sequence_ids: list[str] | None = None, owner: str = LOCAL_OWNER) -> APIFuture:
        """`num_samples` continuations of `prompt` -> SampleResponse (logprobs under the sampling distribution).

        Each sequence gets a `sequence_id` (`sequence_ids`, else fresh ones) and is recorded for `owner`, so
        provenance spans can name it; `stable_reinforce` trains only on those sampled with `record_stability_info`.
        `topk_sample_logprobs` k adds each sampled position's k most likely tokens of the sampling distribution;
        `topk_prompt_logprobs` k each prompt position's k most likely tokens of the model.
        """
        for name, k in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs)):
            if int(k) < 0:
                raise ValueError(f"{name}: must be ≥ 0, got {k}")
        n = int(num_samples)
        if sequence_ids is None:
            stem = uuid.uuid4().hex
            sequence_ids = [f"{stem}:{i}" for i in range(n)]
        if len(sequence_ids) != n:
            raise ValueError(f"sample: {len(sequence_ids)} sequence ids for {n} samples")
        record = self.record_stability_info if record_stability_info is None else bool(record_stability_info)
        return self._exec.submit(self._sample, prompt.to_ints(), n, sampling_params,
                                 self.next_seed(sampling_params), include_prompt_logprobs, None,
                                 int(topk_sample_logprobs), list(sequence_ids), owner, record,
                                 int(topk_prompt_logprobs))

    def next_seed(self, sampling_params: SamplingParams) -> int:
        """The seed of this client's next `sample` call (the params' seed, else one per client and call)."""
        self._calls += 1
        if sampling_params.seed is not None:
            return sampling_params.seed
        return hash((self.name, self._calls)) & 0x7FFFFFFF

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture:
        """log p(token_t | tokens_<t) for every prompt token (None for the first)."""
        return self._exec.submit(self._prompt_logprobs, prompt.to_ints())

    async def sample_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `sample`."""
        return self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, *args, **kwargs) -> APIFuture:
        """Async twin of `compute_logprobs`."""
        return self.compute_logprobs(*args, **kwargs)

    # ---- work ----
    def _model(self):
        base = self.service.base
        return base.bind(self.placement, self.adapter) if self.adapter is not None else _plain(base)

    def _prompt_logprobs(self, ids: list[int], topk: int = 0):
        """log p(token_t | tokens_<t) per prompt token (None first); with `topk` also each position's k most
        likely (token, log-prob) of the model's distribution (None first) -> (logprobs, topk rows)."""
        if not ids:
            raise ValueError("compute_logprobs: empty prompt")
        check_token_ids(ids, self.service.base.cfg.text.vocab_size, "compute_logprobs: prompt")
        with self._model() as model, torch.no_grad():
            logits = model(torch.tensor([ids]))  # [1,L,V]
        logp = F.log_softmax(logits[0, :-1].float(), -1)  # [L-1,V]: position t predicts token t+1
        lp = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        if not topk:
            return [None] + lp.tolist()
        top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        rows = [[(int(i), float(v)) for i, v in zip(ti, tv)] for ti, tv in zip(top.indices, top.values)]
        return [None] + lp.tolist(), [None] + rows

    def _sample(self, ids: list[int], n: int, params: SamplingParams, seed: int, prompt_lp: bool,
                prefill=None, topk: int = 0, sequence_ids: list[str] | None = None,
                record_for: str | None = None, stability: bool = False, topk_prompt: int = 0) -> SampleResponse:
        """prefill: a future of this client's prompt prefill computed elsewhere (shared encoder): the last
        position's logits [1, V] and the prompt's DecodeCache."""
        check_sample_request(ids, n, params, self.service.base.cfg.text.vocab_size)
        stops = self.service.stop_sequences(params.stop)
        max_tokens = params.max_tokens if params.max_tokens is not None else 16
        gen = torch.Generator().manual_seed(seed)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        live = list(range(n))
        first = prefill.result() if prefill is not None else None  # before taking the base: the prefill needs it
        with self._model() as model, torch.no_grad():
            cache = None
            for step in range(max_tokens):
                if not live:
                    break
                if step == 0 and (first is not None or self.use_cache):
                    last, cache = first if first is not None else _prompt_prefill(model, ids)  # [1,V]
                    last = last.expand(n, -1)  # every sample starts from the prompt
                    cache = cache.select([0] * n) if self.use_cache else None
                elif cache is not None:
                    last, cache = model.decode(cache, torch.tensor([tokens[r][-1] for r in live]))  # [R,V]
                else:
                    rows = torch.stack([torch.tensor(ids + tokens[r]) for r in live])  # [R, L+t]
                    last = model(rows)[:, -1]
                logp = process_logits(last, params)  # [R,V]
                if params.temperature > 0:
                    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
                else:
                    tok = logp.argmax(-1)
                if topk:
                    top = logp.topk(min(topk, logp.shape[-1]), dim=-1)  # [R,k] of the sampling distribution
                still, kept = [], []
                for j, r in enumerate(live):
                    t = int(tok[j])
                    tokens[r].append(t)
                    logps[r].append(float(logp[j, t]))
                    if topk:  # tokens the sampling distribution excludes (-inf) are not reported
                        tops[r].append([(int(i), float(v)) for i, v in zip(top.indices[j], top.values[j])
                                        if v > float("-inf")])
                    if any(tuple(tokens[r][-len(q):]) == q for q in stops):
                        reasons[r] = "stop"
                    else:
                        still.append(r)
                        kept.append(j)
                if cache is not None and still and len(still) < len(live):
                    cache = cache.select(kept)  # stopped rows leave the batch
                live = still
        sequence_ids = sequence_ids or [None] * n
        seqs_out = [SampledSequence(reasons[r], tokens[r], logps[r], sequence_ids[r], tops[r] if topk else None)
                    for r in range(n)]
        if record_for is not None:
            prompt = tuple(ids)  # tuple(tuple) is the same object: one copy for all n records
            for seq in seqs_out:
                self.service.sequences.record(record_for, seq.sequence_id, prompt, seq.tokens, seq.logprobs, stability)
        if topk_prompt:
            prompt_scores, prompt_top = self._prompt_logprobs(ids, topk_prompt)
            return SampleResponse(seqs_out, prompt_scores if prompt_lp else None, topk_prompt_logprobs=prompt_top)
        return SampleResponse(seqs_out, self._prompt_logprobs(ids) if prompt_lp else None)


def _prompt_prefill(model, ids: list[int]):
    """The prompt's last-position logits [1, V] and its DecodeCache."""
    logits, cache = model.prefill(torch.tensor([ids]))
    return logits[:, -1], cache


class _plain:
    """Context manager holding the resident base lock around the bare base model."""

    def __init__(self, base) -> None:
        self.base = base

    def __enter__(self):
        self.base.lock.acquire()
        return self.base.model

    def __exit__(self, *exc) -> None:
        self.base.lock.release()
