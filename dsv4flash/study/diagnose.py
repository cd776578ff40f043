"""`python -m dsv4flash.study diagnose ADAPTER`: where the adapter's gradient goes, and what each group buys.

1. Gradient energy: over K training batches (the run's own stream, steps `start`..`start+K−1`) the SFT
   gradient at the adapter's weights (no update) is summed per module group c as G_c = Σ_k Σ_{p∈c} g²,
   next to n_c, with ρ_c = (G_c/G)/(n_c/n) and the LR multiplier 1/√ρ_c (stats.gradient_energy).
2. Zeroing ablation: validation loss with the whole adapter, with one group's B zeroed (ΔW = 0 there), and
   with every group zeroed — which must equal the base model's loss exactly.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from dsv4flash.study.plots import plot_diagnostics
from dsv4flash.study.session import Session, adapter_seed, open_session
from dsv4flash.study.stats import gradient_energy
from dsv4flash.study.tables import write_json, write_tables

ENERGY_COLUMNS = ("group", "n_c", "n_c/n", "G_c/G", "rho_c", "lr_mult")
ZERO_COLUMNS = ("zeroed", "params", "val_loss", "delta_val_loss")


def group_energy(model: torch.nn.Module, session: Session, steps: int, start: int = 0,
                 batch_size: int | None = None) -> tuple[dict[str, float], dict[str, int]]:
    """Σ over `steps` batches of squared adapter gradients per module group, and parameters per group."""
    from dsv4flash.engine.losses import sft_loss, token_logprobs
    from dsv4flash.lora import forward_with_early_stop, lora_parameters, module_group

    if steps < 1:
        raise ValueError(f"diagnose: steps must be ≥ 1, got {steps}")
    params = lora_parameters(model)
    groups = {key: module_group(key) for key in params}
    numel: dict[str, int] = defaultdict(int)
    for key, p in params.items():
        p.requires_grad_(True)
        numel[groups[key]] += p.numel()
    energy = {g: 0.0 for g in numel}
    forward = partial(forward_with_early_stop, model)
    bsz = batch_size or session.cfg.engine.batch_size
    for step in range(start, start + steps):
        batch = session.encoder.batch([ex for _, ex in session.mixture.train_batch(step, bsz)])
        logits = forward(batch.input_ids, batch.token_types, batch.images)
        sft_loss(token_logprobs(logits, batch.input_ids), batch.target_mask).backward()
        for key, p in params.items():
            if p.grad is not None:
                energy[groups[key]] += float(p.grad.double().pow(2).sum())
                p.grad = None
    return energy, dict(numel)


def zeroing_ablation(model: torch.nn.Module, session: Session, base_loss: float) -> list[dict]:
    """Val loss with the full adapter, each group zeroed, and all zeroed (== `base_loss` is checked)."""
    from dsv4flash.lora import load_lora_state_dict, lora_parameters, lora_state_dict, module_group, zero_lora

    saved = {k: v.clone() for k, v in lora_state_dict(model).items()}
    numel: dict[str, int] = defaultdict(int)
    for key, p in lora_parameters(model).items():
        numel[module_group(key)] += p.numel()
    full = session.val_loss(model)
    rows = [{"zeroed": "none", "params": 0, "val_loss": full, "delta_val_loss": 0.0}]
    for group in sorted(numel):
        zero_lora(model, group)
        loss = session.val_loss(model)
        rows.append({"zeroed": group, "params": numel[group], "val_loss": loss, "delta_val_loss": loss - full})
        load_lora_state_dict(model, saved)
    zero_lora(model)
    all_zero = session.val_loss(model)
    load_lora_state_dict(model, saved)
    rows.append({"zeroed": "all", "params": sum(numel.values()), "val_loss": all_zero,
                 "delta_val_loss": all_zero - full})
    if all_zero != base_loss:
        raise AssertionError(f"every group zeroed gives val loss {all_zero!r}, the base model {base_loss!r}: a "
                             "zeroed adapter must be the base exactly (ΔW = 0)")
    return rows


def run_diagnose(adapter: str, overrides=(), out: str = "study/diagnose", steps: int = 8, start: int = 0,
                 seed: int | None = None, log=print) -> dict:
    """Command body: energy table, zeroing table, bar chart -> {'energy', 'zeroing', 'base_loss'}."""
    if seed is None:
        seed = adapter_seed(adapter)
    session = open_session(overrides, seed, log=log)
    base_loss = session.val_loss(session.model(None))
    model = session.model(adapter)
    log(f"diagnose {adapter}: gradient energy over {steps} batches (steps {start}..{start + steps - 1}), "
        f"seed {session.cfg.seed}; base val loss {base_loss:.4f}")
    energy, numel = group_energy(model, session, steps, start)
    energy_rows = [g.as_row() for g in gradient_energy(energy, numel)]
    zero_rows = zeroing_ablation(model, session, base_loss)
    root = Path(out).expanduser()
    write_tables(root / "gradient_energy", energy_rows, ENERGY_COLUMNS, title=f"Gradient energy per group: {adapter}",
                 notes=[f"G_c: squared SFT gradient summed over {steps} training batches at the adapter's weights",
                        "rho_c = (G_c/G)/(n_c/n); lr_mult = 1/sqrt(rho_c) (Adam: the shared LR is ~sqrt(rho_c) × "
                        "the right one for group c)"])
    write_tables(root / "zeroing", zero_rows, ZERO_COLUMNS, title=f"Zeroing ablation: {adapter}",
                 notes=[f"base model val loss {base_loss:.6f}; 'all' equals it exactly (checked)"])
    plot_diagnostics(energy_rows, zero_rows, root / "diagnose.png", f"{adapter}")
    result = {"adapter": str(adapter), "seed": session.cfg.seed, "steps": steps, "base_loss": base_loss,
              "energy": energy_rows, "zeroing": zero_rows}
    write_json(root / "diagnose.json", result)
    log((root / "gradient_energy.md").read_text())
    log((root / "zeroing.md").read_text())
    return result
