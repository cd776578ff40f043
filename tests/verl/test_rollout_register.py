"""DSV41-VERL-008: `register_rollout` adds a rollout backend that veRL's own `get_rollout_class` then resolves."""

from __future__ import annotations

import pytest

from tests.vllm._twins import stock

PATCH_ID = "DSV41-VERL-008"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]

FQDN = "verl.workers.rollout.base.BaseRollout"  # any importable class: resolution is by qualified name


def test_registered_backend_resolves_through_get_rollout_class(patch_form):
    from verl.workers.rollout import base

    before = dict(base._ROLLOUT_REGISTRY)
    try:
        base.register_rollout("dsv4flash_probe", FQDN)
        base.register_rollout("dsv4flash_probe", FQDN)  # the same class again: a no-op
        cls = base.get_rollout_class("dsv4flash_probe", "async")
        with pytest.raises(ValueError, match="already registered as .*BaseRollout"):
            base.register_rollout("dsv4flash_probe", "verl.workers.rollout.vllm_rollout.ServerAdapter")
        with pytest.raises(ValueError, match="already registered"):
            base.register_rollout("vllm", FQDN)  # a built-in cannot be replaced by accident
        patch_form.record("class", f"{cls.__module__}.{cls.__qualname__}")
        patch_form.record("added", sorted(set(base._ROLLOUT_REGISTRY) - set(before)))
    finally:
        base._ROLLOUT_REGISTRY.clear()
        base._ROLLOUT_REGISTRY.update(before)


def test_stock_verl_has_no_register_function():
    from verl.workers.rollout import base

    with stock(PATCH_ID):
        assert not hasattr(base, "register_rollout")
