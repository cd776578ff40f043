"""The one decode loop: autoregressive sampling with the reference model, cached (CSA2) or full recompute.

Every front end samples through `generate` (one call) or its step state `Decoding` (`plan` / `advance`, what
`generate` drives; the service's continuous batcher, `service/compute/batcher.py`, drives many at once): the local engine's GRPO rollouts and evaluation
(`engine/algorithms.py`, `engine/evaluate.py`), the Tinker service's `SamplingClient.sample`
(`service/compute/sampling.py`) and the veRL rollout backend (`integrations/verl/rollout/engine.py`).

Given a model with `prefill`/`decode` (the reference `Transformer`, LoRA applied or not), each distinct prompt
is prefilled once and every new token costs one cached decode step (dsv4flash/model/decode.py). Given any
other `(ids, types, images) -> logits` callable, every step recomputes the whole sequence: prompts are
right-padded into one buffer; right padding never changes a causal prefix, so each row reads its next-token
distribution at its own last position. Both paths draw the same random numbers in the same order. The
log-prob of every sampled token under the sampling distribution (`process_logits`: temperature, top-k, top-p
applied, like vLLM's processed log-probs) is returned with it: those are the rollout log-probs the GRPO
correction compares against.

With `share_prefixes`, rows that share a prompt (a GRPO group) and have sampled the same tokens so far have the
same next-token distribution, so each step runs the model once per distinct (prompt, prefix) and fans the
logits out: the first token of a group costs one row instead of `group_size`, and short answers collapse
further. Without it every row decodes as its own batch row (the service's layout: a batch of a different size
rounds differently in CPU GEMMs, so the two layouts agree only to fp32 rounding). With the cache, the rows of
one prompt decode as one batch forked from their parents' caches.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import math

import numpy as np
import torch
import torch.nn.functional as F

ForwardFn = Callable[[torch.Tensor, torch.Tensor, list], torch.Tensor]  # (ids [B,S], types [B,S], images) -> logits
StepTokens = Callable[[list[int], list[int], list[float], list | None], None]  # (rows, tokens, logprobs, top)


@dataclass
class Rollout:
    """Generated continuations: ids [B, T] (pad after a stop / the end), their sampled log-probs [B, T], mask
    [B, T]; `stopped` [B] whether a row ended on eos or a stop sequence (else it ran out of tokens); `top` per
    row and step the k most likely (token, log-prob) of the sampling distribution (with `topk`)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    stopped: torch.Tensor | None = None
    top: list[list[list[tuple[int, float]]]] | None = None

    def response(self, row: int) -> list[int]:
        """The generated ids of one row, eos included when it was produced."""
        return self.tokens[row][self.mask[row]].tolist()

    def response_logprobs(self, row: int) -> list[float]:
        """The sampled log-probs of one row's generated ids."""
        return self.logprobs[row][self.mask[row]].tolist()


def has_cache(forward) -> bool:
    """Whether `forward` decodes incrementally (a model with `prefill` and `decode`)."""
    return callable(getattr(forward, "prefill", None)) and callable(getattr(forward, "decode", None))


def process_logits(last: torch.Tensor, params) -> torch.Tensor:
    """[R,V] logits -> [R,V] log-probs of the sampling distribution (`params`' temperature, top_k, top_p applied)."""
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


