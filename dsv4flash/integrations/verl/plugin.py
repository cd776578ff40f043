"""`verl.plugins` entry point: veRL imports this module on `import verl`; importing it applies the twins
and registers the CPU development platform.

veRL swallows plugin import errors at DEBUG level, so failures are logged here at WARNING instead.
"""

from __future__ import annotations

import logging

try:
    from dsv4flash.integrations.verl import register
    from dsv4flash.integrations.verl.cpu_platform import register_cpu_engines, register_platform

    register_platform()  # selectable with VERL_PLATFORM=cpu only; never auto-detected
    register_cpu_engines()  # veRL's Megatron engines for device `cpu`, once their module is imported
    OUTCOMES = register()
except Exception:  # pragma: no cover - reported, never raised into `import verl`
    logging.getLogger("dsv4flash.verl").warning("dsv4flash veRL plugin failed to apply its patches", exc_info=True)
    OUTCOMES = {}
