"""The LoRA placement study as commands: placement grid (Table 2), image-swap check, gradient-energy and
zeroing diagnostics. See docs/placement.md."""

from dsv4flash.study.stats import GroupEnergy, gradient_energy, plateau_steps
from dsv4flash.study.variants import DEFAULT_VARIANTS, Variant, resolve_variant

__all__ = ["GroupEnergy", "gradient_energy", "plateau_steps", "DEFAULT_VARIANTS", "Variant", "resolve_variant"]
