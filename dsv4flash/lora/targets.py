"""Which modules of a reference model a `LoraConfig` adapts: candidates, rule matching, module groups.

Candidates are the modules LoRA can wrap: every `nn.Linear` of the language model, vision tower and
aligner, the grouped `attn.wo_a`, the routed experts' `w1/w2/w3` (adapted per layer and projection as
one packed unit) and the router `ffn.gate`. Never candidates: the indexer (its selection is discrete, it
receives no LM gradient) and the DSpark draft blocks `mtp.*` (never run in training).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from torch import nn

from dsv4flash.lora.config import VIT_RULES, LoraConfig
from dsv4flash.model.attention import GroupedOutputProjection
from dsv4flash.model.moe import Gate

_LAYER = re.compile(r"layers\.(\d+)\.")
_EXPERT = re.compile(r"(layers\.(\d+)\.ffn)\.experts\.(\d+)\.(w[123])")

# Module groups (diagnostics, zeroing ablations, per-group LR). Checked in order; the first match wins.
_GROUP_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple((g, re.compile(p)) for g, p in (
    ("mtp", r"mtp\.|(^|\.)mtp$"),
    ("indexer", r"(^|\.)attn\.indexer(\.|$)"),
    ("compressor", r"(^|\.)attn\.compressor(\.|$)"),
    ("attn_q", r"(^|\.)attn\.(wq_a|wq_b|q_norm)(\.|$)"),
    ("attn_kv", r"(^|\.)attn\.(wkv|kv_norm)(\.|$)"),
    ("attn_out", r"(^|\.)attn\.(wo_a|wo_b)(\.|$)"),
    ("attn_sink", r"(^|\.)attn\.attn_sink$"),
    ("shared_expert", r"(^|\.)ffn\.shared_experts(\.|$)"),
    ("routed_gate_up", r"(^|\.)ffn\.experts(_lora)?\.(\d+\.)?w[13](\.|$)"),
    ("routed_down", r"(^|\.)ffn\.experts(_lora)?\.(\d+\.)?w2(\.|$)"),
    ("router", r"(^|\.)ffn\.gate(\.|$)"),
    ("engram", r"(^|\.)engram(\.|$)"),
    ("mhc", r"(^|\.)hc_(attn|ffn)_(fn|base|scale)$"),
    ("norm", r"(^|\.)(attn_norm|ffn_norm)(\.|$)|^norm(\.|$)"),
    ("vit", r"^vision(\.|$)"),
    ("aligner", r"^aligner(\.|$)"),
    ("image_delimiters", r"^image_(start|end|newline)$"),
    ("embed", r"^embed(\.|$)"),
    ("head", r"^head(\.|$)"),
))
GROUPS: tuple[str, ...] = tuple(g for g, _ in _GROUP_PATTERNS)
# Coarser names accepted wherever a group is (zero_lora, diagnostics).
GROUP_ALIASES: dict[str, tuple[str, ...]] = {
    "attention": ("attn_q", "attn_kv", "attn_out"),
    "routed_experts": ("routed_gate_up", "routed_down"),
    "experts": ("shared_expert", "routed_gate_up", "routed_down"),
    "vision": ("vit", "aligner"),
}


def module_group(name: str) -> str:
    """Group of a module, parameter or adapter name (release, in-memory or PEFT key) -> one of GROUPS."""
    name = name.removeprefix("base_model.model.")
    for group, pattern in _GROUP_PATTERNS:
        if pattern.search(name):
            return group
    raise ValueError(f"module_group: {name!r} belongs to no known module group {GROUPS}")


def expand_groups(groups: str | tuple[str, ...] | list[str]) -> frozenset[str]:
    """Group names and aliases -> the set of fine group names; unknown names are an error."""
    items = (groups,) if isinstance(groups, str) else tuple(groups)
    out: set[str] = set()
    for item in items:
        if item in GROUP_ALIASES:
            out.update(GROUP_ALIASES[item])
        elif item in GROUPS:
            out.add(item)
        else:
            raise ValueError(f"unknown module group {item!r}; expected one of {GROUPS} or {sorted(GROUP_ALIASES)}")
    return frozenset(out)


@lru_cache(maxsize=1024)
def compile_rule(rule: str) -> re.Pattern:
    """A target rule -> compiled full-match regex (`re:` prefix = raw regex, otherwise dotted glob)."""
    if rule.startswith("re:"):
        try:
            return re.compile(rule[3:])
        except re.error as exc:
            raise ValueError(f"LoRA target rule {rule!r}: invalid regex ({exc})") from None
    out, i = [], 0
    while i < len(rule):
        ch = rule[i]
        if rule.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if ch == "*":
            out.append(r"[^.]*")
        elif ch == "?":
            out.append(r"[^.]")
        elif ch == "[":
            end = rule.find("]", i + 1)
            if end < 0:
                raise ValueError(f"LoRA target rule {rule!r}: unclosed '['")
            out.append("[" + rule[i + 1:end].replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(ch))
        i += 1
    return re.compile("".join(out))


def rule_matches(rule: str, name: str) -> bool:
    """Whether a target rule matches a release module name in full."""
    return compile_rule(rule).fullmatch(name) is not None


@dataclass(frozen=True)
class Candidate:
    """One module LoRA could wrap: release name, kind and (for layer modules) the layer id."""

    name: str
    kind: str  # "linear" | "grouped" | "expert" | "router"
    layer: int | None


def layer_of(name: str) -> int | None:
    """Backbone layer id of a `layers.{i}.…` name, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def candidates(model: nn.Module) -> list[Candidate]:
    """Every module of `model` that LoRA can target, in module order (indexer and `mtp.*` left out)."""
    from dsv4flash.lora.layers import is_lora_module

    out: list[Candidate] = []
    for name, module in model.named_modules():
        if not name or name.startswith("mtp.") or module_group_or_none(name) == "indexer":
            continue
        if is_lora_module(module):
            base_kind = getattr(module, "lora_kind")
            out.append(Candidate(name, base_kind, layer_of(name)))
        elif isinstance(module, GroupedOutputProjection):
            out.append(Candidate(name, "grouped", layer_of(name)))
        elif isinstance(module, Gate):
            out.append(Candidate(name, "router", layer_of(name)))
        elif isinstance(module, nn.Linear):
            kind = "expert" if _EXPERT.fullmatch(name) else "linear"
            out.append(Candidate(name, kind, layer_of(name)))
    return out


