"""Sequence records: what each sampled sequence was (per owner, by `sequence_id`), whether it was sampled with
Tinker's `record_stability_info`, and the check that a datum's provenance spans name such sequences and match
them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from dsv4flash.service.types import Datum, SampledProvenanceSpan

LOCAL_OWNER = "local"  # the in-process client's owner; the HTTP server uses the tenant
RECORD_TTL_S = 86400.0  # Tinker: a recorded sequence can be trained on for one day; each use restarts the day
MAX_RECORDS_PER_OWNER = 65_536  # bounded memory: the least recently used records go first


@dataclass
class RecordedSequence:
    """One sampled sequence as the sampler produced it: prompt, sampled tokens and their sampler log-probs;
    `stability`: sampled with record_stability_info (what stable_reinforce trains on)."""

    prompt: tuple[int, ...]  # one tuple shared by the sequences of a sample call
    tokens: list[int]
    logprobs: list[float]
    stability: bool
    used_at: float


@dataclass
class Provenance:
    """A datum's target rows resolved against the records: which rows are sampled tokens, and their
    sampler log-probs (0 elsewhere). sampled [L] bool, sampler_logprobs [L] float32."""

    sampled: torch.Tensor
    sampler_logprobs: torch.Tensor


class SequenceRecords:
    """Recorded sequences keyed by (owner, sequence_id); another owner's id reads as unknown."""

    def __init__(self, ttl_s: float = RECORD_TTL_S, max_per_owner: int = MAX_RECORDS_PER_OWNER) -> None:
        self.ttl_s, self.max_per_owner = ttl_s, max_per_owner
        self._records: dict[str, dict[str, RecordedSequence]] = {}
        self._lock = threading.Lock()

    def record(self, owner: str, sequence_id: str, prompt: tuple[int, ...], tokens: list[int], logprobs: list[float],
               stability: bool) -> None:
        """Remember one sampled sequence for `owner`."""
        with self._lock:
            mine = self._records.setdefault(owner, {})
            mine[sequence_id] = RecordedSequence(tuple(prompt), list(tokens), list(logprobs), bool(stability),
                                                 time.monotonic())
            while len(mine) > self.max_per_owner:  # dicts keep insertion order; `get` re-inserts on use
                mine.pop(next(iter(mine)))

    def get(self, owner: str, sequence_id: str, where: str) -> RecordedSequence:
        """The owner's live record of `sequence_id` (its day restarts), else KeyError naming `where`."""
        now = time.monotonic()
        with self._lock:
            mine = self._records.get(owner, {})
            rec = mine.get(sequence_id)
            if rec is not None and now - rec.used_at > self.ttl_s:
                del mine[sequence_id]
                rec = None
            if rec is None:
                raise KeyError(f"{where}: {sequence_id!r} is not a sequence this tenant sampled (unknown or "
                               f"expired)")
            rec.used_at = now
            mine[sequence_id] = mine.pop(sequence_id)
            return rec

    def resolve(self, owner: str, index: int, datum: Datum, stability: bool = False) -> Provenance | None:
        """Check datum `index`'s spans against the records -> its Provenance (None when it has no spans).

        `stability` (stable_reinforce): the sampled target runs must name sequences sampled with
        record_stability_info.

        Both span lists must tile their field, name this owner's recorded sequences, stay inside them, and
        agree with them token for token: model-input runs with the prompt / sampled tokens they claim, and
        sampled target runs with the sampled tokens (prompt target runs are padding in Tinker's recipes).
        """
        if datum.loss_fn_input_spans is None:
            return None
        tokens = datum.model_input.to_ints()
        targets = datum.loss_fn_inputs["target_tokens"].to_numpy().reshape(-1).tolist()
        self._walk(owner, f"data[{index}].model_input_spans", datum.model_input_spans, tokens, True, False)
        sampled, logprobs = self._walk(owner, f"data[{index}].loss_fn_input_spans", datum.loss_fn_input_spans,
                                       targets, False, stability)
        return Provenance(torch.tensor(sampled, dtype=torch.bool), torch.tensor(logprobs, dtype=torch.float32))

    def _walk(self, owner: str, field: str, spans, values: list[int], check_prompt: bool, stability: bool):
        total = sum(int(s.length) for s in spans)
        if total != len(values):
            raise ValueError(f"{field}: the spans cover {total} positions but the field has {len(values)}; they "
                             f"must tile it exactly")
        sampled, logprobs, pos = [False] * len(values), [0.0] * len(values), 0
        for j, span in enumerate(spans):
            where = f"{field}[{j}]"
            if span.length < 0 or span.offset < 0:
                raise ValueError(f"{where}: offset {span.offset} and length {span.length} must be ≥ 0")
            rec = self.get(owner, span.sequence_id, f"{where}.sequence_id")
            is_sampled = isinstance(span, SampledProvenanceSpan)
            if is_sampled and stability and not rec.stability:
                raise ValueError(f"{where}.sequence_id: {span.sequence_id!r} was sampled without "
                                 f"record_stability_info, which stable_reinforce needs")
            source = rec.tokens if is_sampled else list(rec.prompt)
            end = span.offset + span.length
            if end > len(source):
                raise ValueError(f"{where}: positions [{span.offset}, {end}) run past the {len(source)} "
                                 f"{'sampled' if is_sampled else 'prompt'} tokens of {span.sequence_id!r}")
            if is_sampled or check_prompt:
                got = values[pos:pos + span.length]
                if got != source[span.offset:end]:
                    bad = next(k for k, (a, b) in enumerate(zip(got, source[span.offset:end])) if a != b)
                    raise ValueError(f"{where}: position {pos + bad} is token {got[bad]}, but {span.sequence_id!r} "
                                     f"has {source[span.offset + bad]} there")
            if is_sampled:
                for k in range(span.length):
                    sampled[pos + k] = True
                    logprobs[pos + k] = rec.logprobs[span.offset + k]
            pos += span.length
        return sampled, logprobs
