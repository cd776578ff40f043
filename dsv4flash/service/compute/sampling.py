"""`SamplingClient`: sampling and prompt log-probs with one adapter snapshot (or the bare base) on the resident base."""

from __future__ import annotations

import contextlib
import itertools
import uuid

import torch

from dsv4flash.engine.sampling import Decoding, Sampling, StepTokens, generate, next_token_logprobs
from dsv4flash.model.image import TEXT
from dsv4flash.service import calls
from dsv4flash.service.compute.stability import LOCAL_OWNER
from dsv4flash.service.futures import APIFuture, OrderedExecutor
from dsv4flash.service.types import (ModelInput, SampleResponse, SamplingParams, check_sampling_params, check_token_ids,
                                     sample_response, sampled_sequence)

_ids = itertools.count()


DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens=None


def check_sample_request(ids: list[int], num_samples: int, params: SamplingParams, vocab_size: int,
                         context: int) -> None:
    """Raise naming the field or prompt position when a sample request is malformed or does not fit the model's
    `context` (prompt plus max_tokens)."""
    if not ids:
        raise ValueError("sample: empty prompt")
    check_token_ids(ids, vocab_size, "sample: prompt")
    if num_samples < 1:
        raise ValueError(f"sample: num_samples must be ≥ 1, got {num_samples}")
    check_sampling_params(params)
    max_tokens = params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS
    if max_tokens > context:
        raise ValueError(f"SamplingParams.max_tokens: {max_tokens} is more than the model's context of {context} "
                         f"tokens")
    if len(ids) + max_tokens > context:
        raise ValueError(f"prompt: {len(ids)} tokens + max_tokens {max_tokens} = {len(ids) + max_tokens}, more than "
                         f"the model's context of {context} tokens (shorten the prompt or lower max_tokens)")


@torch.no_grad()
def prompt_logprobs(model, ids: list[int], topk: int = 0):
    """log p(token_t | tokens_<t) per prompt token (None first) under `model`; with `topk` also each position's k
    most likely (token, log-prob) (None first) -> (logprobs, topk rows)."""
    logp = next_token_logprobs(model, torch.tensor(ids))[:-1]  # [L-1,V]: position t predicts token t+1
    lp = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    if not topk:
        return [None] + lp.tolist()
    top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    rows = [[(int(i), float(v)) for i, v in zip(ti, tv)] for ti, tv in zip(top.indices, top.values)]
    return [None] + lp.tolist(), [None] + rows


def sample_rows(model, ids: list[int], n: int, params: SamplingParams, seed: int, stops, topk: int, pad_id: int,
                max_tokens: int, *, use_cache: bool = True, prefilled=None, before_step=None, after_step=None):
    """`n` continuations of the prompt `ids` under `model` (one generator seeded `seed` for all rows) -> the
    engine's `Rollout`: what a `SamplingClient` samples, wherever its model runs (here, or a sampler replica)."""
    row = (torch.tensor(ids), torch.full((len(ids),), TEXT), [])  # every sample starts from the prompt
    sampling = Sampling(params.temperature, params.top_k, params.top_p, processed_greedy=True)
    return generate(model, [row] * n, max_new_tokens=max_tokens, eos_id=None, pad_id=pad_id, sampling=sampling,
                    generator=torch.Generator().manual_seed(seed), use_cache=use_cache, stop=stops, topk=topk,
                    share_prefixes=False, prefilled=prefilled, before_step=before_step, after_step=after_step)


