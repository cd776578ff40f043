"""megatron-bridge on CPU/3.11 for tests: the product's `dsv4flash.cpu_mode.mbridge_import`, one module state."""

import sys

from dsv4flash.cpu_mode import mbridge_import

sys.modules[__name__] = mbridge_import
