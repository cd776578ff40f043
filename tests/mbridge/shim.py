"""megatron-bridge on CPU/3.11 for tests: the product's `dsv4flash.mbridge_cpu_import`, one module state."""

import sys

from dsv4flash import mbridge_cpu_import

sys.modules[__name__] = mbridge_cpu_import
