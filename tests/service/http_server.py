"""Helpers for the HTTP tests: API keys of three tenants, a running `dsv4flash serve`, SDK clients on it."""

from __future__ import annotations

import contextlib
from pathlib import Path

from dsv4flash.service.protocol.launch import ServerProcess as Server

KEYS = {"alice": "tml-alice-key-0123456789", "bob": "tml-bob-key-0123456789", "mallory": "sk-mallory-key-0123"}


def write_keys(path: Path) -> Path:
    """A keys file: alice and mallory by plain key, bob by stored hash (both formats the server reads)."""
    from dsv4flash.service.plane.keys import key_hash

    path.write_text(f"alice {KEYS['alice']}\n# bob is stored hashed\nbob sha256:{key_hash(KEYS['bob'])}\n"
                    f"mallory {KEYS['mallory']}\n")
    return path


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
