"""Suite-wide test setup: CPU defaults, GPU-marker skipping, shared tiny fixtures."""

from __future__ import annotations

import os
from pathlib import Path

# megatron-core's jit_fuser is torch.compile: a cold CPU machine would spend ~15 s compiling per process.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# MKL's conditional numerical reproducibility, strict: the same GEMM results on every AVX2 machine whatever its
# vendor, ISA extensions or operand alignment (set before torch loads MKL; inherited by every subprocess). The
# parity tests compare paths whose discrete steps (the indexer's top-k) sit on near-ties at tiny size; with MKL's
# AVX-512 kernels on some Xeons, or its alignment-dependent paths, those ties fall differently on different CI
# machines, and a test must not pass or fail by the machine it is drawn on.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

DATA = Path(__file__).parent / "data"

# The both-forms patch harness (`patch_form` fixture and its hooks; they act only on tests that use it).
# `tests._timing`: the slowest-phases table, per-directory totals and the time budget printed at the end;
# `tests._scheduling`: the work units of pytest-xdist's `--dist loadgroup` (whole_machine tests, module fixtures).
pytest_plugins = ["dsv4flash.patchseries.testing", "tests._timing", "tests._scheduling"]


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


@pytest.fixture(scope="session", autouse=True)
def _user_data_dir(request, tmp_path_factory):
    """Training runs publish into, and `dsv4flash serve` reads, the user's store ($XDG_DATA_HOME/dsv4flash/store,
    dsv4flash/lifecycle/default_store.py): in the suite a session temp dir (inherited by subprocesses), never the
    real one; $DSV4FLASH_STORE, which would override it, is unset. $DSV4FLASH_CACHE, unless set, is pytest's cache
    dir (the one `pretrained_base` builds into)."""
    saved = {key: os.environ.get(key) for key in ("XDG_DATA_HOME", "DSV4FLASH_STORE", "DSV4FLASH_CACHE")}
    os.environ["XDG_DATA_HOME"] = str(tmp_path_factory.mktemp("xdg_data"))
    os.environ.pop("DSV4FLASH_STORE", None)
    # the trained tiny base a CLI run defaults to (veRL's model.hf_path, serve --base tiny) is pretrained_base's
    # slot, not one built again under ~/.cache
    if not os.environ.get("DSV4FLASH_CACHE") and request.config.cache is not None:
        os.environ["DSV4FLASH_CACHE"] = str(request.config.cache.mkdir("dsv4flash"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def empty_default_store(tmp_path_factory, monkeypatch):
    """A test of its own user's store (a fresh $XDG_DATA_HOME, inherited by subprocesses): for tests that read the
    default store's whole content, which other tests' runs publish into during the session."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg_own")))
    from dsv4flash.lifecycle.default_store import default_store

    return default_store()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny-model ops), the previous count restored after."""
    from tests._threads import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_cfg():
    """The tiny test config (docs/architecture.md §14)."""
    from dsv4flash.config import load_config

    return load_config("tiny")


@pytest.fixture()
def tiny_model(tiny_cfg):
    """A freshly initialised tiny reference model in fp32 (seed 0)."""
    from dsv4flash.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(tiny_cfg, seed=0)


@pytest.fixture(scope="session")
def pretrained_base(request, tmp_path_factory):
    """The trained tiny base the main job uses (`+recipe=pretrain_tiny`), built once per machine into pytest's
    cache dir ($DSV4FLASH_CACHE when set): its slot is keyed by the pretrain config and the sources of the
    tasks, the engine and the model (dsv4flash/train/base_cache.py), so a stale base is never reused, and a
    file lock makes concurrent workers build it once."""
    from dsv4flash.train.base_cache import ensure_base
    from dsv4flash.train.compose import compose, to_train_config

    cache = os.environ.get("DSV4FLASH_CACHE")
    if not cache:
        cache = request.config.cache.mkdir("dsv4flash") if request.config.cache else tmp_path_factory.mktemp("cache")
    return ensure_base(to_train_config(compose("decoder_lora", [f"model.cache_dir={cache}"])))


@pytest.fixture(scope="session")
def pg_server():
    """DSN (libpq keywords) of the suite's throwaway PostgreSQL server: Debian's package (`ci/install_postgres.sh`),
    initdb in a temp dir, run as a non-root user (postgres refuses root), listening only on a unix socket, started
    on first use and stopped at the end of the session (of each xdist worker that uses it)."""
    from dsv4flash.lifecycle.catalog.pg_local import postgres_bin, throwaway_server

    if postgres_bin() is None:
        pytest.skip("PostgreSQL server not installed (run ci/install_postgres.sh)")
    import psycopg  # noqa: F401  (a test dependency: ci/install.sh test)
    yield from _running(throwaway_server)


@pytest.fixture(scope="session")
def s3_server():
    """Endpoint URL of the suite's throwaway S3-protocol server (moto, dsv4flash/lifecycle/s3_local.py) on 127.0.0.1,
    started on first use and stopped at the end of the session (of each xdist worker that uses it)."""
    from dsv4flash.lifecycle.s3_local import throwaway_s3_server

    yield from _running(throwaway_s3_server)


def _running(make_server):
    """Start a throwaway server (a context manager; a start failure fails the test), yield what it gives, stop it."""
    try:
        server = make_server()
        value = server.__enter__()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    try:
        yield value
    finally:
        server.__exit__(None, None, None)


@pytest.fixture()
def s3_url(s3_server, monkeypatch, tmp_path):
    """`s3://<fresh bucket>/store` on the session's S3 server, the client environment pointing at it (undone after)."""
    import uuid

    import boto3

    from dsv4flash.lifecycle.s3_local import S3_TEST_ENV

    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {**S3_TEST_ENV, "AWS_ENDPOINT_URL_S3": s3_server,
                       "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
                       "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials")}.items():
        monkeypatch.setenv(key, value)
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    boto3.session.Session().client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/store"
