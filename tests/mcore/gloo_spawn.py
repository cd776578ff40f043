"""Kept for existing imports: `spawn_gloo` now lives in `tests.mcore_cpu.parallel` (fork server + `tests` bootstrap).

Use `from tests.mcore_cpu import parallel; parallel.spawn_gloo(fn, world_size, *args)` in new tests.
"""

from tests.mcore_cpu.parallel import spawn_gloo  # noqa: F401