def module_group_or_none(name: str) -> str | None:
    """`module_group`, or None for names outside every group."""
    try:
        return module_group(name)
    except ValueError:
        return None


def layer_ids(spec: str, num_layers: int, decoder_start: int) -> frozenset[int]:
    """`all` | `encoder` | `decoder` | `"0-5,8"` -> the backbone layer ids it names."""
    if spec == "all":
        return frozenset(range(num_layers))
    if spec == "encoder":
        return frozenset(range(decoder_start))
    if spec == "decoder":
        return frozenset(range(decoder_start, num_layers))
    ids: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            ids.update(range(int(lo), int(hi if hi else lo) + 1))
    except ValueError:
        raise ValueError(f"LoraConfig.layers: {spec!r} is not 'all', 'encoder', 'decoder' or a list of ids/ranges "
                         "like '0-5,8'") from None
    bad = sorted(i for i in ids if not 0 <= i < num_layers)
    if bad:
        raise ValueError(f"LoraConfig.layers: {spec!r} names layers {bad} outside 0..{num_layers - 1}")
    return frozenset(ids)


def kv_write_modules(model: nn.Module) -> tuple[str, ...]:
    """Modules that write the CED source layer's KV: its window `attn.wkv` and its compressor projections."""
    start = model.cfg.decoder_start
    attn = model.layers[start].attn
    names = [f"layers.{start}.attn.wkv"]
    if attn.compressor is not None:
        names.append(f"layers.{start}.attn.compressor.wkv")
        if attn.compressor.wgate is not None:
            names.append(f"layers.{start}.attn.compressor.wgate")
    return tuple(names)


