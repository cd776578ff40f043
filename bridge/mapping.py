"""The one name table: release names ↔ reference-model names ↔ Megatron-Core names, as wildcard rules.

Three namespaces:

- **release**: the checkpoint's keys (`layers.3.attn.wq_a.weight`, plus `<stem>.scale` siblings);
- **reference**: `dsv4flash.model.transformer.Transformer`'s `state_dict()` keys. The reference model is
  built on the release's module tree, so this map is the identity on every non-scale name (declared by
  `reference_name`, checked by the tests against the model itself);
- **megatron**: the names of the Megatron-Core model (`dsv4flash.integrations.mcore.csa2`) for the text
  stack and its first-stage ViT, aligner and image delimiters (megatron-bridge's `deepseek_v41_vision.py`),
  and megatron-bridge-style names for DSpark `mtp.*` (which that model does not build), so that a
  Megatron-named import and a Megatron-Bridge registry cover the whole checkpoint.

A `Rule` is declarative, like a Megatron-Bridge `MegatronParamMapping`: a Megatron pattern, one or more
release patterns (`*` = one integer index, captured in order and shared by every pattern of the rule), the
tensor-parallel `layout` of the Megatron tensor and how it is assembled (`transform`):

| layout | tensor-parallel split of the Megatron tensor                   | Megatron-Bridge mapping |
|--------|----------------------------------------------------------------|-------------------------|
| copy   | replicated                                                     | ReplicatedMapping       |
| rows   | dim 0 (column-parallel linears, vocab-parallel embeddings)     | ColumnParallelMapping   |
| cols   | dim 1 (row-parallel linears)                                   | RowParallelMapping      |
| glu    | `linear_fc1` = [gate ; up], each half split along dim 0         | GatedMLPMapping         |

`transform` "concat" stacks the release tensors' rows in pattern order (a single release tensor is the
Megatron tensor itself; `glu` with two patterns is [w1 ; w3]); "qkv" reorders a fused [q ; k ; v] into
Megatron's per-head [q_h ; k_h ; v_h] (Megatron-Bridge's ConcatenatedQKVMapping). Quantization scales
(`<stem>.scale` of an FP8/MXFP4 weight) have no rule: they travel with their weight and are consumed by
its decode. `resolve` applies the table to a list of release names and refuses anything it cannot place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dsv4flash.release.quant_plan import QuantRole, quant_role, scale_name

__all__ = ["Rule", "Mapped", "MappingError", "RULES", "LAYOUTS", "resolve", "megatron_lookup", "release_lookup",
           "reference_name", "is_carried_scale", "megatron_names"]

LAYOUTS = ("copy", "rows", "cols", "glu")
TRANSFORMS = ("concat", "qkv")
_QUANTIZED = (QuantRole.DENSE_FP8, QuantRole.EXPERT_MXFP4, QuantRole.ENGRAM_FP8)


class MappingError(ValueError):
    """A name the table cannot place (unknown, ambiguous, or missing its partner); names the tensor."""


@dataclass(frozen=True)
class Rule:
    """One declarative mapping: Megatron pattern <- release pattern(s), with layout and assembly."""

    megatron: str
    release: tuple[str, ...]
    layout: str
    transform: str = "concat"
    part: str = "text"  # text | vision | mtp
    expert_capture: int | None = None  # which `*` is the routed-expert id

    def __post_init__(self) -> None:
        stars = self.megatron.count("*")
        if self.layout not in LAYOUTS or self.transform not in TRANSFORMS:
            raise ValueError(f"rule {self.megatron}: bad layout/transform {self.layout}/{self.transform}")
        if any(p.count("*") != stars for p in self.release):
            raise ValueError(f"rule {self.megatron}: every pattern needs the same {stars} wildcard(s)")
        if any("*" in c and c != "*" for p in (self.megatron, *self.release) for c in p.split(".")):
            raise ValueError(f"rule {self.megatron}: a wildcard must be a whole dotted component")


@dataclass(frozen=True)
class Mapped:
    """One Megatron tensor and the release tensor(s) it is made of (all wildcards resolved)."""

    megatron: str
    release: tuple[str, ...]
    layout: str
    transform: str
    part: str
    expert: int | None = None

    @property
    def reference(self) -> tuple[str, ...]:
        """The reference-model names of the sources (the release names)."""
        return tuple(reference_name(r) for r in self.release)


def reference_name(release: str) -> str:
    """Release name -> reference-model `state_dict` key: the identity (the model uses the release tree)."""
    return release


# ------------------------------------------------------------------------------------------ the table
def _block(rel: str, meg: str, part: str) -> list[Rule]:
    """Rules of one V4.1 block (backbone `layers.*` or DSpark `mtp.*`), release prefix `rel`, Megatron `meg`."""
    att = meg + "self_attention."
    rules = [
        Rule(meg + "input_layernorm.weight", (rel + "attn_norm.weight",), "copy"),
        Rule(meg + "pre_mlp_layernorm.weight", (rel + "ffn_norm.weight",), "copy"),
        Rule(att + "linear_q_down.weight", (rel + "attn.wq_a.weight",), "rows"),
        Rule(att + "linear_q_up.weight", (rel + "attn.wq_b.weight",), "rows"),
        Rule(att + "linear_kv.weight", (rel + "attn.wkv.weight",), "rows"),
        Rule(att + "linear_o_group_proj.weight", (rel + "attn.wo_a.weight",), "rows"),
        Rule(att + "linear_proj.weight", (rel + "attn.wo_b.weight",), "cols"),
        Rule(att + "q_layernorm.weight", (rel + "attn.q_norm.weight",), "copy"),
        Rule(att + "kv_layernorm.weight", (rel + "attn.kv_norm.weight",), "copy"),
        Rule(att + "attn_sink", (rel + "attn.attn_sink",), "rows"),
        Rule(att + "compressor.linear_kv.weight", (rel + "attn.compressor.wkv.weight",), "rows"),
        Rule(att + "compressor.linear_gate.weight", (rel + "attn.compressor.wgate.weight",), "rows"),
        Rule(att + "compressor.norm.weight", (rel + "attn.compressor.norm.weight",), "copy"),
        Rule(att + "indexer.linear_q_up.weight", (rel + "attn.indexer.wq_b.weight",), "rows"),
        Rule(att + "indexer.linear_weights_proj.weight", (rel + "attn.indexer.weights_proj.weight",), "rows"),
        Rule(att + "indexer.linear_k.weight", (rel + "attn.indexer.wk.weight",), "rows"),
        Rule(att + "indexer.k_layernorm.weight", (rel + "attn.indexer.k_norm.weight",), "copy"),
        *(Rule(f"{meg}{module}_hyper_connection.{p}", (f"{rel}hc_{site}_{p}",), "copy")
          for site, module in (("attn", "self_attn"), ("ffn", "mlp")) for p in ("fn", "base", "scale")),
        Rule(meg + "mlp.router.weight", (rel + "ffn.gate.weight",), "copy"),
        Rule(meg + "mlp.router.expert_bias", (rel + "ffn.gate.bias",), "copy"),
        Rule(meg + "mlp.router.image_balance.expert_bias", (rel + "ffn.gate.bias_vl",), "copy"),
        Rule(meg + "mlp.experts.local_experts.*.linear_fc1.weight",
             (rel + "ffn.experts.*.w1.weight", rel + "ffn.experts.*.w3.weight"), "glu", expert_capture=1),
        Rule(meg + "mlp.experts.local_experts.*.linear_fc2.weight", (rel + "ffn.experts.*.w2.weight",), "cols",
             expert_capture=1),
        Rule(meg + "mlp.shared_experts.linear_fc1.weight",
             (rel + "ffn.shared_experts.w1.weight", rel + "ffn.shared_experts.w3.weight"), "glu"),
        Rule(meg + "mlp.shared_experts.linear_fc2.weight", (rel + "ffn.shared_experts.w2.weight",), "cols"),
        *(Rule(f"{meg}engram.{n}", (f"{rel}engram.{n}",), "copy")
          for n in ("embed.weight", "wkv.weight", "q_weight", "k_weight")),
    ]
    return [Rule(r.megatron, r.release, r.layout, r.transform, part, r.expert_capture) for r in rules]


_VIT = "vision_model.decoder.layers.*."
_TEXT_ENDS = [
    Rule("embedding.word_embeddings.weight", ("embed.weight",), "rows"),
    Rule("decoder.final_layernorm.weight", ("norm.weight",), "copy"),
    Rule("output_layer.weight", ("head.weight",), "rows"),
]
_VISION = [Rule(m, r, layout, transform, "vision") for m, r, layout, transform in (
    ("vision_model.patch_embed.proj.weight", ("vision.patch_embed.proj.weight",), "copy", "concat"),
    ("vision_model.patch_embed.proj.bias", ("vision.patch_embed.proj.bias",), "copy", "concat"),
    (_VIT + "input_layernorm.weight", ("vision.blocks.*.norm1.weight",), "copy", "concat"),
    (_VIT + "self_attention.linear_qkv.weight", ("vision.blocks.*.attn.wqkv.weight",), "rows", "qkv"),
    (_VIT + "self_attention.linear_qkv.bias", ("vision.blocks.*.attn.wqkv.bias",), "rows", "qkv"),
    (_VIT + "self_attention.linear_proj.weight", ("vision.blocks.*.attn.wo.weight",), "cols", "concat"),
    (_VIT + "self_attention.linear_proj.bias", ("vision.blocks.*.attn.wo.bias",), "copy", "concat"),
    (_VIT + "pre_mlp_layernorm.weight", ("vision.blocks.*.norm2.weight",), "copy", "concat"),
    (_VIT + "mlp.linear_fc1.weight", ("vision.blocks.*.mlp.w1.weight",), "glu", "concat"),  # stored [gate ; up]
    (_VIT + "mlp.linear_fc2.weight", ("vision.blocks.*.mlp.w2.weight",), "cols", "concat"),
    ("vision_model.decoder.final_layernorm.weight", ("vision.norm.weight",), "copy", "concat"),
    ("vision_projection.encoder.linear_fc1.weight", ("aligner.w1.weight",), "rows", "concat"),
    ("vision_projection.encoder.linear_fc1.bias", ("aligner.w1.bias",), "rows", "concat"),
    ("vision_projection.encoder.linear_fc2.weight", ("aligner.w2.weight",), "cols", "concat"),
    ("vision_projection.encoder.linear_fc2.bias", ("aligner.w2.bias",), "copy", "concat"),
    *((f"embedding.{n}", (n,), "copy", "concat") for n in ("image_start", "image_newline", "image_end")),
)]
_MTP = "mtp.layers.*."
_DSPARK = [Rule(m, r, layout, "concat", "mtp") for m, r, layout in (
    (_MTP + "main_proj.weight", ("mtp.*.main_proj.weight",), "rows"),
    (_MTP + "main_norm.weight", ("mtp.*.main_norm.weight",), "copy"),
    (_MTP + "final_layernorm.weight", ("mtp.*.norm.weight",), "copy"),
    (_MTP + "markov_head.word_embeddings.weight", ("mtp.*.markov_head.embed.weight",), "rows"),
    (_MTP + "markov_head.output_layer.weight", ("mtp.*.markov_head.head.weight",), "rows"),
    (_MTP + "confidence_head.weight", ("mtp.*.confidence_head.proj.weight",), "copy"),
)]

RULES: tuple[Rule, ...] = (
    *_TEXT_ENDS,
    *_block("layers.*.", "decoder.layers.*.", "text"),
    *_VISION,
    *_block("mtp.*.", _MTP + "mtp_model_layer.", "mtp"),
    *_DSPARK,
)


# ------------------------------------------------------------------------------------------ lookups
def _key(name: str) -> tuple[str, tuple[str, ...]]:
    """A name's wildcard form and its integer components: `layers.3.attn` -> (`layers.*.attn`, ("3",)).

    A `*` is one whole dotted integer component (Megatron-Bridge's `*` matches `\\d+`), so a table lookup is
    a dictionary lookup on this form."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts), tuple(p for p in parts if p.isdigit())


def _fill(pattern: str, captures: tuple[str, ...]) -> str:
    """Substitute captures for the `*`s, in order."""
    it = iter(captures)
    return ".".join(next(it) if p == "*" else p for p in pattern.split("."))


def _index(pairs) -> dict:
    """pattern -> value, refusing a pattern claimed twice (the table would be ambiguous)."""
    out: dict = {}
    for pattern, value in pairs:
        if pattern in out:
            raise ValueError(f"name table: pattern {pattern} appears in two rules")
        out[pattern] = value
    return out


_BY_RELEASE = _index((p, (rule, pos)) for rule in RULES for pos, p in enumerate(rule.release))
_BY_MEGATRON = _index((rule.megatron, rule) for rule in RULES)


def _mapped(rule: Rule, captures: tuple[str, ...]) -> Mapped:
    expert = int(captures[rule.expert_capture]) if rule.expert_capture is not None else None
    return Mapped(_fill(rule.megatron, captures), tuple(_fill(p, captures) for p in rule.release), rule.layout,
                  rule.transform, rule.part, expert)


def release_lookup(name: str) -> tuple[Mapped, int]:
    """The Mapped a release tensor belongs to, and its position among that Mapped's sources."""
    pattern, captures = _key(name)
    if pattern not in _BY_RELEASE:
        raise MappingError(f"{name}: no rule of the name table maps this release tensor")
    rule, pos = _BY_RELEASE[pattern]
    return _mapped(rule, captures), pos


def megatron_lookup(name: str) -> Mapped:
    """The Mapped of a Megatron tensor name (sequential-expert naming, global expert ids)."""
    pattern, captures = _key(name)
    if pattern not in _BY_MEGATRON:
        raise MappingError(f"{name}: no rule of the name table maps this Megatron tensor")
    return _mapped(_BY_MEGATRON[pattern], captures)


def is_carried_scale(name: str, names: set[str] | frozenset[str]) -> bool:
    """Whether `name` is the `.scale` of a quantized weight present in `names` (consumed by its decode)."""
    if not name.endswith(".scale"):
        return False
    weight = name[: -len(".scale")] + ".weight"
    return weight in names and quant_role(weight) in _QUANTIZED and scale_name(weight) == name


def resolve(names: Iterable[str]) -> list[Mapped]:
    """Apply the table to a checkpoint's release names: every Megatron tensor, each exactly once, in the order
    of its first source. Every name must be placed (scales travel with their weight), every rule instance
    complete (a `w1` needs its `w3`), and no Megatron name may repeat."""
    names = list(names)
    present = frozenset(names)
    groups: dict[str, tuple[Mapped, dict[int, str]]] = {}
    for name in names:
        if is_carried_scale(name, present):
            continue
        mapped, pos = release_lookup(name)
        entry = groups.setdefault(mapped.megatron, (mapped, {}))
        if pos in entry[1]:
            raise MappingError(f"{name}: listed twice")
        entry[1][pos] = name
    out = []
    for mapped, got in groups.values():
        missing = [r for i, r in enumerate(mapped.release) if i not in got]
        if missing:
            raise MappingError(f"{got[min(got)]}: Megatron {mapped.megatron} also needs {missing[0]}, which is absent")
        out.append(mapped)
    return out


def megatron_names(names: Iterable[str]) -> dict[str, str]:
    """release name -> the Megatron tensor it goes into (scales map to their weight's Megatron tensor)."""
    names = list(names)
    present = frozenset(names)
    out = {}
    for m in resolve(names):
        for r in m.release:
            out[r] = m.megatron
            if quant_role(r) in _QUANTIZED and scale_name(r) in present:
                out[scale_name(r)] = m.megatron
    return out
