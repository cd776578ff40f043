"""The placements the study compares, as recipe overrides of the train entry (`lora=<file>` plus switches).

A name is a LoRA recipe file (recipes/lora/*.yaml, e.g. `decoder_half`) or an alias below; the suffix
`+vit` adds ViT and aligner adapters at the shared learning rate (the study's "with ViT adapters").
"""

from __future__ import annotations

from dataclasses import dataclass

# Study names -> recipes/lora file (the study calls full-linear rank 16 `full_linear`).
ALIASES = {"full_linear": "full_linear_r16"}
VIT_SUFFIX = "+vit"
# The grid: every placement without ViT adapters, full-linear with them, and the 0.1x ViT LR fix.
DEFAULT_VARIANTS = ("full_linear", "full_linear_r8", "decoder_half", "encoder_half", "lean_attention",
                    "no_down_proj", "full_linear+vit", "vit_lr_0p1")


@dataclass(frozen=True)
class Variant:
    """A placement of the study: its name, the recipe's lora group file and the extra overrides."""

    name: str
    lora_file: str
    overrides: tuple[str, ...]

    def train_overrides(self) -> list[str]:
        """Overrides for `dsv4flash.train` that select this placement."""
        return [f"lora={self.lora_file}", *self.overrides]


def lora_files() -> list[str]:
    """Names of the LoRA recipe files (`lora=` choices)."""
    from pathlib import Path

    from dsv4flash.train.compose import config_path

    path = config_path()
    if path.startswith("pkg://"):
        from importlib.resources import files

        names = [p.name for p in (files(path[len("pkg://"):]) / "lora").iterdir()]
    else:
        names = [p.name for p in (Path(path) / "lora").iterdir()]
    return sorted(n[:-5] for n in names if n.endswith(".yaml") and n != "none.yaml")


def resolve_variant(name: str) -> Variant:
    """Study name -> Variant; an unknown name lists the known ones."""
    base, vit = (name[: -len(VIT_SUFFIX)], True) if name.endswith(VIT_SUFFIX) else (name, False)
    lora_file = ALIASES.get(base, base)
    known = lora_files()
    if lora_file not in known:
        raise ValueError(f"unknown placement {name!r}: expected a recipes/lora file {known} "
                         f"(aliases {sorted(ALIASES)}), optionally with the suffix {VIT_SUFFIX!r}")
    overrides = ("lora.vit=train", "lora.vit_lr_mult=1.0") if vit else ()
    if vit and lora_file == "vit_lr_0p1":
        raise ValueError(f"{name!r}: vit_lr_0p1 already trains ViT adapters (at 0.1x); drop {VIT_SUFFIX!r}")
    return Variant(name, lora_file, overrides)