@torch.no_grad()
def next_token_logprobs(model, ids: torch.Tensor, types: torch.Tensor | None = None,
                        images: Sequence = ()) -> torch.Tensor:
    """One sequence ids [S] (image spans expanded) -> [S, V] fp32 log-probs of the model's next-token distribution
    at every position (row t scores token t + 1; no temperature): the prompt log-probs every front end reports."""
    logits = model(ids[None], None if types is None else types[None], list(images))  # [1,S,V]
    return torch.log_softmax(logits[0].float(), dim=-1)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_sampling_params(*, max_tokens, temperature, top_k, top_p, seed, owner: str = "SamplingParams") -> None:
    """Raise naming `owner.field` when a decoding parameter is out of range (a silent fallback would sample
    wrongly): the one check of the Tinker service's SamplingParams and the veRL rollout's sampling_params."""
    if max_tokens is not None and (not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise ValueError(f"{owner}.max_tokens: expected an integer ≥ 1 (or None), got {max_tokens!r}")
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{owner}.temperature: expected a finite number ≥ 0, got {temperature!r}")
    if not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < -1:
        raise ValueError(f"{owner}.top_k: expected an integer ≥ 1, or 0/-1 for no limit, got {top_k!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"{owner}.top_p: expected a number in (0, 1], got {top_p!r}")
    if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
        raise ValueError(f"{owner}.seed: expected an integer or None, got {seed!r}")


@dataclass(frozen=True)
class Sampling:
    """How `generate` draws each token: temperature (0 = greedy), top_k (≤ 0: no limit), top_p (1: no nucleus).

    processed_greedy: at temperature 0 report the log-probs of `process_logits`' distribution and take its argmax
    (the Tinker service: ≈ 0 for the chosen token) instead of the model's log-softmax and the logits' argmax
    (vLLM's greedy, the engine and the veRL rollout)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    processed_greedy: bool = False

    def draw(self, last: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[R,V] fp32 logits -> (tokens [R], log-probs [R,V] of the distribution they were drawn from)."""
        if self.temperature > 0:
            logp = process_logits(last, self)
            return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1), logp
        if self.processed_greedy:
            logp = process_logits(last, self)
            return logp.argmax(-1), logp
        return last.argmax(-1), torch.log_softmax(last, dim=-1)


@dataclass
class StepPlan:
    """What one decode step needs: the live rows [L], one model row per distinct (prompt, node) key (`keys`, in
    order; `uniq` [U] a representative row of each, `inverse` [L] each live row's key), each key's key of the last
    step and the token that extends it (None at the first step)."""

    step: int
    live: torch.Tensor
    keys: list[tuple[int, int]]
    inverse: torch.Tensor
    uniq: torch.Tensor
    parents: list[tuple[int, int]] | None
    extend: list[int] | None


class Decoding:
    """One `generate` call between its steps: `plan()` the next step, `advance(logits)` with its next-token
    logits, until `finished`; `rollout()` is the result. `generate` drives one; the service's continuous batcher
    (dsv4flash/service/compute/batcher.py) drives many at once, one model pass per step for all of them."""

    def __init__(self, prompts: Sequence[tuple[torch.Tensor, torch.Tensor, list]], *, max_new_tokens: int,
                 eos_id: int | None, pad_id: int, sampling: Sampling, generator: torch.Generator | None,
                 stop: Sequence[tuple[int, ...]] = (), topk: int = 0, share_prefixes: bool = True,
                 after_step: StepTokens | None = None) -> None:
        from dsv4flash.model.image import TEXT

        self.prompts, self.sampling, self.generator = prompts, sampling, generator
        self.after_step = after_step  # (rows, tokens, logprobs, top) after each step: streamed answers
        self.max_new_tokens, self.topk, self.share_prefixes = max_new_tokens, topk, share_prefixes
        bsz = len(prompts)
        # Prompt identity: rows given the very same prompt object (or equal ids/types without images) share it.
        prompt_key: dict = {}
        self.prompt_of = [prompt_key.setdefault(id(p) if p[2] else (tuple(p[0].tolist()), tuple(p[1].tolist())),
                                                len(prompt_key)) for p in prompts]
        self.n_prompts = len(prompt_key)
        self.lengths = torch.tensor([int(p[0].numel()) for p in prompts])
        width = int(self.lengths.max()) + max_new_tokens
        self.ids = torch.full((bsz, width), pad_id, dtype=torch.int64)
        self.types = torch.full((bsz, width), TEXT, dtype=torch.int64)
        self.row_images: list[list] = []
        for b, (p_ids, p_types, p_imgs) in enumerate(prompts):
            self.ids[b, : p_ids.numel()], self.types[b, : p_ids.numel()] = p_ids, p_types
            self.row_images.append(list(p_imgs))
        self.out_tokens = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.int64)
        self.out_logp = torch.zeros((bsz, max_new_tokens))
        self.out_mask = torch.zeros((bsz, max_new_tokens), dtype=torch.bool)
        self.done = torch.zeros(bsz, dtype=torch.bool)
        self.top: list[list] = [[] for _ in range(bsz)]
        stops = [tuple(int(t) for t in q) for q in stop] + ([(int(eos_id),)] if eos_id is not None else [])
        self.stop_tokens = torch.tensor([q[0] for q in stops if len(q) == 1], dtype=torch.int64)
        self.stop_runs = [q for q in stops if len(q) > 1]  # sequences, matched against each row's last tokens
        # The node of each row's prefix: 0 = the bare prompt, shared by every row of it; without share_prefixes
        # every row is a node of its own for good (-1 - row), so each decodes as its own batch row.
        self.node = [0 if share_prefixes else -1 - b for b in range(bsz)]
        self.parent = list(self.node)
        self.nodes: dict[tuple[int, int, int], int] = {}
        self.step = 0

    @property
    def finished(self) -> bool:
        """Every row stopped, or every row has its `max_new_tokens`."""
        return self.step >= self.max_new_tokens or bool(self.done.all())

    def plan(self) -> StepPlan:
        """The keys of the next step: one model row per distinct (prompt, generated prefix) among the live rows
        (each row its own without share_prefixes); a key's parent is its row's key of the last step."""
        t, live = self.step, (~self.done).nonzero().flatten()  # [L]
        key_of: dict = {}
        inverse = torch.tensor([key_of.setdefault((self.prompt_of[b], self.node[b]), len(key_of))
                                for b in live.tolist()])
        uniq = torch.tensor(_firsts(len(key_of), live.tolist(), inverse))  # [U] a representative row per key
        parents = [(self.prompt_of[b], self.parent[b]) for b in uniq.tolist()] if t else None
        extend = self.out_tokens[uniq, t - 1].tolist() if t else None
        return StepPlan(t, live, list(key_of), inverse, uniq, parents, extend)

    def advance(self, plan: StepPlan, last: torch.Tensor) -> None:
        """Draw this step's tokens from `last` [L,V] fp32 (the live rows' next-token logits) and record them."""
        t, live = plan.step, plan.live
        tok, logp = self.sampling.draw(last, self.generator)
        for b, k in zip(live.tolist(), tok.tolist()):
            self.parent[b] = self.node[b]
            if self.share_prefixes:  # equal (prompt, prefix) <=> equal node: one id per (prompt, parent, token)
                self.node[b] = self.nodes.setdefault((self.prompt_of[b], self.node[b], k), len(self.nodes) + 1)
        self.out_tokens[live, t] = tok
        self.out_logp[live, t] = logp[torch.arange(live.numel()), tok]
        self.out_mask[live, t] = True
        self.ids[live, self.lengths[live]] = tok
        self.lengths[live] += 1
        if self.topk:  # tokens the sampling distribution excludes (-inf) are not reported
            best = logp.topk(min(self.topk, logp.shape[-1]), dim=-1)  # [L,k]
            for j, b in enumerate(live.tolist()):
                self.top[b].append([(int(i), float(v)) for i, v in zip(best.indices[j], best.values[j])
                                    if v > float("-inf")])
        if self.after_step is not None:
            self.after_step(live.tolist(), tok.tolist(), self.out_logp[live, t].tolist(),
                            [self.top[b][-1] for b in live.tolist()] if self.topk else None)
        self.done[live] = torch.isin(tok, self.stop_tokens)
        if self.stop_runs:
            self.done[live] |= torch.tensor([any(tuple(self.out_tokens[b, max(t + 1 - len(q), 0): t + 1].tolist())
                                                 == q for q in self.stop_runs) for b in live.tolist()],
                                            dtype=torch.bool)
        self.step += 1

    def rollout(self) -> Rollout:
        """The generated continuations so far."""
        return Rollout(self.out_tokens, self.out_logp, self.out_mask, self.done, self.top if self.topk else None)


