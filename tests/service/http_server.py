"""Start `dsv4flash serve` as a real subprocess on 127.0.0.1 (ephemeral port) and always stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

KEYS = {"alice": "tml-alice-key-0123456789", "bob": "tml-bob-key-0123456789", "mallory": "sk-mallory-key-0123"}


def write_keys(path: Path) -> Path:
    """A keys file: alice and mallory by plain key, bob by stored hash (both formats the server reads)."""
    from dsv4flash.service.plane.keys import key_hash

    path.write_text(f"alice {KEYS['alice']}\n# bob is stored hashed\nbob sha256:{key_hash(KEYS['bob'])}\n"
                    f"mallory {KEYS['mallory']}\n")
    return path


class Server:
    """A running server process: `url`, `proc`, and the log file it writes."""

    def __init__(self, store: Path, keys: Path, *, env: dict | None = None, args: tuple = ()) -> None:
        self.store, self.keys = Path(store), Path(keys)
        self.port_file = self.store.parent / f"{self.store.name}.port"
        self.port_file.unlink(missing_ok=True)
        self.log_path = self.store.parent / f"{self.store.name}.log"
        env_all = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsv4flash", "serve", "--host", "127.0.0.1", "--port", "0", "--store",
             str(self.store), "--keys", str(self.keys), "--port-file", str(self.port_file), "--poll-s", "1", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env_all)
        deadline = time.time() + 120
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start (rc {self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{self.port_file.read_text().strip()}"
        while True:
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server never became healthy:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        """Everything the server printed."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL (an operator's kill -9: no cleanup runs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in 15 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        if not self._log.closed:
            self._log.close()


@contextlib.contextmanager
def running_server(store: Path, keys: Path, **kwargs):
    """A server for the duration of a `with` block."""
    server = Server(store, keys, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def service_client(server: Server, tenant: str = "alice"):
    """The real tinker SDK's ServiceClient pointed at the server."""
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=KEYS[tenant])


def rest_client(server: Server, tenant: str = "alice"):
    """The real tinker SDK's RestClient pointed at the server."""
    import tinker

    return tinker.RestClient(base_url=server.url, api_key=KEYS[tenant])
