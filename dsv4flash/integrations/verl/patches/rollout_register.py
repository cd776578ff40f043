"""Runtime twin of DSV41-VERL-008: `register_rollout`, the public way to add a rollout backend to veRL.

Why: `verl.workers.rollout.base.get_rollout_class` looks backends up in the module-private
`_ROLLOUT_REGISTRY` (vllm, sglang, trtllm) and has no register function, while the replica side has
`RolloutReplicaRegistry.register`; an external backend (the CPU rollout server of dsv4flash, a vendor's
engine) can only be added by writing into the private dict.

How: `register_rollout(name, fqdn, mode="async")` records the server-adapter class by its fully
qualified name, exactly as the built-in entries are; registering the same name again with the same class is
a no-op, with another class a `ValueError`.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.workers.rollout.base._ROLLOUT_REGISTRY",)


def upstream_has_register_rollout() -> bool:
    """Probe: does a backend given to veRL's `register_rollout` resolve through `get_rollout_class`?"""
    from verl.workers.rollout import base

    register = getattr(base, "register_rollout", None)
    if not callable(register):
        return False
    saved = dict(base._ROLLOUT_REGISTRY)
    try:
        register("dsv4flash_probe", "verl.workers.rollout.base.BaseRollout")
        return base.get_rollout_class("dsv4flash_probe") is base.BaseRollout
    finally:
        base._ROLLOUT_REGISTRY.clear()
        base._ROLLOUT_REGISTRY.update(saved)


@verl_twin(
    patch_id="DSV41-VERL-008",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_ROLLOUT_REGISTER",
    tests=("tests/verl/test_rollout_register.py",),
    upstream_has_it=upstream_has_register_rollout,
)
def install(patcher: Patcher) -> None:
    """Add `register_rollout` to `verl.workers.rollout.base`."""
    from verl.workers.rollout import base

    def register_rollout(name: str, fqdn: str, mode: str = "async") -> None:
        """Register a rollout (server adapter) class for `get_rollout_class(name, mode)` by qualified name."""
        key = (name, mode)
        current = base._ROLLOUT_REGISTRY.get(key)
        if current is not None and current != fqdn:
            raise ValueError(f"Rollout {name} with mode {mode} is already registered as {current}, not {fqdn}")
        base._ROLLOUT_REGISTRY[key] = fqdn

    patcher.add(base, "register_rollout", register_rollout)
