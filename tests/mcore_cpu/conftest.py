"""Fixtures for the megatron-core-on-CPU tests in this folder; other folders import them the same way."""

from tests.mcore_cpu.fixtures import cuda_redirect, mcore_parallel  # noqa: F401
