"""Autoregressive sampling with the reference model: incremental decode with the CSA2 cache, or full recompute.

Given a model with `prefill`/`decode` (the reference `Transformer`, LoRA applied or not), each distinct prompt
is prefilled once and every new token costs one cached decode step (dsv4flash/model/decode.py). Given any
other `(ids, types, images) -> logits` callable, every step recomputes the whole sequence: prompts are
right-padded into one buffer; right padding never changes a causal prefix, so each row reads its next-token
distribution at its own last position. Both paths draw the same random numbers in the same order. The
log-prob of every sampled token under the sampling distribution (temperature applied, like vLLM's processed
log-probs) is returned with it: those are the rollout log-probs the GRPO correction compares against.

Rows that share a prompt (a GRPO group) and have sampled the same tokens so far have the same next-token
distribution, so each step runs the model once per distinct (prompt, prefix) and fans the logits out: the
first token of a group costs one row instead of `group_size`, and short answers collapse further. With the
cache, the distinct prefixes of one prompt decode as one batch whose rows fork from their parents' caches.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

ForwardFn = Callable[[torch.Tensor, torch.Tensor, list], torch.Tensor]  # (ids [B,S], types [B,S], images) -> logits


@dataclass
class Rollout:
    """Generated continuations: ids [B, T] (pad after eos / the end), their sampled log-probs [B, T], mask [B, T]."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor

    def response(self, row: int) -> list[int]:
        """The generated ids of one row, eos included when it was produced."""
        return self.tokens[row][self.mask[row]].tolist()


def has_cache(forward) -> bool:
    """Whether `forward` decodes incrementally (a model with `prefill` and `decode`)."""
    return callable(getattr(forward, "prefill", None)) and callable(getattr(forward, "decode", None))


