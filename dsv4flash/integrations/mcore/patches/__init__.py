"""Runtime twins for megatron-core, one module per upstream change (Patch-Id `DSV41-MCORE-NNN`).

Every module here registers itself with `dsv4flash._patching.runtime_patch`; `_patching.discover()`
imports them all. The upstream form of each lives in `patches/megatron-lm/` under the same Patch-Id.
"""