@torch.no_grad()
def generate(forward: ForwardFn, prompts: Sequence[tuple[torch.Tensor, torch.Tensor, list]], *, max_new_tokens: int,
             eos_id: int | None, pad_id: int, temperature: float = 1.0, sampling: Sampling | None = None,
             generator: torch.Generator | None = None, autocast_dtype: torch.dtype | None = None,
             use_cache: bool | None = None, stop: Sequence[tuple[int, ...]] = (), topk: int = 0,
             share_prefixes: bool = True, prefilled: tuple | None = None,
             before_step: Callable[[int], ForwardFn | None] | None = None,
             after_step: StepTokens | None = None) -> Rollout:
    """Sample up to `max_new_tokens` per prompt; a row stops at `eos_id` (None: never) or any `stop` sequence.

    sampling: how each token is drawn; `temperature` alone is `Sampling(temperature)` (greedy when 0).
    use_cache: None = cached decode whenever `forward` has `prefill`/`decode`; False forces full recompute.
    topk: also keep each step's k most likely tokens of the sampling distribution (`Rollout.top`).
    prefilled: (last-position logits [1,V], DecodeCache) of the one prompt every row shares, computed elsewhere
    (the service's shared encoder); used instead of prefilling it.
    before_step(step): called before each step that has live rows (step 0 included); it may raise to stop the
    call (the service's cancel and deadline) or return the forward to go on with (a rebound model).
    after_step(rows, tokens, logprobs, top): called after each step with the rows that drew a token, those
    tokens, their sampled log-probs and (with `topk`) each row's top list of this step (the service's streamed
    answers).
    """
    if sampling is not None and temperature != 1.0:
        raise ValueError("generate: give the temperature in `sampling` or as `temperature`, not both")
    state = Decoding(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
                     sampling=sampling if sampling is not None else Sampling(temperature), generator=generator,
                     stop=stop, topk=topk, share_prefixes=share_prefixes, after_step=after_step)
    if prefilled is not None and state.n_prompts != 1:
        raise ValueError(f"generate(prefilled=...): the rows must share one prompt, got {state.n_prompts}")
    # the forward's own device type (`DeviceForward.device_type`: a model on CUDA), else the CPU
    cast = (torch.autocast(getattr(forward, "device_type", "cpu"), dtype=autocast_dtype) if autocast_dtype is not None
            else nullcontext())
    cached = has_cache(forward) if use_cache is None else use_cache
    if cached and not has_cache(forward):
        raise ValueError("generate(use_cache=True): forward has no prefill/decode (pass the reference model)")
    decoder = _CachedRows(forward, prompts, state.prompt_of, cast, prefilled) if cached else None
    while not state.finished:
        t = state.step
        if before_step is not None and (rebound := before_step(t)) is not None:
            forward = rebound
            if decoder is not None:
                decoder.model = rebound
        plan = state.plan()
        if decoder is not None:
            last = decoder.step(plan.keys, plan.parents, plan.extend)[plan.inverse].float()  # [L,V]
        elif t == 0 and prefilled is not None:
            last = prefilled[0].float().expand(plan.live.numel(), -1)  # [L,V]
        else:
            seqlen = int(state.lengths[plan.uniq].max())
            with cast:
                logits = forward(state.ids[plan.uniq, :seqlen], state.types[plan.uniq, :seqlen],
                                 [img for b in plan.uniq.tolist() for img in state.row_images[b]])  # [U,seqlen,V]
            last = logits[plan.inverse, state.lengths[plan.live] - 1].float()  # [L,V]
        state.advance(plan, last)
    return state.rollout()


