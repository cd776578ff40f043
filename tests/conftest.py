"""Suite-wide test setup: CPU defaults, GPU-marker skipping, shared tiny fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# megatron-core's jit_fuser is torch.compile: a cold CPU machine would spend ~15 s compiling per process.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

DATA = Path(__file__).parent / "data"

# The both-forms patch harness (`patch_form` fixture and its hooks; they act only on tests that use it).
pytest_plugins = ["dsv4flash.patchseries.testing"]


# With DSV4FLASH_STRICT_SKIPS=1 (set by `ci/install.sh test`, so by CI) a skip is a failure unless it is one of
# these: the machine has no GPU, or a test that needs the network was not opted into. A missing dependency,
# server or fixture skipped quietly would otherwise let CI pass without running the test.
ALLOWED_SKIPS = ("needs a CUDA device", "needs more than one CUDA device", "DSV4FLASH_CHECK_INSTALL=1",
                 "a GPU is visible")


def strict_skip_failure(reason: str) -> str | None:
    """The failure message for a skip with `reason` in strict mode, or None if that skip is allowed."""
    if os.environ.get("DSV4FLASH_STRICT_SKIPS") != "1" or any(a in reason for a in ALLOWED_SKIPS):
        return None
    return f"skipped in strict mode (DSV4FLASH_STRICT_SKIPS=1): {reason}"


def _skip_reason(longrepr) -> str:
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Strict mode: a disallowed skip of a test (setup or call) becomes a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        message = strict_skip_failure(_skip_reason(report.longrepr))
        if message is not None:
            report.outcome, report.longrepr = "failed", message


@pytest.hookimpl(tryfirst=True)  # before the terminal reporter files the report under "skipped"
def pytest_collectreport(report):
    """Strict mode: a module skipped at import (`importorskip` at top level) becomes a collection error."""
    if report.skipped:
        message = strict_skip_failure(_skip_reason(report.longrepr))
        if message is not None:
            report.outcome, report.longrepr = "failed", message


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`/`multi_gpu` tests cleanly where CUDA is absent."""
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs more than one CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny-model ops), the previous count restored after."""
    from tests._threads import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_cfg():
    """The tiny test config (architecture.md §14)."""
    from dsv4flash.config import load_config

    return load_config("tiny")


@pytest.fixture()
def tiny_model(tiny_cfg):
    """A freshly initialised tiny reference model in fp32 (seed 0)."""
    from dsv4flash.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(tiny_cfg, seed=0)
