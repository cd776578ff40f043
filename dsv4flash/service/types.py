"""Tinker-named data types (lifecycle.md §5): inputs, loss inputs, sampling/optimizer params, responses, paths."""

from __future__ import annotations

import math
import re
from datetime import datetime
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

LossFnType = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce"]
StopReason = Literal["length", "stop"]
CheckpointType = Literal["training", "sampler"]
_NP_DTYPES = {"int64": np.int64, "float32": np.float32}


@dataclass
class EncodedTextChunk:
    """A run of token ids."""

    tokens: list[int]
    type: str = "encoded_text"

    @property
    def length(self) -> int:
        """Number of tokens."""
        return len(self.tokens)


@dataclass
class ModelInput:
    """A model input as chunks (text chunks only on this engine)."""

    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens) -> "ModelInput":
        """One text chunk holding `tokens`."""
        return cls([EncodedTextChunk([int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> "ModelInput":
        """No tokens."""
        return cls([])

    def to_ints(self) -> list[int]:
        """All token ids, chunk after chunk."""
        out: list[int] = []
        for chunk in self.chunks:
            if not isinstance(chunk, EncodedTextChunk):
                raise TypeError(f"ModelInput.to_ints: chunk of type {type(chunk).__name__} is not text")
            out.extend(chunk.tokens)
        return out

    @property
    def length(self) -> int:
        """Total tokens."""
        return sum(c.length for c in self.chunks)

    def append(self, chunk: EncodedTextChunk) -> "ModelInput":
        """A new input with `chunk` appended."""
        return ModelInput(self.chunks + [chunk])

    def append_int(self, token: int) -> "ModelInput":
        """A new input with one more token."""
        return self.append(EncodedTextChunk([int(token)]))


@dataclass
class TensorData:
    """A flat tensor as (data, dtype, shape), convertible to numpy / torch."""

    data: list
    dtype: str
    shape: list[int] | None = None

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "TensorData":
        """From a numpy array (int → int64, float → float32)."""
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        return cls(array.reshape(-1).tolist(), dtype, list(array.shape))

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> "TensorData":
        """From a torch tensor."""
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        """As a numpy array of its shape."""
        arr = np.asarray(self.data, dtype=_NP_DTYPES[self.dtype])
        return arr.reshape(self.shape) if self.shape is not None else arr

    def to_torch(self) -> torch.Tensor:
        """As a torch tensor of its shape."""
        return torch.from_numpy(self.to_numpy())

    def tolist(self) -> list:
        """As a (nested) list."""
        return self.to_numpy().tolist()


def to_tensor_data(value: Any, key: str) -> TensorData:
    """TensorData from TensorData / numpy / torch / list; a clear error names the key otherwise."""
    if isinstance(value, TensorData):
        return value
    if isinstance(value, torch.Tensor):
        return TensorData.from_torch(value)
    if isinstance(value, (np.ndarray, list, tuple)):
        return TensorData.from_numpy(np.asarray(value))
    raise TypeError(f"Datum.loss_fn_inputs[{key!r}]: expected TensorData, numpy, torch or a list, got {type(value).__name__}")


@dataclass(frozen=True, kw_only=True)
class PromptProvenanceSpan:
    """`length` datum positions are positions [offset, offset + length) of sequence `sequence_id`'s prompt."""

    sequence_id: str
    offset: int = 0
    length: int


@dataclass(frozen=True, kw_only=True)
class SampledProvenanceSpan:
    """`length` datum positions are positions [offset, offset + length) of sequence `sequence_id`'s sampled tokens."""

    sequence_id: str
    offset: int = 0
    length: int


ProvenanceSpan = PromptProvenanceSpan | SampledProvenanceSpan


@dataclass
class Datum:
    """One training example: the model input and the per-token loss inputs (target_tokens, weights, ...).

    `model_input_spans` / `loss_fn_input_spans` (Tinker's provenance, set together by `with_provenance`) tile
    the model input and the target tokens with runs naming the sampled sequence each position came from.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None

    def __post_init__(self) -> None:
        self.loss_fn_inputs = {k: to_tensor_data(v, k) for k, v in self.loss_fn_inputs.items()}
        if (self.model_input_spans is None) != (self.loss_fn_input_spans is None):
            raise ValueError("Datum: provenance comes as a pair (model_input_spans and loss_fn_input_spans)")

    def with_provenance(self, model_input: list[ProvenanceSpan], loss_fn_inputs: list[ProvenanceSpan]) -> "Datum":
        """A copy carrying provenance spans for the model input and the target tokens (tiling checked here)."""
        targets = self.loss_fn_inputs.get("target_tokens")
        for kwarg, spans, length in (("model_input", model_input, self.model_input.length),
                                     ("loss_fn_inputs", loss_fn_inputs, None if targets is None else targets.shape[0])):
            total = sum(span.length for span in spans)
            if length is not None and total != length:
                raise ValueError(f"with_provenance {kwarg} spans cover {total} positions but the field has {length}; "
                                 f"the runs must tile it exactly")
        return Datum(self.model_input, dict(self.loss_fn_inputs), list(model_input), list(loss_fn_inputs))


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


@dataclass
class SamplingParams:
    """Decoding parameters: stop holds token ids (or single-token strings)."""

    max_tokens: int | None = None
    seed: int | None = None
    stop: list[int] | list[str] | str | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    def check(self) -> None:
        """Raise naming the field when a parameter is out of range (a silent fallback would sample wrongly)."""
        if self.max_tokens is not None and (not isinstance(self.max_tokens, (int, np.integer))
                                            or isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens: expected an integer ≥ 1 (or None), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: expected a finite number ≥ 0, got {self.temperature!r}")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k: expected an integer ≥ 1, or 0/-1 for no limit, "
                             f"got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool)):
            raise ValueError(f"SamplingParams.seed: expected an integer or None, got {self.seed!r}")


@dataclass
class AdamParams:
    """AdamW hyper-parameters of one `optim_step` (Tinker defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> None:
        """Raise naming the field when a hyper-parameter would make the update non-finite or meaningless."""
        for name, low, high in (("learning_rate", 0.0, math.inf), ("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0),
                                ("eps", 0.0, math.inf), ("weight_decay", 0.0, math.inf),
                                ("grad_clip_norm", 0.0, math.inf)):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or not low <= value < high:
                raise ValueError(f"AdamParams.{name}: expected a finite number in [{low}, {high}), got {value!r}")


@dataclass
class LoraConfig:
    """What a training run adapts (Tinker's LoraConfig); `preset` picks the dsv4flash placement."""

    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True
    preset: str = "full_linear"


@dataclass
class ForwardBackwardOutput:
    """Per-datum outputs (`logprobs` of the targets) and summed metrics."""

    loss_fn_output_type: str
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]


@dataclass
class OptimStepResponse:
    """Metrics of one optimizer step."""

    metrics: dict[str, float] | None = None


@dataclass
class SaveWeightsResponse:
    """Where `save_state` put the training state."""

    path: str


@dataclass
class SaveWeightsForSamplerResponse:
    """Where `save_weights_for_sampler` put the sampler weights."""

    path: str


@dataclass
class LoadWeightsResponse:
    """What `load_state` loaded."""

    path: str


@dataclass
class SampledSequence:
    """One sampled continuation and the log-prob of each token under the sampling distribution."""

    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    sequence_id: str | None = field(default=None, compare=False)  # a name, not content: equal samples stay equal
    # Per sampled token: the k most likely (token id, log-prob) of the sampling distribution, most likely first.
    topk_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class SampleResponse:
    """All sequences of one `sample` call."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    type: str = "sample"
    # Per prompt position (None for the first): the k most likely (token id, log-prob) of the model.
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class ModelData:
    """What a training run is built on."""

    base_model: str
    lora_rank: int
    preset: str


@dataclass
class GetInfoResponse:
    """`TrainingClient.get_info()`."""

    model_id: str
    model_data: ModelData


@dataclass
class Checkpoint:
    """One saved checkpoint of a run (RestClient listings)."""

    checkpoint_id: str
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    expires_at: datetime | None = None


@dataclass
class CheckpointsListResponse:
    """`RestClient.list_checkpoints` / `list_user_checkpoints`."""

    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


@dataclass
class Cursor:
    """Paging position of a listing."""

    offset: int
    limit: int
    total_count: int


@dataclass
class TrainingRun:
    """One training run (a lifecycle policy) as the RestClient reports it."""

    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool
    lora_rank: int | None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: dict[str, str] | None = None


@dataclass
class TrainingRunsResponse:
    """`RestClient.list_training_runs`."""

    training_runs: list[TrainingRun]
    cursor: Cursor


@dataclass
class CheckpointArchiveUrlResponse:
    """Where a checkpoint's PEFT export can be downloaded (a local file URL here)."""

    url: str
    expires: datetime | None = None


_PATH = re.compile(r"(tinker|mint)://([^/]+)/(weights|sampler_weights)/([^/]+)")
_KIND = {"weights": "training", "sampler_weights": "sampler"}


@dataclass(frozen=True)
class ParsedCheckpointTinkerPath:
    """`tinker://<run>/{weights|sampler_weights}/<name>` (or `mint://…`) taken apart."""

    tinker_path: str
    training_run_id: str
    checkpoint_type: CheckpointType
    checkpoint_id: str

    @classmethod
    def from_tinker_path(cls, path: str) -> "ParsedCheckpointTinkerPath":
        """Parse; a clear error says what shape was expected."""
        m = _PATH.fullmatch(path)
        if m is None:
            raise ValueError(f"checkpoint path {path!r}: expected tinker://<run>/weights/<name> or "
                             f"tinker://<run>/sampler_weights/<name> (mint:// accepted)")
        return cls(path, m.group(2), _KIND[m.group(3)], m.group(4))

    @property
    def tag(self) -> str:
        """The lifecycle catalog tag this checkpoint is stored under."""
        return f"{'weights' if self.checkpoint_type == 'training' else 'sampler_weights'}.{self.checkpoint_id}"
