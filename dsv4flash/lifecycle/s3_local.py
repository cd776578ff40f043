"""A throwaway local S3-protocol server (tests, fault cases): moto's standalone server on 127.0.0.1.

The server runs as a child process (`python -m moto.server`), so processes that fork or SIGKILL publishers around
it never share its threads; it keeps everything in memory and is stopped when the context exits.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from typing import Iterator

__all__ = ["throwaway_s3_server", "S3_TEST_ENV"]

# What a client of the throwaway server needs besides the endpoint (moto accepts any credentials).
S3_TEST_ENV = {"AWS_ACCESS_KEY_ID": "dsv4flash-test", "AWS_SECRET_ACCESS_KEY": "dsv4flash-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def throwaway_s3_server(timeout_s: float = 60.0) -> Iterator[str]:
    """Start moto's S3 server on a free 127.0.0.1 port; yields its endpoint URL (RuntimeError if it never answers)."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise RuntimeError("moto[server] is not installed (a test dependency: ci/install.sh test)") from None
    port = _free_port()
    log = tempfile.TemporaryFile()  # its request log: a pipe nobody drains would fill and stall the server
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"moto server exited with {proc.returncode}: "
                                       f"{log.read().decode(errors='replace')[-500:]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not answer on {endpoint} within {timeout_s:.0f} s") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
