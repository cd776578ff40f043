"""Patch-series tests: megatron-core CPU fixtures and the both-forms harness (`patch_form`)."""

from dsv4flash.patchseries.testing import (  # noqa: F401
    patch_form,
    pytest_collection_modifyitems,
    pytest_generate_tests,
    pytest_pyfunc_call,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)
from tests.mcore_cpu.fixtures import cuda_redirect, mcore_parallel  # noqa: F401
