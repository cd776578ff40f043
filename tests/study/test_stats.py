"""Study statistics: plateau steps and ρ_c on hand-built gradients."""

import math

import pytest
import torch

from dsv4flash.study.stats import eval_every_for, gradient_energy, plateau_loss, plateau_steps


def test_plateau_steps_match_the_study():
    assert plateau_steps(100) == (50, 70, 100)
    assert eval_every_for(plateau_steps(100)) == 10
    assert plateau_steps(10) == (5, 7, 10)
    assert plateau_steps(2) == (1, 2)  # rounding collisions collapse
    with pytest.raises(ValueError, match="steps"):
        plateau_steps(0)


def test_plateau_loss_means_the_plateau_evaluations_and_names_missing_ones():
    history = [{"step": 0, "val_loss": 9.0}, {"step": 5, "val_loss": 1.0}, {"step": 7, "val_loss": 2.0},
               {"step": 8, "loss": 3.0}, {"step": 10, "val_loss": 6.0}]
    assert plateau_loss(history, (5, 7, 10)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match=r"\[6\]"):
        plateau_loss(history, (5, 6))


def test_rho_on_hand_built_gradients():
    # Two parameter groups with known gradients: a has 4 entries of gradient 1, b 12 entries of 0.5.
    grads = {"a": [torch.ones(2, 2)], "b": [torch.full((3, 2), 0.5), torch.full((6,), 0.5)]}
    energy = {g: sum(float(t.pow(2).sum()) for t in ts) for g, ts in grads.items()}
    numel = {g: sum(t.numel() for t in ts) for g, ts in grads.items()}
    assert energy == {"a": 4.0, "b": 3.0} and numel == {"a": 4, "b": 12}
    rows = {r.group: r for r in gradient_energy(energy, numel)}
    assert rows["a"].energy_share == pytest.approx(4 / 7) and rows["a"].param_share == pytest.approx(4 / 16)
    assert rows["a"].rho == pytest.approx(16 / 7) and rows["b"].rho == pytest.approx(4 / 7)
    assert rows["a"].lr_multiplier == pytest.approx(math.sqrt(7 / 16))
    assert rows["b"].lr_multiplier == pytest.approx(math.sqrt(7 / 4))
    # Shares sum to one; the parameter-weighted mean of ρ is one by construction.
    assert sum(r.energy_share for r in rows.values()) == pytest.approx(1.0)
    assert sum(r.rho * r.param_share for r in rows.values()) == pytest.approx(1.0)
    # Equal per-parameter gradient everywhere -> ρ = 1, multiplier 1.
    flat = gradient_energy({"x": 2.0, "y": 6.0}, {"x": 1, "y": 3})
    assert all(r.rho == pytest.approx(1.0) and r.lr_multiplier == pytest.approx(1.0) for r in flat)
    # A group without gradient: ρ = 0, multiplier infinite (it never moves under Adam's sign-like step).
    dead = {r.group: r for r in gradient_energy({"x": 0.0, "y": 1.0}, {"x": 5, "y": 5})}
    assert dead["x"].rho == 0.0 and dead["x"].lr_multiplier == math.inf


def test_rho_rejects_bad_input():
    with pytest.raises(ValueError, match="differ"):
        gradient_energy({"a": 1.0}, {"b": 1})
    with pytest.raises(ValueError, match="all gradients are zero"):
        gradient_energy({"a": 0.0}, {"a": 3})
    with pytest.raises(ValueError, match="> 0 parameters"):
        gradient_energy({"a": 1.0}, {"a": 0})