class SamplingClient:
    """Samples from a fixed adapter snapshot; calls return futures and run in submission order.

    `sample` prefills the prompt once and decodes every further token with the model's CSA2 cache
    (`use_cache = False` recomputes the whole sequence per token instead: the same tokens and log-probs).

    On a service with a serving path (`service.serving`, what `dsv4flash serve` sets up) a call runs on the
    serving threads instead of this client's own (calls of one client run concurrently there), a client made
    for a stored `revision` takes its adapter from the tiers for each call (a lease on a device slot), and the
    tokens come from the continuous batcher: the same tokens as alone (`compute/batcher.py`).
    """

    use_cache = True
    remote = False  # a replica's client (compute/replicas.py): its calls leave this process, not the serving path
    resource = "base"  # what its compute occupies: the server's scheduler for it grants the turns

    def __init__(self, service, placement, adapter: dict[str, torch.Tensor] | None, name: str,
                 revision: str | None = None, loaded=None) -> None:
        self.service, self.placement, self.adapter, self.name = service, placement, adapter, name
        self.revision = revision  # a stored revision served through the tiers (adapter None until a call holds it)
        # The LoadFigure of the load this client's creation did (it reads the revision to check it): the first
        # `sample` reports it, so the request a client was made for shows the cold load it waited for.
        self._creation_load = loaded if loaded is not None and loaded.tier != "resident" else None
        self._exec = OrderedExecutor(f"sampler-{name}-{next(_ids)}")
        self._calls = 0

    def schedule_with(self, scheduler, policy: str, tenant: str = "") -> None:
        """Run each of this client's calls as one rollout turn of `scheduler` (a `PhaseScheduler`) for `tenant`."""
        self._exec.gate = lambda fn: scheduler.turn(policy, "rollout", tenant)

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
               sequence_ids: list[str] | None = None, owner: str = LOCAL_OWNER,
               on_tokens: StepTokens | None = None) -> APIFuture:
        """`num_samples` continuations of `prompt` -> SampleResponse (logprobs under the sampling distribution).

        Each sequence gets a `sequence_id` (`sequence_ids`, else fresh ones) and is recorded for `owner`, so
        provenance spans can name it; `stable_reinforce` trains only on those sampled with `record_stability_info`.
        `topk_sample_logprobs` k adds each sampled position's k most likely tokens of the sampling distribution;
        `topk_prompt_logprobs` k each prompt position's k most likely tokens of the model. `on_tokens(samples,
        tokens, logprobs, top)` is called on the decoding thread after each decode step with the samples that drew
        a token, those tokens, their log-probs and top lists (`engine.sampling.Decoding`'s `after_step`: streamed
        answers, from the batcher too); it must return quickly.
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
        serving = getattr(self.service, "serving", None)
        submit = serving.submit if serving is not None and self.use_cache and not self.remote else self._exec.submit
        return submit(self._sample, prompt.to_ints(), n, sampling_params, self.next_seed(sampling_params),
                      include_prompt_logprobs, None, int(topk_sample_logprobs), list(sequence_ids), owner, record,
                      int(topk_prompt_logprobs), on_tokens)

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
    @contextlib.contextmanager
    def _held(self):
        """(placement, adapter tensors or None, LoadFigure or None) for one call: the client's own, or a lease
        on the tiers' device slot of its revision for the duration of the block."""
        if self.revision is None:
            yield self.placement, self.adapter, None
            return
        with self.service.serving.adapter(self.revision) as (placement, tensors, figure):
            yield placement, tensors, figure

    @contextlib.contextmanager
    def _model(self):
        """The bound shell (or the bare base) for CPU tensors in and out, wherever the base computes."""
        from dsv4flash.engine.device import on_device

        base = self.service.base
        with self._held() as (placement, adapter, _):
            with base.bind(placement, adapter) if adapter is not None else base.bare() as model:
                yield on_device(model, base.device)

    def _prompt_logprobs(self, ids: list[int], topk: int = 0):
        """log p(token_t | tokens_<t) per prompt token (None first); with `topk` also each position's k most
        likely (token, log-prob) of the model's distribution (None first) -> (logprobs, topk rows)."""
        self._check_prompt(ids)
        with self._model() as model:
            return prompt_logprobs(model, ids, topk)

    def _check_prompt(self, ids: list[int]) -> None:
        """Raise naming the field when a prompt to score is empty, outside the vocabulary or too long."""
        if not ids:
            raise ValueError("compute_logprobs: empty prompt")
        text = self.service.base.cfg.text
        check_token_ids(ids, text.vocab_size, "compute_logprobs: prompt")
        if len(ids) > text.max_position_embeddings:  # a longer prompt runs until allocation fails
            raise ValueError(f"compute_logprobs: prompt: {len(ids)} tokens, more than the model's context of "
                             f"{text.max_position_embeddings} tokens")

    def _sample(self, ids: list[int], n: int, params: SamplingParams, seed: int, prompt_lp: bool,
                prefill=None, topk: int = 0, sequence_ids: list[str] | None = None,
                record_for: str | None = None, stability: bool = False, topk_prompt: int = 0,
                on_tokens: StepTokens | None = None) -> SampleResponse:
        """prefill: a future of this client's prompt prefill computed elsewhere (shared encoder): the last
        position's logits [1, V] and the prompt's DecodeCache."""
        text = self.service.base.cfg.text
        check_sample_request(ids, n, params, text.vocab_size, text.max_position_embeddings)
        stops = self.service.stop_sequences(params.stop)
        max_tokens = params.max_tokens if params.max_tokens is not None else DEFAULT_MAX_TOKENS
        row = (torch.tensor(ids), torch.full((len(ids),), TEXT), [])  # every sample starts from the prompt
        sampling = Sampling(params.temperature, params.top_k, params.top_p, processed_greedy=True)
        first = prefill.result() if prefill is not None else None  # before taking the base: the prefill needs it
        serving = getattr(self.service, "serving", None)
        figure = None
        if serving is not None and self.use_cache:
            from dsv4flash.service.compute.batcher import Entry

            with self._held() as (placement, adapter, figure):
                figure = self._with_creation_load(figure)
                state = Decoding([row] * n, max_new_tokens=max_tokens, eos_id=None,
                                 pad_id=self.service.base.cfg.pad_token_id, sampling=sampling,
                                 generator=torch.Generator().manual_seed(seed), stop=stops, topk=topk,
                                 share_prefixes=False, after_step=on_tokens)
                entry = Entry(placement, adapter) if adapter is not None else Entry()
                out = serving.batcher.run(entry, row, state, token=calls.current(), tenant=record_for or "",
                                          prefilled=None if first is None else _Ready(first))
            return self._response(ids, n, out, sequence_ids, record_for, stability, topk_prompt, prompt_lp, figure)
        with contextlib.ExitStack() as bound:
            def between_steps(step: int):
                calls.check()  # cancelled or past its deadline: stop before the next token
                if step and calls.owed():  # another tenant's turn: unbind, wait, rebind (the cache is ours)
                    bound.close()
                    calls.hand_over()
                    return bound.enter_context(self._model())
                return None

            out = sample_rows(bound.enter_context(self._model()), ids, n, params, seed, stops, topk,
                              self.service.base.cfg.pad_token_id, max_tokens, use_cache=self.use_cache,
                              prefilled=first, before_step=between_steps, after_step=on_tokens)
        return self._response(ids, n, out, sequence_ids, record_for, stability, topk_prompt, prompt_lp, figure)

    def _with_creation_load(self, figure):
        """The first sample's LoadFigure with the creation's load folded in (taken once: concurrent first calls
        report it once); later calls report their own."""
        from dsv4flash.service.compute.serving import LoadFigure

        created = self.__dict__.pop("_creation_load", None)  # one atomic take under the GIL
        if created is None or figure is None:
            return figure
        return LoadFigure(created.tier, created.wait_ms + figure.wait_ms, created.load_ms + figure.load_ms)

    def _response(self, ids, n, out, sequence_ids, record_for, stability, topk_prompt, prompt_lp,
                  figure) -> SampleResponse:
        """The SampleResponse of a finished rollout (sequences recorded for `record_for`, prompt log-probs)."""
        tokens = [out.response(r) for r in range(n)]
        logps = [out.response_logprobs(r) for r in range(n)]
        reasons = ["stop" if bool(out.stopped[r]) else "length" for r in range(n)]
        tops = out.top or [None] * n
        sequence_ids = sequence_ids or [None] * n
        seqs_out = [sampled_sequence(reasons[r], tokens[r], logps[r], sequence_ids[r], tops[r])
                    for r in range(n)]
        if record_for is not None:
            prompt = tuple(ids)  # tuple(tuple) is the same object: one copy for all n records
            for seq in seqs_out:
                self.service.sequences.record(record_for, seq.sequence_id, prompt, seq.tokens, seq.logprobs, stability)
        if topk_prompt:
            prompt_scores, prompt_top = self._prompt_logprobs(ids, topk_prompt)
        else:
            prompt_scores, prompt_top = (self._prompt_logprobs(ids) if prompt_lp else None), None
        return sample_response(seqs_out, prompt_scores if prompt_lp else None, topk_prompt_logprobs=prompt_top,
                               load=None if figure is None else figure.as_dict())


class _Ready:
    """A computed value behind a future's `result()` (a shared prefill handed to the batcher)."""

    def __init__(self, value) -> None:
        self.value = value

    def result(self, timeout: float | None = None):
        """The value."""
        return self.value
