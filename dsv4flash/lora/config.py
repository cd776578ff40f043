"""LoRA placement config: `LoraConfig` (what a recipe sets) and the named `PRESETS` of Mind Lab's study.

A placement is declarative: `include` / `exclude` target rules over release module names
(`layers.{i}.attn.wq_a`, `layers.{i}.ffn.experts.{e}.w1`, `vision.blocks.{b}.attn.wqkv`, ...), a layer
range (`all`, `encoder`, `decoder`, or explicit ids), plus the two structural switches of the study:
`freeze_kv_write` (the CED source layer's KV writers stay the base's) and `vit` (`frozen` | `train`).
A preset fills every field the caller leaves as `None`; explicit fields win, except that a preset which fixes its
rank (`full_linear_r8`) refuses another explicit rank. `train_head` adds a LoRA on the output head `head` (Tinker's
`train_unembed`; PEFT loads it as the `head` module of `DeepseekV41ForCausalLM`).

Rule syntax (see docs/lora.md): `*` matches inside one dotted component, `**` across components,
`?` one character, `[abc]` a character class; a rule starting with `re:` is a full-match regex.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# "Every linear" of the language model, as the study adapts them (docs/architecture.md §13, "LoRA candidates").
# The router gate is not in the list (see docs/lora.md) and the indexer can never be targeted.
LM_LINEAR_RULES: tuple[str, ...] = (
    "layers.*.attn.wq_a",
    "layers.*.attn.wq_b",
    "layers.*.attn.wkv",
    "layers.*.attn.wo_a",
    "layers.*.attn.wo_b",
    "layers.*.attn.compressor.wkv",
    "layers.*.attn.compressor.wgate",
    "layers.*.ffn.shared_experts.w[123]",
    "layers.*.ffn.experts.*.w[123]",
    "layers.*.engram.wkv",
)
# Every linear of the vision tower and the aligner (selected only when `vit="train"`).
VIT_RULES: tuple[str, ...] = ("vision.**", "aligner.*")
LEAN_ATTENTION_EXCLUDE: tuple[str, ...] = ("layers.*.attn.wq_b", "layers.*.attn.wo_a", "layers.*.attn.compressor.*")
NO_DOWN_PROJ_EXCLUDE: tuple[str, ...] = ("layers.*.ffn.experts.*.w2",)

VIT_MODES = ("frozen", "train")
LORA_DTYPES = ("float32", "bfloat16", "float16")
WO_A_MODES = ("per_group", "shared_a")
EXPERT_MODES = ("per_expert", "shared_outer")


DEFAULT_RANK = 16  # the study's rank, for every preset that does not fix one


@dataclass(frozen=True)
class PresetSpec:
    """A named placement: the values a `LoraConfig` takes for every field the caller leaves unset.

    `rank=None`: the preset places LoRA at any rank (DEFAULT_RANK when unset); an int fixes it, and a `LoraConfig`
    asking for another rank under this preset is an error."""

    description: str
    rank: int | None = None
    include: tuple[str, ...] = LM_LINEAR_RULES
    exclude: tuple[str, ...] = ()
    layers: str = "all"
    freeze_kv_write: bool = False
    vit: str = "frozen"
    vit_lr_mult: float = 1.0


PRESETS: dict[str, PresetSpec] = {
    "full_linear": PresetSpec("every linear of the language model in all layers, rank 16 (the study's baseline)"),
    "full_linear_r8": PresetSpec("every linear of the language model in all layers, rank 8", rank=8),
    "decoder_half": PresetSpec(
        "every linear of the decoder layers only (decoder_start..end), rank 16; the CED source layer's KV "
        "writers are frozen so every such adapter shares the base's encoder and compressed KV",
        layers="decoder", freeze_kv_write=True),
    "encoder_half": PresetSpec("every linear of the encoder layers only (0..decoder_start-1), rank 16",
                               layers="encoder"),
    "lean_attention": PresetSpec("full_linear without LoRA on wq_b, wo_a and the compressor",
                                 exclude=LEAN_ATTENTION_EXCLUDE),
    "no_down_proj": PresetSpec("full_linear without LoRA on the routed experts' down projection (w2)",
                               exclude=NO_DOWN_PROJ_EXCLUDE),
    "vit_lr_0p1": PresetSpec("full_linear plus ViT and aligner adapters trained at 0.1x the learning rate",
                             vit="train", vit_lr_mult=0.1),
    "decoder_lean_no_down": PresetSpec(
        "decoder_half + lean_attention + no_down_proj (the study's cheapest placement within seed noise)",
        layers="decoder", freeze_kv_write=True, exclude=LEAN_ATTENTION_EXCLUDE + NO_DOWN_PROJ_EXCLUDE),
}
CUSTOM = "custom"


@dataclass
class LoraConfig:
    """Where LoRA goes and how it is initialised; `None` fields are filled from `PRESETS[preset]`.

    `preset="custom"` starts from nothing: `include` must then be given (the other fields take the
    `PresetSpec` defaults). `alpha` defaults to 2·rank (the study's setting), `dropout` applies to the
    adapter input only. `seed` makes the A initialisation independent of the global RNG. `wo_a_lora`
    picks the block-diagonal parameterisation of the grouped `wo_a`: `per_group` (A_g, B_g per group) or
    `shared_a` (one A for all groups, per-group B_g; miles/NeMo, G× fewer A parameters). `expert_lora`
    picks the routed-expert parameterisation: `per_expert` (A_e, B_e for every expert) or `shared_outer`
    (w1/w3 share A, w2 shares B across the experts; ~3× fewer routed parameters, see docs/lora.md).
    `train_head` adds a LoRA on the output head (`head`) to whatever the rules select.
    """

    preset: str = "full_linear"
    rank: int | None = None
    alpha: float | None = None
    dropout: float = 0.0
    vit: str | None = None
    vit_lr_mult: float | None = None
    freeze_kv_write: bool | None = None
    layers: str | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    lora_dtype: str = "float32"
    wo_a_lora: str = "per_group"
    expert_lora: str = "per_expert"
    seed: int = 0
    train_head: bool = False
    # Filled by __post_init__: whether `include` came from the preset (preset rules may match nothing
    # on a model that lacks, say, Engram; explicit rules must match something).
    include_from_preset: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.preset == CUSTOM:
            spec = PresetSpec("custom placement", include=())
            if self.include is None:
                raise ValueError("LoraConfig(preset='custom') needs explicit `include` target rules")
        elif self.preset in PRESETS:
            spec = PRESETS[self.preset]
        else:
            raise ValueError(f"LoraConfig.preset: unknown preset {self.preset!r}; expected one of "
                             f"{sorted(PRESETS)} or {CUSTOM!r}")
        self.include_from_preset = self.include_from_preset or self.include is None
        if spec.rank is not None and self.rank is not None and self.rank != spec.rank:
            raise ValueError(f"LoraConfig.rank: {self.rank!r} conflicts with preset {self.preset!r}, which fixes rank "
                             f"{spec.rank}; leave rank unset or pick a preset that takes any rank (e.g. full_linear)")
        if self.rank is None:
            self.rank = DEFAULT_RANK if spec.rank is None else spec.rank
        for name in ("layers", "freeze_kv_write", "vit", "vit_lr_mult", "include", "exclude"):
            if getattr(self, name) is None:
                value = getattr(spec, name)
                setattr(self, name, list(value) if isinstance(value, tuple) else value)
        self.include, self.exclude = list(self.include), list(self.exclude)
        if self.alpha is None:
            self.alpha = 2.0 * self.rank
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout must lie in [0, 1), got {self.dropout!r}")
        if self.vit not in VIT_MODES:
            raise ValueError(f"LoraConfig.vit must be one of {VIT_MODES}, got {self.vit!r}")
        if not self.vit_lr_mult > 0:
            raise ValueError(f"LoraConfig.vit_lr_mult must be > 0, got {self.vit_lr_mult!r}")
        if self.wo_a_lora not in WO_A_MODES:
            raise ValueError(f"LoraConfig.wo_a_lora must be one of {WO_A_MODES}, got {self.wo_a_lora!r}")
        if self.expert_lora not in EXPERT_MODES:
            raise ValueError(f"LoraConfig.expert_lora must be one of {EXPERT_MODES}, got {self.expert_lora!r}")
        if not isinstance(self.train_head, bool):
            raise ValueError(f"LoraConfig.train_head must be a bool, got {self.train_head!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"LoraConfig.lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        for kind in ("include", "exclude"):
            for rule in getattr(self, kind):
                if not isinstance(rule, str) or not rule:
                    raise ValueError(f"LoraConfig.{kind}: every rule must be a non-empty string, got {rule!r}")

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on B·A."""
        return float(self.alpha) / self.rank

    def to_dict(self) -> dict:
        """Plain JSON-able dict of the resolved fields (round-trips through `from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_recipe(cls, node: Any) -> "LoraConfig":
        """The placement of a recipe's `lora` node (a dataclass or mapping; keys LoraConfig lacks, e.g. `enabled`, are dropped)."""
        values = dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)
        known = {f.name for f in dataclasses.fields(cls)} - {"include_from_preset"}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_dict(cls, data: dict) -> "LoraConfig":
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"LoraConfig: unknown keys {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)
