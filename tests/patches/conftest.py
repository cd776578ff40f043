"""Patch-series tests: megatron-core CPU fixtures (the both-forms harness, `patch_form`, comes from tests/conftest.py)."""

from tests.mcore_cpu.fixtures import cuda_redirect, mcore_parallel  # noqa: F401
