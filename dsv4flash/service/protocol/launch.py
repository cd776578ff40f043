"""Run `dsv4flash serve` as a child process on 127.0.0.1 (ephemeral port) and stop it: for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerProcess:
    """A running `dsv4flash serve` child: `url`, `proc`, and the log file it writes (next to the store)."""

    def __init__(self, store: Path, keys: Path | None, *, env: dict | None = None, args: tuple = (),
                 poll_s: float = 1.0, base: str = "random-tiny", start_timeout_s: float | None = None) -> None:
        """`keys=None`: no `--keys` (the server uses, and on first start fills, `<store>/service/keys`). `base`: the
        server's `--base`; by default the seeded tiny base, the same compute as the trained one without building it.
        `start_timeout_s`: how long it may take to listen (default 120 s, 1800 s for a trained base that may be
        built first)."""
        self.store, self.keys = Path(store), (Path(keys) if keys is not None else None)
        self.port_file = self.store.parent / f"{self.store.name}.port"
        self.port_file.unlink(missing_ok=True)
        self.log_path = self.store.parent / f"{self.store.name}.log"
        from dsv4flash.integrations.mcore import child_environment

        # a test or bench process that built Megatron models must not hand their attention backend to the
        # server's trainer workers (`--trainer megatron`), which pick their own
        env_all = {**child_environment(dict(os.environ)), "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsv4flash", "serve", "--host", "127.0.0.1", "--port", "0", "--store",
             str(self.store), *(["--keys", str(self.keys)] if keys is not None else []), "--port-file",
             str(self.port_file), "--poll-s", str(poll_s), "--base", base, *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env_all)
        if start_timeout_s is None:
            start_timeout_s = 120 if base.startswith("random-") else 1800  # a trained base may be built first
        deadline = time.time() + start_timeout_s
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
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server never became healthy (rc {self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        """Everything the server printed."""
        if not self._log.closed:  # stop() closes it: a failed start reports its log after stopping the child
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

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