@torch.no_grad()
def generate(forward: ForwardFn, prompts: Sequence[tuple[torch.Tensor, torch.Tensor, list]], *, max_new_tokens: int,
             eos_id: int, pad_id: int, temperature: float = 1.0, generator: torch.Generator | None = None,
             autocast_dtype: torch.dtype | None = None, use_cache: bool | None = None,
             logprobs_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Rollout:
    """Sample up to `max_new_tokens` per prompt (greedy when temperature == 0); rows stop at eos.

    use_cache: None = cached decode whenever `forward` has `prefill`/`decode`; False forces full recompute.
    logprobs_fn: [R,V] fp32 logits -> [R,V] log-probs of the sampling distribution, replacing the plain
    temperature softmax when temperature > 0 (e.g. `dsv4flash.service.compute.sampling.process_logits`: top-k/top-p).
    """
    from dsv4flash.model.image import TEXT

    bsz = len(prompts)
    # Prompt identity: rows given the very same prompt object (or equal ids/types without images) share it.
    prompt_key: dict = {}
    prompt_of = [prompt_key.setdefault(id(p) if p[2] else (tuple(p[0].tolist()), tuple(p[1].tolist())),
                                       len(prompt_key)) for p in prompts]
    lengths = torch.tensor([int(p[0].numel()) for p in prompts])
    width = int(lengths.max()) + max_new_tokens
    ids = torch.full((bsz, width), pad_id, dtype=torch.int64)
    types = torch.full((bsz, width), TEXT, dtype=torch.int64)
    row_images: list[list] = []
    for b, (p_ids, p_types, p_imgs) in enumerate(prompts):
        ids[b, : p_ids.numel()], types[b, : p_ids.numel()] = p_ids, p_types
        row_images.append(list(p_imgs))
    out_tokens = torch.full((bsz, max_new_tokens), pad_id, dtype=torch.int64)
    out_logp = torch.zeros((bsz, max_new_tokens))
    out_mask = torch.zeros((bsz, max_new_tokens), dtype=torch.bool)
    done = torch.zeros(bsz, dtype=torch.bool)
    cast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    cached = has_cache(forward) if use_cache is None else use_cache
    if cached and not has_cache(forward):
        raise ValueError("generate(use_cache=True): forward has no prefill/decode (pass the reference model)")
    decoder = _CachedRows(forward, prompts, prompt_of, cast) if cached else None
    for t in range(max_new_tokens):
        live = (~done).nonzero().flatten()  # [L]
        # One model row per distinct (prompt, generated prefix) among the live rows.
        key_of: dict = {}
        inverse = torch.tensor([key_of.setdefault((prompt_of[b], tuple(out_tokens[b, :t].tolist())), len(key_of))
                                for b in live.tolist()])
        uniq = torch.tensor(_firsts(len(key_of), live.tolist(), inverse))  # [U] a representative row per key
        if decoder is not None:
            last = decoder.step(list(key_of))[inverse].float()  # [L,V]
        else:
            seqlen = int(lengths[uniq].max())
            with cast:
                logits = forward(ids[uniq, :seqlen], types[uniq, :seqlen],
                                 [img for b in uniq.tolist() for img in row_images[b]])  # [U,seqlen,V]
            last = logits[inverse, lengths[live] - 1].float()  # [L,V]
        if temperature > 0:
            logp = logprobs_fn(last) if logprobs_fn is not None else torch.log_softmax(last / temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        else:
            logp = torch.log_softmax(last, dim=-1)
            tok = last.argmax(-1)
        out_tokens[live, t] = tok
        out_logp[live, t] = logp[torch.arange(live.numel()), tok]
        out_mask[live, t] = True
        ids[live, lengths[live]] = tok
        lengths[live] += 1
        done[live] = tok == eos_id
        if bool(done.all()):
            break
    return Rollout(out_tokens, out_logp, out_mask)


class _CachedRows:
    """Next-token logits per distinct (prompt, prefix) key from cached decode steps.

    Each prompt is prefilled once; at every step the keys of one prompt decode as one batch, each row
    forked (`DecodeCache.select`) from its parent key's row with the token that extends it.
    """

    def __init__(self, model, prompts, prompt_of: list[int], cast) -> None:
        self.model, self.prompts, self.prompt_of, self.cast = model, prompts, prompt_of, cast
        self.rows: dict[int, tuple] = {}  # prompt -> (cache over its keys of the last step, {key: row}, logits)

    def step(self, keys: list[tuple[int, tuple[int, ...]]]) -> torch.Tensor:
        """keys [(prompt, prefix)] of this step -> last-position logits [len(keys), V]."""
        by_prompt: dict[int, list[int]] = {}
        for i, (p, _) in enumerate(keys):
            by_prompt.setdefault(p, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for p, members in by_prompt.items():
            if p not in self.rows:
                p_ids, p_types, p_imgs = self.prompts[self.prompt_of.index(p)]
                with self.cast:
                    logits, cache = self.model.prefill(p_ids[None], p_types[None], list(p_imgs))
                self.rows[p] = (cache, {(): 0}, logits[:, -1])
            cache, row_of, logits = self.rows[p]
            prefixes = [keys[i][1] for i in members]
            if any(prefix not in row_of for prefix in prefixes):  # this step extends the last step's prefixes
                parents = torch.tensor([row_of[prefix[:-1]] for prefix in prefixes])
                with self.cast:
                    logits, cache = self.model.decode(cache.select(parents), torch.tensor([q[-1] for q in prefixes]))
                row_of = {prefix: r for r, prefix in enumerate(prefixes)}
                self.rows[p] = (cache, row_of, logits)
            for i, prefix in zip(members, prefixes):
                out[i] = logits[row_of[prefix]]
        return torch.stack(out)


def _firsts(n_keys: int, rows: list[int], inverse: torch.Tensor) -> list[int]:
    """The first row of each distinct key, in key order."""
    first: dict[int, int] = {}
    for row, k in zip(rows, inverse.tolist()):
        first.setdefault(k, row)
    return [first[k] for k in range(n_keys)]
