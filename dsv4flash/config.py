"""The one source of architecture truth for DeepSeek-V4.1-Flash: typed config, flavours, derived layer plan.

Everything else (reference model, bridge, Megatron/vLLM/veRL glue, recipes) reads these objects and never
re-derives the layer plan, the Engram layout or the quantization roles on its own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "QuantizationConfig",
    "RopeScaling",
    "TextConfig",
    "VisionConfig",
    "LayerPlan",
    "EngramLayout",
    "DSV41FlashConfig",
    "FLAVOURS",
    "load_config",
]


class ConfigError(ValueError):
    """A config file or value that does not describe a valid V4.1-Flash model."""


@dataclass(frozen=True)
class QuantizationConfig:
    """Root `quantization_config` of the release (dense FP8 32×32 UE8M0, MXFP4 experts)."""

    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"


@dataclass(frozen=True)
class RopeScaling:
    """YaRN settings used by every compressed-attention (ratio != 0) layer."""

    rope_type: str
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class TextConfig:
    """`text_config` of the release, field for field and in the release's key order (59 keys)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    hidden_act: str
    swiglu_limit: float
    rms_norm_eps: float
    attention_bias: bool
    attention_dropout: float
    initializer_range: float
    use_cache: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    sliding_window: int
    compress_ratios: tuple[int, ...]
    compress_rope_theta: float
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` of the release (ViT + aligner); `num_hidden_layers == 0` disables vision."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None

    @property
    def head_dim(self) -> int:
        """Per-head width of the ViT attention."""
        return self.hidden_size // self.num_attention_heads

    @property
    def rms_norm_eps(self) -> float:
        """Vision RMSNorm epsilon (the text model's 1e-20 does not apply here)."""
        return 1e-6

    @property
    def enabled(self) -> bool:
        """Whether the model has a vision tower (and hence `bias_vl` on every gate)."""
        return self.num_hidden_layers > 0


# Root keys in the release's order; `text_config`/`vision_config`/`quantization_config` are nested.
_ROOT_KEYS = (
    "architectures", "model_type", "dtype", "transformers_version", "bos_token_id", "eos_token_id",
    "pad_token_id", "image_token_id", "quantization_config", "text_config", "vision_config",
)


@dataclass(frozen=True)
class LayerPlan:
    """Derived CSA2 role of one block (docs/architecture.md §1.3): who it reads from and what it publishes."""

    layer_id: int
    ratio: int
    mode: str  # "swa" | "full" | "reuse" | "reindex"
    kv_source: int | None  # layer whose compress_kv / index_k this layer reads (itself when Full)
    index_source: int | None  # layer whose top-k this layer uses (itself when it runs an indexer)
    is_candidate_source: bool  # builds the hierarchical candidate pool (layer 20 in the release)
    uses_candidates: bool  # a Reindex layer after the candidate source, masked to its pool
    half: str  # "encoder" | "decoder" | "draft" (DSpark blocks under `mtp.*`)
    rope_theta: float
    yarn: bool
    engram_index: int | None  # position in `engram_layer_ids`, or None

    @property
    def has_compressor(self) -> bool:
        """Full layers own a compressor (and the index-key projection `wk`/`k_norm`)."""
        return self.mode == "full"

    @property
    def has_wgate(self) -> bool:
        """Only ratio > 1 compressors pool with a gate; the ratio-1 source has none."""
        return self.mode == "full" and self.ratio > 1

    @property
    def has_indexer(self) -> bool:
        """Index sources (Full and Reindex) run their own indexer query."""
        return self.mode in ("full", "reindex")

    @property
    def has_engram(self) -> bool:
        """Whether an Engram lookup is applied to the streams before this block."""
        return self.engram_index is not None

    @property
    def is_draft(self) -> bool:
        """DSpark draft block (`mtp.*`)."""
        return self.half == "draft"


@dataclass(frozen=True)
class EngramLayout:
    """Prime-sized bucket layout and hash multipliers of one Engram layer (docs/architecture.md §6)."""

    layer_id: int
    primes: tuple[tuple[int, ...], ...]  # [order n = 2..max][head]
    offsets: tuple[tuple[int, ...], ...]  # exclusive prefix sum over the flattened [order][head] list
    multipliers: tuple[int, ...]  # odd int64 multipliers, one per look-back position s = 0..max-1

    @property
    def num_rows(self) -> int:
        """Table rows: the sum of all primes."""
        return sum(sum(p) for p in self.primes)


@dataclass(frozen=True)
class DSV41FlashConfig:
    """A whole V4.1-Flash config: root fields, text, vision and quantization, plus derived plans."""

    architectures: tuple[str, ...]
    model_type: str
    dtype: str
    transformers_version: str
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int
    quantization: QuantizationConfig
    text: TextConfig
    vision: VisionConfig
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived, computed once -------------------------------------------------------------
    @functools.cached_property
    def layer_plan(self) -> tuple[LayerPlan, ...]:
        """Per-block plan for the backbone layers followed by the DSpark blocks."""
        return _derive_layer_plan(self.text)

    @property
    def backbone_plan(self) -> tuple[LayerPlan, ...]:
        """Plan entries of the `num_hidden_layers` backbone blocks only."""
        return self.layer_plan[: self.text.num_hidden_layers]

    @property
    def draft_plan(self) -> tuple[LayerPlan, ...]:
        """Plan entries of the DSpark (`mtp.*`) blocks."""
        return self.layer_plan[self.text.num_hidden_layers:]

    @property
    def decoder_start(self) -> int:
        """First decoder-half layer: the CED source, i.e. the candidate source layer."""
        return self.text.candidate_source_layer_id

    @functools.cached_property
    def engram_layouts(self) -> tuple[EngramLayout, ...]:
        """Bucket primes, offsets and hash multipliers of every Engram layer, in layer order."""
        return _derive_engram_layouts(self.text)

    @property
    def hybrid_pattern(self) -> str:
        """Megatron hybrid-stack pattern: one attention ("V") and one expert ("E") sublayer per block."""
        return "VE" * self.text.num_hidden_layers

    # ---- conversions ------------------------------------------------------------------------
    def to_hf(self) -> dict[str, Any]:
        """The HF `config.json` dict, keys in the release order (json.dumps(indent=2) round-trips bytes)."""
        quant = dataclasses.asdict(self.quantization)
        quant["weight_block_size"] = list(quant["weight_block_size"])
        text = {}
        for f in dataclasses.fields(TextConfig):
            value = getattr(self.text, f.name)
            if isinstance(value, RopeScaling):
                value = dataclasses.asdict(value)
            elif isinstance(value, tuple):
                value = list(value)
            text[f.name] = value
        values = {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "dtype": self.dtype,
            "transformers_version": self.transformers_version,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "quantization_config": quant,
            "text_config": text,
            "vision_config": dataclasses.asdict(self.vision),
        }
        return {k: values[k] for k in _ROOT_KEYS}

    def to_json(self) -> str:
        """Serialise exactly as the release's `config.json` is serialised."""
        return json.dumps(self.to_hf(), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write `config.json` atomically (temp file, then rename)."""
        from dsv4flash.atomic_io import write_bytes_atomic

        write_bytes_atomic(path, self.to_json().encode())

    def replace_text(self, **changes: Any) -> "DSV41FlashConfig":
        """A copy with some `text_config` fields changed (validated again)."""
        text = dataclasses.replace(self.text, **changes)
        return dataclasses.replace(self, text=text, name=f"{self.name}+custom")

    def replace_vision(self, **changes: Any) -> "DSV41FlashConfig":
        """A copy with some `vision_config` fields changed (validated again)."""
        vision = dataclasses.replace(self.vision, **changes)
        return dataclasses.replace(self, vision=vision, name=f"{self.name}+custom")

    @classmethod
    def from_hf(cls, data: dict[str, Any], *, name: str = "custom", source: str = "<dict>") -> "DSV41FlashConfig":
        """Build from a nested HF `config.json` dict; unknown or missing keys are errors naming the key."""
        return _from_hf(data, name=name, source=source)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

_FLAVOUR_FILES = {"flash": "flash_config.json", "tiny": "tiny_config.json"}
FLAVOURS = ("tiny", "flash", "tiny_mtp")


def _typed_section(cls: type, data: Any, section: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: `{section}` must be an object, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"{source}: unknown key `{section}.{unknown[0]}` (expected one of: {', '.join(names)})")
    missing = [k for k in names if k not in data]
    if missing:
        raise ConfigError(f"{source}: missing key `{section}.{missing[0]}`")
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = data[f.name]
        if isinstance(value, list):
            value = tuple(value)
        if f.name == "rope_scaling":
            value = _typed_section(RopeScaling, value, f"{section}.rope_scaling", source)
        kwargs[f.name] = value
    return cls(**kwargs)


def _from_hf(data: dict[str, Any], *, name: str, source: str) -> DSV41FlashConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be an object")
    unknown = [k for k in data if k not in _ROOT_KEYS]
    if unknown:
        raise ConfigError(f"{source}: unknown key `{unknown[0]}` (expected one of: {', '.join(_ROOT_KEYS)})")
    missing = [k for k in _ROOT_KEYS if k not in data]
    if missing:
        raise ConfigError(f"{source}: missing key `{missing[0]}`")
    quant = _typed_section(QuantizationConfig, data["quantization_config"], "quantization_config", source)
    text = _typed_section(TextConfig, data["text_config"], "text_config", source)
    vision = _typed_section(VisionConfig, data["vision_config"], "vision_config", source)
    try:
        return DSV41FlashConfig(
            architectures=tuple(data["architectures"]),
            model_type=data["model_type"],
            dtype=data["dtype"],
            transformers_version=data["transformers_version"],
            bos_token_id=data["bos_token_id"],
            eos_token_id=data["eos_token_id"],
            pad_token_id=data["pad_token_id"],
            image_token_id=data["image_token_id"],
            quantization=quant,
            text=text,
            vision=vision,
            name=name,
        )
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


@functools.lru_cache(maxsize=16)
def _load_flavour(flavour: str) -> DSV41FlashConfig:
    if flavour == "tiny_mtp":
        # The tiny model with three DSpark blocks, to exercise every `mtp.*` tensor family.
        base = _load_flavour("tiny")
        ratios = base.text.compress_ratios + (0, 0, 0)
        cfg = base.replace_text(num_nextn_predict_layers=3, compress_ratios=ratios)
        return dataclasses.replace(cfg, name="tiny_mtp")
    text = resources.files("dsv4flash.data").joinpath(_FLAVOUR_FILES[flavour]).read_text()
    return _from_hf(json.loads(text), name=flavour, source=f"flavour `{flavour}`")


def load_config(spec: "str | os.PathLike | DSV41FlashConfig" = "tiny") -> DSV41FlashConfig:
    """Load a flavour name (`tiny`, `flash`, `tiny_mtp`), a `config.json` path, or a checkpoint directory."""
    if isinstance(spec, DSV41FlashConfig):
        return spec
    if isinstance(spec, str) and spec in FLAVOURS:
        return _load_flavour(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"`{spec}` is neither a flavour ({', '.join(FLAVOURS)}) nor an existing config path")
    return _from_hf(_read_json(path), name=path.parent.name or "custom", source=str(path))


# ---------------------------------------------------------------------------------------------
# Derivation
# ---------------------------------------------------------------------------------------------

def _latest(sources: tuple[int, ...], layer: int) -> int | None:
    earlier = [s for s in sources if s <= layer]
    return max(earlier) if earlier else None


def _derive_layer_plan(text: TextConfig) -> tuple[LayerPlan, ...]:
    n = text.num_hidden_layers
    plan = []
    for layer in range(n + text.num_nextn_predict_layers):
        ratio = text.compress_ratios[layer]
        draft = layer >= n
        if ratio == 0 or draft:
            mode, kv_src, idx_src = "swa", None, None
        else:
            kv_src = _latest(text.kv_source_layer_ids, layer)
            idx_src = _latest(text.index_source_layer_ids, layer)
            if layer in text.kv_source_layer_ids:
                mode = "full"
            elif layer in text.index_source_layer_ids:
                mode = "reindex"
            else:
                mode = "reuse"
        cand = text.candidate_source_layer_id
        plan.append(
            LayerPlan(
                layer_id=layer,
                ratio=ratio,
                mode=mode,
                kv_source=kv_src,
                index_source=idx_src,
                is_candidate_source=(not draft and layer == cand),
                uses_candidates=(mode == "reindex" and layer > cand),
                half="draft" if draft else ("decoder" if layer >= cand else "encoder"),
                rope_theta=float(text.compress_rope_theta if ratio else text.rope_theta),
                yarn=bool(ratio),
                engram_index=(text.engram_layer_ids.index(layer)
                              if (not draft and layer in text.engram_layer_ids) else None),
            )
        )
    return tuple(plan)


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    for d in range(3, math.isqrt(value) + 1, 2):
        if value % d == 0:
            return False
    return True


def _derive_engram_layouts(text: TextConfig) -> tuple[EngramLayout, ...]:
    import numpy as np  # only needed for the multipliers' RNG stream

    seen: set[int] = set()
    layouts = []
    bound = ((2**63 - 1) // text.engram_compressed_vocab_size) // 2
    for layer in text.engram_layer_ids:
        primes = []
        for _order in range(2, text.engram_max_ngram_size + 1):
            current = text.engram_vocab_size - 1
            heads = []
            for _head in range(text.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                heads.append(current)
            primes.append(tuple(heads))
        flat = [p for order in primes for p in order]
        starts = [sum(flat[:i]) for i in range(len(flat))]
        offsets = tuple(
            tuple(starts[o * text.engram_n_heads:(o + 1) * text.engram_n_heads]) for o in range(len(primes))
        )
        rng = np.random.default_rng(10007 * layer)
        mult = rng.integers(0, bound, size=text.engram_max_ngram_size, dtype=np.int64) * 2 + 1
        layouts.append(EngramLayout(layer, tuple(primes), offsets, tuple(int(m) for m in mult)))
    return tuple(layouts)


# ---------------------------------------------------------------------------------------------
# Validation: every rule names the offending key
# ---------------------------------------------------------------------------------------------

def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"`{key}`: {message}")


def _validate(cfg: DSV41FlashConfig) -> None:
    t, v = cfg.text, cfg.vision
    n, n_mtp = t.num_hidden_layers, t.num_nextn_predict_layers
    _require(n > 0, "text_config.num_hidden_layers", "must be positive")
    _require(len(t.compress_ratios) == n + n_mtp, "text_config.compress_ratios",
             f"has {len(t.compress_ratios)} entries, expected num_hidden_layers + num_nextn_predict_layers "
             f"= {n + n_mtp}")
    _require(all(r in (0, 1, 2, 4, 8, 16, 32, 64, 128) for r in t.compress_ratios), "text_config.compress_ratios",
             "entries must be 0 (SWA only) or a power-of-two ratio")
    _require(all(r == 0 for r in t.compress_ratios[n:]), "text_config.compress_ratios",
             "DSpark (mtp) blocks are window-only: their ratios must be 0")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = getattr(t, key)
        _require(list(ids) == sorted(set(ids)), f"text_config.{key}", "must be strictly increasing")
        _require(all(0 <= i < n for i in ids), f"text_config.{key}", f"ids must lie in [0, {n})")
    for s in t.kv_source_layer_ids:
        _require(s in t.index_source_layer_ids, "text_config.kv_source_layer_ids",
                 f"kv source {s} is not an index source (every kv source owns index keys)")
    for s in t.index_source_layer_ids:
        _require(t.compress_ratios[s] != 0, "text_config.index_source_layer_ids",
                 f"index source {s} has compress ratio 0")
    for layer in range(n):
        ratio = t.compress_ratios[layer]
        src = _latest(t.kv_source_layer_ids, layer)
        if ratio != 0:
            _require(src is not None, "text_config.compress_ratios",
                     f"layer {layer} has ratio {ratio} but no kv source at or before it")
        if src is not None:
            _require(ratio == t.compress_ratios[src], "text_config.compress_ratios",
                     f"ratio changes between kv source {src} (ratio {t.compress_ratios[src]}) and layer {layer} "
                     f"(ratio {ratio}); it must stay constant up to the next kv source")
    if any(t.compress_ratios[:n]):
        _require(t.index_source_layer_ids[0] == t.kv_source_layer_ids[0], "text_config.index_source_layer_ids",
                 "the first index source must be the first kv source")
    c = t.candidate_source_layer_id
    _require(c in t.kv_source_layer_ids, "text_config.candidate_source_layer_id",
             f"candidate source {c} must be a Full layer (a kv source)")
    _require((t.candidate_topk_blocks - 1) * t.candidate_block_size + 1 >= t.index_topk,
             "text_config.candidate_topk_blocks",
             f"smallest candidate pool ({t.candidate_topk_blocks}-1)*{t.candidate_block_size}+1 is below "
             f"index_topk {t.index_topk}")
    _require(t.num_attention_heads % t.o_groups == 0, "text_config.o_groups",
             f"num_attention_heads {t.num_attention_heads} is not divisible by o_groups {t.o_groups}")
    _require(t.num_key_value_heads == 1, "text_config.num_key_value_heads", "V4.1 uses one shared latent (1)")
    _require(0 < t.qk_rope_head_dim <= t.head_dim and t.qk_rope_head_dim % 2 == 0, "text_config.qk_rope_head_dim",
             "must be even and at most head_dim")
    _require(t.qk_rope_head_dim <= t.index_head_dim, "text_config.index_head_dim",
             "must be at least qk_rope_head_dim (index keys carry the RoPE tail)")
    _require(t.head_dim % 32 == 0, "text_config.head_dim", "window-KV FP8 fake-quant needs a multiple of 32")
    _require(t.index_head_dim % 32 == 0, "text_config.index_head_dim", "MXFP4 index fake-quant needs a multiple of 32")
    _require(0 < t.num_experts_per_tok <= t.n_routed_experts, "text_config.num_experts_per_tok",
             f"must lie in [1, n_routed_experts={t.n_routed_experts}]")
    _require(t.scoring_func == "sqrtsoftplus", "text_config.scoring_func", "only sqrtsoftplus is V4.1")
    _require(t.topk_method == "noaux_tc", "text_config.topk_method", "only noaux_tc is V4.1")
    _require(t.hidden_act == "silu", "text_config.hidden_act", "V4.1 experts are SwiGLU (silu)")
    _require(t.n_shared_experts == 1, "text_config.n_shared_experts", "V4.1 has exactly one shared expert")
    _require(t.hc_mult >= 1 and t.hc_sinkhorn_iters >= 1, "text_config.hc_mult", "mHC needs >= 1 stream and iteration")
    _require(t.rope_scaling.rope_type == "yarn", "text_config.rope_scaling.rope_type", "only yarn is supported")
    _require(len(t.engram_num_embeddings) == len(t.engram_layer_ids), "text_config.engram_num_embeddings",
             f"has {len(t.engram_num_embeddings)} entries for {len(t.engram_layer_ids)} Engram layers")
    _require(t.engram_max_ngram_size >= 2, "text_config.engram_max_ngram_size", "n-gram orders start at 2")
    _require(t.engram_head_dim % 32 == 0, "text_config.engram_head_dim", "per-row FP8 scales need a multiple of 32")
    if t.engram_layer_ids:
        for layout, rows in zip(_derive_engram_layouts(t), t.engram_num_embeddings):
            _require(layout.num_rows == rows, "text_config.engram_num_embeddings",
                     f"layer {layout.layer_id} has {rows} rows, but its prime buckets sum to {layout.num_rows}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        _require(0 <= getattr(cfg, key) < t.vocab_size, key, f"must lie inside the vocabulary [0, {t.vocab_size})")
    _require(0 <= t.engram_pad_token_id < t.vocab_size, "text_config.engram_pad_token_id", "outside the vocabulary")
    if v.enabled:
        _require(v.hidden_size % v.num_attention_heads == 0, "vision_config.num_attention_heads",
                 "must divide hidden_size")
        _require(v.head_dim % 4 == 0, "vision_config.hidden_size", "2D RoPE needs a vision head_dim divisible by 4")
    _require(tuple(cfg.quantization.weight_block_size) == (32, 32), "quantization_config.weight_block_size",
             "V4.1 dense FP8 blocks are [32, 32]")
