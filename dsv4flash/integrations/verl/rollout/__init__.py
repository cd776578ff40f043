"""The `dsv4flash` rollout backend for veRL 0.9.1 (`actor_rollout_ref.rollout.name=dsv4flash`): generation on the
reference engine behind the interfaces veRL uses for vLLM.

| module    | what                                                                                          |
|-----------|-----------------------------------------------------------------------------------------------|
| `engine`  | `RolloutEngine`: resident base, synced adapter bound unmerged, cached decode, compact routes   |
| `weights` | a sync's payload in reference terms: adapter -> placement + canonical tensors, release-layout base decode |
| `server`  | `DSV4FlashRolloutServer`: the Ray actor the agent loop and the weight sync call (vLLM server's interface) |
| `replica` | `DSV4FlashReplica`: veRL's `RolloutReplica` starting the servers                              |
| `adapter` | `ServerAdapter`: veRL's `BaseRollout` in each actor worker; forwards `update_weights` in buckets |

`register()` adds the backend to veRL's two registries — `register_rollout` (DSV41-VERL-008) for the server
adapter, `RolloutReplicaRegistry` for the replica — and is idempotent; the veRL plugin calls it when a process
imports `verl.workers.rollout.replica`. See docs/verl.md, "CPU rollout backend".
"""

from __future__ import annotations

NAME = "dsv4flash"
SERVER_ADAPTER = "dsv4flash.integrations.verl.rollout.adapter.ServerAdapter"


def _load_replica():
    from dsv4flash.integrations.verl.rollout.replica import DSV4FlashReplica

    return DSV4FlashReplica


def register() -> None:
    """Register the backend with veRL (server adapter by qualified name, replica by loader); safe to repeat."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    if not callable(getattr(base, "register_rollout", None)):  # the twin is applied on import; make sure here
        from dsv4flash.integrations import verl as plugin

        plugin.apply("DSV41-VERL-008")
    base.register_rollout(NAME, SERVER_ADAPTER)
    RolloutReplicaRegistry.register(NAME, _load_replica)


def register_when_imported() -> None:
    """Register as soon as the process imports veRL's rollout replicas (never imports veRL itself)."""
    from dsv4flash.patching.post_import import when_imported

    when_imported("verl.workers.rollout.replica", register)
