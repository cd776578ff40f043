"""Strict-skip mode (CI): only "no GPU" and opt-in network skips stay skips."""

from tests.conftest import strict_skip_failure


def test_strict_mode_allows_only_gpu_and_opt_in_skips(monkeypatch):
    monkeypatch.setenv("DSV4FLASH_STRICT_SKIPS", "1")
    assert strict_skip_failure("needs a CUDA device") is None
    assert strict_skip_failure("set DSV4FLASH_CHECK_INSTALL=1 to let pip resolve the install recipes (network)") is None
    message = strict_skip_failure("could not import 'psycopg': No module named 'psycopg'")
    assert message is not None and "psycopg" in message and "strict mode" in message
    assert strict_skip_failure("PostgreSQL server not installed (run ci/install_postgres.sh)") is not None


def test_without_strict_mode_every_skip_stays_a_skip(monkeypatch):
    monkeypatch.delenv("DSV4FLASH_STRICT_SKIPS", raising=False)
    assert strict_skip_failure("could not import 'peft'") is None
