"""The megatron-core CUDA->CPU redirect for tests: the product's `dsv4flash.cpu_mode.mcore_redirect`, one module
state.

Import it as `tests.mcore_cpu.shim` or as `dsv4flash.cpu_mode.mcore_redirect`: both names are the same module.
"""

import sys

from dsv4flash.cpu_mode import mcore_redirect

sys.modules[__name__] = mcore_redirect
