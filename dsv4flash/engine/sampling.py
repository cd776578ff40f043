"""Autoregressive sampling with the reference model: full recompute per new token (fine at tiny size).

Prompts are right-padded into one buffer; right padding never changes a causal prefix, so each row reads
its next-token distribution at its own last position. The log-prob of every sampled token under the
sampling distribution (temperature applied, like vLLM's processed log-probs) is returned with it: those are
the rollout log-probs the GRPO correction compares against.

Rows that share a prompt (a GRPO group) and have sampled the same tokens so far have the same next-token
distribution, so each step runs the model once per distinct (prompt, prefix) and fans the logits out: the
first token of a group costs one row instead of `group_size`, and short answers collapse further.
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


@torch.no_grad()
def generate(forward: ForwardFn, prompts: Sequence[tuple[torch.Tensor, torch.Tensor, list]], *, max_new_tokens: int,
             eos_id: int, pad_id: int, temperature: float = 1.0, generator: torch.Generator | None = None,
             autocast_dtype: torch.dtype | None = None) -> Rollout:
    """Sample up to `max_new_tokens` per prompt (greedy when temperature == 0); rows stop at eos."""
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
    for t in range(max_new_tokens):
        live = (~done).nonzero().flatten()  # [L]
        # One model row per distinct (prompt, generated prefix) among the live rows.
        key_of: dict = {}
        inverse = torch.tensor([key_of.setdefault((prompt_of[b], tuple(out_tokens[b, :t].tolist())), len(key_of))
                                for b in live.tolist()])
        uniq = torch.tensor(_firsts(len(key_of), live.tolist(), inverse))  # [U] a representative row per key
        seqlen = int(lengths[uniq].max())
        with cast:
            logits = forward(ids[uniq, :seqlen], types[uniq, :seqlen],
                             [img for b in uniq.tolist() for img in row_images[b]])  # [U,seqlen,V]
        last = logits[inverse, lengths[live] - 1].float()  # [L,V]
        if temperature > 0:
            logp = torch.log_softmax(last / temperature, dim=-1)
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


def _firsts(n_keys: int, rows: list[int], inverse: torch.Tensor) -> list[int]:
    """The first row of each distinct key, in key order."""
    first: dict[int, int] = {}
    for row, k in zip(rows, inverse.tolist()):
        first.setdefault(k, row)
    return [first[k] for k in range(n_keys)]