class _CachedRows:
    """Next-token logits per distinct (prompt, node) key from cached decode steps.

    Each prompt is prefilled once; at every step the keys of one prompt decode as one batch, each row forked
    (`DecodeCache.select`) from its parent key's row of the last step with the token that extends it.
    """

    def __init__(self, model, prompts, prompt_of: list[int], cast, prefilled: tuple | None) -> None:
        self.model, self.prompts, self.prompt_of, self.cast = model, prompts, prompt_of, cast
        # prompt -> (cache over its keys of the last step, {key: row} (None: the prompt's prefill), logits)
        self.rows: dict[int, tuple] = {}
        if prefilled is not None:
            self.rows[0] = (prefilled[1], None, prefilled[0])

    def step(self, keys: list[tuple[int, int]], parents: list[tuple[int, int]] | None,
             tokens: list[int] | None) -> torch.Tensor:
        """This step's keys [(prompt, node)], each one's key of the last step (None at the first step) and the
        token that extends it -> last-position logits [len(keys), V]."""
        by_prompt: dict[int, list[int]] = {}
        for i, (p, _) in enumerate(keys):
            by_prompt.setdefault(p, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for p, members in by_prompt.items():
            if p not in self.rows:
                p_ids, p_types, p_imgs = self.prompts[self.prompt_of.index(p)]
                with self.cast:
                    logits, cache = self.model.prefill(p_ids[None], p_types[None], list(p_imgs))
                self.rows[p] = (cache, None, logits[:, -1])
            cache, row_of, logits = self.rows[p]
            if parents is None:  # the first step: every key reads the prompt's last position
                row_of = {keys[i]: 0 for i in members}
            else:
                rows = torch.tensor([row_of[parents[i]] for i in members])
                with self.cast:
                    logits, cache = self.model.decode(cache.select(rows), torch.tensor([tokens[i] for i in members]))
                row_of = {keys[i]: r for r, i in enumerate(members)}
            self.rows[p] = (cache, row_of, logits)
            for i in members:
                out[i] = logits[row_of[keys[i]]]
        return torch.stack(out)


def _firsts(n_keys: int, rows: list[int], inverse: torch.Tensor) -> list[int]:
    """The first row of each distinct key, in key order."""
    first: dict[int, int] = {}
    for row, k in zip(rows, inverse.tolist()):
        first.setdefault(k, row)
    return [first[k] for k in range(n_keys)]
