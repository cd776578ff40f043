"""`verl.plugins` entry point: veRL imports this module on `import verl`; importing it applies the twins,
registers the CPU development platform and the `dsv4flash` rollout backend.

veRL swallows plugin import errors at DEBUG level, so failures are logged here at WARNING instead.
"""

from __future__ import annotations

import logging

try:
    from dsv4flash.integrations.verl import register, register_bridge_when_imported
    from dsv4flash.integrations.verl.cpu_platform import (enter_cpu_development_mode, register_cpu_engines,
                                                             register_platform)
    from dsv4flash.integrations.verl.replay_check import install_when_imported as install_replay_check
    from dsv4flash.integrations.verl.rollout import register_when_imported as register_rollout_backend

    register_platform()  # selectable with VERL_PLATFORM=cpu only; never auto-detected
    register_cpu_engines()  # veRL's Megatron engines for device `cpu`, once their module is imported
    enter_cpu_development_mode()  # VERL_PLATFORM=cpu only: megatron-core redirect, megatron-bridge import shims
    register_bridge_when_imported()  # veRL's Megatron engine calls AutoBridge.from_hf_pretrained on V4.1
    register_rollout_backend()  # rollout.name=dsv4flash, once verl.workers.rollout.replica is imported
    install_replay_check()  # routing_replay/* step metrics, once veRL's Megatron engine is imported
    OUTCOMES = register()
except Exception:  # pragma: no cover - reported, never raised into `import verl`
    logging.getLogger("dsv4flash.verl").warning("dsv4flash veRL plugin failed to apply its patches", exc_info=True)
    OUTCOMES = {}
