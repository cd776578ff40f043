"""The Tinker types the core speaks are `tinker.types`' own (the pinned SDK's; docs/service.md): this module
re-exports them and adds what the core needs around them: the parameter checks, the builders of sampling answers
from lists, and the one type Tinker has none of (the archive URL answer)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from tinker.types import (AdamParams, Datum, EncodedTextChunk, ForwardBackwardOutput, LossFnType, ModelInput,
                          PromptProvenanceSpan, SampledProvenanceSpan, SampledSequence, SampleResponse, SamplingParams,
                          StopReason, TensorData)

from dsv4flash.lifecycle.refs import CheckpointType, ParsedCheckpointTinkerPath  # noqa: F401  (re-exported)

__all__ = ["AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "LossFnType", "ModelInput",
           "PromptProvenanceSpan", "SampledProvenanceSpan", "SampledSequence", "SampleResponse", "SamplingParams",
           "StopReason", "TensorData", "ProvenanceSpan", "CheckpointArchiveUrlResponse", "ParsedCheckpointTinkerPath",
           "check_token_ids", "check_sampling_params", "check_adam_params", "sampled_sequence", "sample_response",
           "load_of"]

ProvenanceSpan = PromptProvenanceSpan | SampledProvenanceSpan
TopK = list[list[tuple[int, float]]]


def check_token_ids(ids, vocab_size: int, where: str) -> None:
    """Raise naming `where` and the position when a token id is not an integer in [0, vocab_size)."""
    arr = np.asarray(ids)
    if arr.ndim == 1 and arr.dtype.kind in "iu":  # the common case, vectorized
        bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
        if not bad.size:
            return
        ids = [int(arr[bad[0]])]
        offset = int(bad[0])
    else:
        offset = 0
    for position, token in enumerate(ids, offset):
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab_size:
            raise ValueError(f"{where} position {position}: token id {token!r} is not an integer in [0, {vocab_size})")


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_sampling_params(params: SamplingParams) -> None:
    """Raise naming the field when a sampling parameter is out of range (a silent fallback would sample wrongly)."""
    from dsv4flash.engine.sampling import check_sampling_params as check  # the one check (torch-side: lazily)

    check(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
          seed=params.seed)


def check_adam_params(params: AdamParams) -> None:
    """Raise naming the field when an Adam hyper-parameter would make the update non-finite or meaningless."""
    for name, low, high in (("learning_rate", 0.0, math.inf), ("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0),
                            ("eps", 0.0, math.inf), ("weight_decay", 0.0, math.inf),
                            ("grad_clip_norm", 0.0, math.inf)):
        value = getattr(params, name)
        if not _is_number(value) or not math.isfinite(value) or not low <= value < high:
            raise ValueError(f"AdamParams.{name}: expected a finite number in [{low}, {high}), got {value!r}")


def sampled_sequence(stop_reason: StopReason, tokens: list[int], logprobs: list[float] | None, sequence_id: str,
                     topk_logprobs: TopK | None = None) -> SampledSequence:
    """Tinker's `SampledSequence` holding the decode loop's lists (read back unconverted by its list properties)."""
    return SampledSequence(stop_reason=stop_reason, sequence_id=sequence_id, _tokens_list=list(tokens),
                           _logprobs_list=None if logprobs is None else list(logprobs),
                           _topk_logprobs_list=topk_logprobs)


def sample_response(sequences: list[SampledSequence], prompt_logprobs: list[float | None] | None = None,
                    topk_prompt_logprobs: list[TopK | None] | None = None, load: dict | None = None) -> SampleResponse:
    """Tinker's `SampleResponse` of one `sample` call, from lists; `load` is the serving path's figure of how the
    adapter was had ({"tier", "wait_ms", "load_ms"}), read with `load_of` (never sent on the Tinker wire)."""
    response = SampleResponse(sequences=sequences, _prompt_logprobs_list=prompt_logprobs,
                              _topk_prompt_logprobs_list=topk_prompt_logprobs)
    object.__setattr__(response, "load", load)  # beside Tinker's fields (its dataclass is frozen)
    return response


def load_of(response: SampleResponse) -> dict | None:
    """The serving path's load figure of a `sample_response` (None when no lease was needed or none recorded)."""
    return getattr(response, "load", None)


@dataclass
class CheckpointArchiveUrlResponse:
    """Where a checkpoint's PEFT export can be downloaded (a local file URL here)."""

    url: str
    expires: datetime | None = None