def resolve_targets(model: nn.Module, cfg: LoraConfig) -> list[Candidate]:
    """The candidates `cfg` selects on `model`, in module order; clear errors for impossible rules."""
    cands = candidates(model)
    text = model.cfg.text
    wanted_layers = layer_ids(cfg.layers, text.num_hidden_layers, model.cfg.decoder_start)
    include = list(cfg.include) + (list(VIT_RULES) if cfg.vit == "train" else [])
    include += ["head"] if cfg.train_head else []
    _check_rules(cfg, cands, include)
    frozen = set(kv_write_modules(model)) if cfg.freeze_kv_write else set()
    selected = []
    for cand in cands:
        if cand.layer is not None and cand.layer not in wanted_layers:
            continue
        if cand.name in frozen or not any(rule_matches(r, cand.name) for r in include):
            continue
        if any(rule_matches(r, cand.name) for r in cfg.exclude):
            continue
        if cand.name.startswith(("vision.", "aligner.")) and cfg.vit != "train":
            continue
        selected.append(cand)
    _check_experts_complete(model, selected)
    if not selected:
        raise ValueError(f"LoRA placement {cfg.preset!r} (include={cfg.include}, exclude={cfg.exclude}, "
                         f"layers={cfg.layers!r}) selects no module of this model")
    return selected


def _check_rules(cfg: LoraConfig, cands: list[Candidate], include: list[str]) -> None:
    for rule in include:
        if "indexer" in rule:
            raise ValueError(f"LoRA target rule {rule!r}: the indexer never gets LoRA (its top-k selection is "
                             "discrete, so it receives no LM gradient; docs/architecture.md §13)")
        if rule.startswith("mtp") or rule.startswith("re:mtp"):
            raise ValueError(f"LoRA target rule {rule!r}: DSpark draft blocks (mtp.*) are never run in training")
    explicit = list(cfg.exclude) + ([] if cfg.include_from_preset else list(cfg.include))
    names = [c.name for c in cands]
    for rule in explicit:
        if not any(rule_matches(rule, n) for n in names):
            raise ValueError(f"LoRA target rule {rule!r} matches no module of this model (rules use release "
                             f"module names, e.g. {names[:3]}; '*' stays inside one dotted component, '**' "
                             "crosses them)")
    if cfg.vit == "train" and not any(n.startswith("vision.") for n in names):
        raise ValueError("LoraConfig.vit='train' but this model has no vision tower")
    if cfg.vit != "train":
        for rule in cfg.include:
            if any(rule_matches(rule, n) for n in names if n.startswith(("vision.", "aligner."))):
                raise ValueError(f"LoRA target rule {rule!r} selects ViT/aligner modules but vit='frozen'; "
                                 "set vit='train' to adapt them")


def _check_experts_complete(model: nn.Module, selected: list[Candidate]) -> None:
    chosen: dict[tuple[str, str], set[int]] = {}
    for cand in selected:
        if cand.kind == "expert":
            m = _EXPERT.fullmatch(cand.name)
            chosen.setdefault((m.group(1), m.group(4)), set()).add(int(m.group(3)))
    for (moe_name, proj), experts in chosen.items():
        total = len(model.get_submodule(moe_name).experts)
        if len(experts) != total:
            missing = sorted(set(range(total)) - experts)[:8]
            raise ValueError(f"LoRA on {moe_name}.experts.*.{proj}: routed-expert LoRA is packed per layer and "
                             f"projection, so all {total} experts must be targeted (missing e.g. {missing})")


def expert_site(name: str) -> tuple[str, int, str] | None:
    """`layers.{i}.ffn.experts.{e}.{w}` -> (`layers.{i}.ffn`, e, w), else None."""
    m = _EXPERT.fullmatch(name)
    return (m.group(1), int(m.group(3)), m.group(4)) if m else None


@lru_cache(maxsize=2)
def meta_model(config_json: str) -> nn.Module:
    """The reference model of an HF config (JSON text) on the meta device, to resolve placements on without
    memory for weights (~10 s for the full-size module tree)."""
    import json

    from dsv4flash.config import DSV41FlashConfig
    from dsv4flash.model.transformer import Transformer

    return Transformer(DSV41FlashConfig.from_hf(json.loads(config_json)), device="meta", seed=None)
