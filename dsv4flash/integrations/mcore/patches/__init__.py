"""Runtime twins for megatron-core, one module per upstream change (Patch-Id `DSV41-MCORE-NNN`).

Every module here registers itself with `dsv4flash._patching.runtime_patch`; `_patching.discover()`
imports them all. The upstream form of each lives in `patches/megatron-lm/` under the same Patch-Id.
"""

import functools

from dsv4flash._patching import runtime_patch

# What every megatron-core 0.19 twin shares: target, distribution, upstream status, when to remove it (a twin
# passes its own version window, and overrides the status where it is a backport).
mcore_twin = functools.partial(runtime_patch, target="NVIDIA/Megatron-LM", distribution="megatron-core",
                               upstream_status="Pending", forwarded="no", remove_when="megatron-core>=0.20.0")
