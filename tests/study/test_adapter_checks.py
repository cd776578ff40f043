"""Zeroing ablation (all zeroed == base exactly), gradient energy on a real adapter, and the image swap."""

import pytest
import torch

from dsv4flash.lora import apply_lora, lora_parameters, module_group
from dsv4flash.study.diagnose import group_energy, zeroing_ablation
from dsv4flash.study.image_swap import swap_images
from dsv4flash.study.session import open_session


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return open_session(["model.base=random", "data.val_size=6", "engine.batch_size=2", f"model.cache_dir={cache}"],
                        seed=0, log=lambda *_: None)


def _trained_like(session):
    """A decoder-half adapter with random non-zero B (as after training)."""
    model = session.model(None)
    apply_lora(model, "decoder_half")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, p in lora_parameters(model).items():
            if key.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def test_all_zeroed_adapter_is_the_base_exactly(session):
    base_loss = session.val_loss(session.model(None))
    model = _trained_like(session)
    rows = {r["zeroed"]: r for r in zeroing_ablation(model, session, base_loss)}
    assert rows["all"]["val_loss"] == base_loss  # bit-exact, not approx
    assert rows["none"]["val_loss"] != base_loss  # the adapter does something
    groups = {module_group(k) for k in lora_parameters(model)}
    assert set(rows) == groups | {"none", "all"}
    # The ablation restores the adapter afterwards.
    assert session.val_loss(model) == rows["none"]["val_loss"]
    # A wrong base loss is caught.
    with pytest.raises(AssertionError, match="must be the base exactly"):
        zeroing_ablation(model, session, base_loss + 1e-3)


def test_group_energy_covers_every_group_and_counts_parameters(session):
    model = _trained_like(session)
    energy, numel = group_energy(model, session, steps=1)
    params = lora_parameters(model)
    assert sum(numel.values()) == sum(p.numel() for p in params.values())
    assert set(energy) == {module_group(k) for k in params}
    assert all(e > 0 for e in energy.values())
    assert all(p.grad is None for p in params.values())  # nothing left behind for a later step


def test_swap_gives_each_question_another_picture(session):
    val = session.mixture.val
    swapped = swap_images(val)
    assert [ex.prompt for _, ex in swapped] == [ex.prompt for _, ex in val]
    assert [ex.answer for _, ex in swapped] == [ex.answer for _, ex in val]
    for (_, old), (_, new) in zip(val, swapped):
        assert not all(torch.equal(torch.from_numpy(a), torch.from_numpy(b)) for a, b in zip(old.images, new.images))
    assert sorted(ex.images[0].tobytes() for _, ex in swapped) == sorted(ex.images[0].tobytes() for _, ex in val)
    with pytest.raises(ValueError, match="≥ 2 validation questions with images"):
        swap_images(val[:1])
