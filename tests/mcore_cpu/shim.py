"""The megatron-core CUDA->CPU redirect for tests: the product's `dsv4flash.mcore_cpu_redirect`, one module state.

Import it as `tests.mcore_cpu.shim` or as `dsv4flash.mcore_cpu_redirect`: both names are the same module.
"""

import sys

from dsv4flash import mcore_cpu_redirect

sys.modules[__name__] = mcore_cpu_redirect
