"""Statistics of the study: plateau evaluation steps, per-group gradient energy ρ_c and its LR multiplier."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

# The study evaluated at steps 50, 70 and 100 of 100 and averaged the three: the plateau.
PLATEAU_FRACTIONS = (0.5, 0.7, 1.0)


def plateau_steps(steps: int, fractions: Sequence[float] = PLATEAU_FRACTIONS) -> tuple[int, ...]:
    """Evaluation steps of the plateau for a run of `steps` (50/70/100 for 100); distinct, ≥ 1, sorted."""
    if steps < 1:
        raise ValueError(f"steps must be ≥ 1, got {steps}")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"plateau fractions must lie in (0, 1], got {list(fractions)}")
    return tuple(sorted({max(1, round(f * steps)) for f in fractions}))


def eval_every_for(points: Sequence[int]) -> int:
    """Largest evaluation interval whose multiples include every plateau step."""
    return math.gcd(*points)


def plateau_loss(history: Sequence[Mapping], points: Sequence[int]) -> float:
    """Mean validation loss at the plateau steps of one run's history; a missing evaluation is an error."""
    by_step = {int(r["step"]): float(r["val_loss"]) for r in history if "val_loss" in r}
    missing = [p for p in points if p not in by_step]
    if missing:
        raise ValueError(f"run history has no validation loss at plateau steps {missing} "
                         f"(evaluated at {sorted(by_step)})")
    return sum(by_step[p] for p in points) / len(points)


@dataclass(frozen=True)
class GroupEnergy:
    """One module group: gradient energy G_c, parameters n_c, their shares, ρ_c and the LR multiplier 1/√ρ_c."""

    group: str
    energy: float
    params: int
    energy_share: float
    param_share: float
    rho: float
    lr_multiplier: float

    def as_row(self) -> dict:
        """Flat dict for tables."""
        return {"group": self.group, "G_c/G": self.energy_share, "n_c/n": self.param_share, "rho_c": self.rho,
                "lr_mult": self.lr_multiplier, "G_c": self.energy, "n_c": self.params}


def gradient_energy(energy: Mapping[str, float], params: Mapping[str, int]) -> list[GroupEnergy]:
    """Per group c: ρ_c = (G_c/G)/(n_c/n) — the mean squared gradient per parameter of c relative to the whole
    adapter. With Adam the update size is ~lr regardless of gradient scale, so a group whose per-parameter
    gradient is √ρ_c times the adapter's is moved √ρ_c times too far relative to its signal: 1/√ρ_c."""
    if set(energy) != set(params):
        raise ValueError(f"gradient_energy: energy groups {sorted(energy)} and parameter groups {sorted(params)} differ")
    if any(n <= 0 for n in params.values()):
        raise ValueError(f"gradient_energy: every group needs > 0 parameters, got {dict(params)}")
    if any(g < 0 or not math.isfinite(g) for g in energy.values()):
        raise ValueError(f"gradient_energy: energies must be finite and ≥ 0, got {dict(energy)}")
    total_g, total_n = sum(energy.values()), sum(params.values())
    if total_g <= 0:
        raise ValueError("gradient_energy: all gradients are zero (is the adapter frozen, or B and A both zero?)")
    rows = []
    for c in sorted(energy, key=lambda c: -energy[c]):
        g_share, n_share = energy[c] / total_g, params[c] / total_n
        rho = g_share / n_share
        rows.append(GroupEnergy(c, energy[c], params[c], g_share, n_share, rho,
                                1.0 / math.sqrt(rho) if rho > 0 else math.inf))
    return rows
