"""`dsv4flash serve`: the Tinker-protocol HTTP server, and `dsv4flash serve keys add TENANT --keys FILE`.

    dsv4flash serve [--host 127.0.0.1] [--port 8000] [--store DIR] [--base tiny|DIR] [--keys FILE]
    dsv4flash serve keys add TENANT --keys FILE        # appends a fresh key's hash, prints the key once

Point the SDK at it: `tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-…")`.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path


def default_store() -> Path:
    """`$DSV4FLASH_STORE`, else `$XDG_DATA_HOME/dsv4flash/serve` (a real directory: paths survive restarts)."""
    if os.environ.get("DSV4FLASH_STORE"):
        return Path(os.environ["DSV4FLASH_STORE"])
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "dsv4flash" / "serve"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Server options, plus the `keys add TENANT` action."""
    parser.add_argument("action", nargs="*", metavar="keys add TENANT",
                        help="manage the keys file instead of serving: `keys add TENANT --keys FILE`")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default 8000)")
    parser.add_argument("--store", type=Path, default=None, help=f"adapter store directory (default {default_store()})")
    parser.add_argument("--base", default="tiny", help="resident base: a config flavour (tiny) or a base directory")
    parser.add_argument("--keys", type=Path, default=None,
                        help="keys file, lines '<tenant> <api-key>' or '<tenant> sha256:<hex>' "
                             "(default <store>/service/keys; created with one key for tenant 'default')")
    parser.add_argument("--prefix", default="tml-", choices=["tml-", "sk-"], help="prefix of keys made by `keys add`")
    parser.add_argument("--max-request-mb", type=float, default=64.0, help="request body limit in MiB (default 64)")
    parser.add_argument("--max-pending", type=int, default=64, help="unfinished requests allowed per tenant")
    parser.add_argument("--max-samplers", type=int, default=32, help="live sampling sessions kept per tenant")
    parser.add_argument("--session-timeout-s", type=float, default=600.0,
                        help="finish a session silent this long (no heartbeat): its models leave memory")
    parser.add_argument("--scheduler", default="phase", choices=["phase", "lock"],
                        help="how calls share the base: phase = PhaseScheduler turns, rollouts first (default); "
                             "lock = the base lock alone, in arrival order (the baseline the bench compares)")
    parser.add_argument("--poll-s", type=float, default=5.0, help="long-poll time of retrieve_future in seconds")
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound port here once listening")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted, or run `keys add`."""
    from dsv4flash.service.plane.keys import KeyFileError, KeyRing, add_key

    if args.action:
        if len(args.action) != 3 or args.action[:2] != ["keys", "add"]:
            print(f"dsv4flash serve: unknown action {' '.join(args.action)!r} (expected: keys add TENANT)",
                  file=sys.stderr)
            return 2
        if args.keys is None:
            print("dsv4flash serve keys add: --keys FILE is required", file=sys.stderr)
            return 2
        try:
            key = add_key(args.keys, args.action[2], args.prefix)
        except KeyFileError as exc:
            print(f"dsv4flash serve keys add: {exc}", file=sys.stderr)
            return 2
        print(key)
        print(f"(tenant {args.action[2]}: key hash appended to {args.keys}; the key is shown only now)",
              file=sys.stderr)
        return 0

    base_name, base_dir = args.base, None
    if args.base not in ("tiny", "tiny_mtp", "flash"):
        if not (Path(args.base) / "config.json").exists():
            print(f"dsv4flash serve: --base {args.base}: neither a flavour (tiny) nor a base directory with "
                  f"config.json", file=sys.stderr)
            return 2
        base_name, base_dir = str(Path(args.base).resolve()), args.base
    store = (args.store or default_store()).expanduser()
    keys_path = args.keys or store / "service" / "keys"
    try:
        if args.keys is None and (not keys_path.exists() or not len(KeyRing.load(keys_path))):
            key = add_key(keys_path, "default")
            print(f"dsv4flash serve: new API key for tenant 'default' (shown once; hash kept in {keys_path}):\n"
                  f"  {key}", file=sys.stderr)
        keys = KeyRing.load(keys_path)
    except KeyFileError as exc:
        print(f"dsv4flash serve: {exc}", file=sys.stderr)
        return 2
    if not len(keys):
        print(f"dsv4flash serve: {keys_path} holds no keys (add one: dsv4flash serve keys add TENANT --keys "
              f"{keys_path})", file=sys.stderr)
        return 2
    return serve(store, keys, base_name=base_name, base_dir=base_dir, host=args.host, port=args.port,
                 max_body=int(args.max_request_mb * (1 << 20)), max_pending=args.max_pending, poll_s=args.poll_s,
                 max_samplers=args.max_samplers, session_timeout_s=args.session_timeout_s,
                 port_file=args.port_file, log_level=args.log_level, scheduler=args.scheduler)


def serve(store: Path, keys, *, base_name: str = "tiny", base_dir=None, host: str = "127.0.0.1", port: int = 8000,
          max_body: int = 64 << 20, max_pending: int = 64, poll_s: float = 5.0, port_file: Path | None = None,
          log_level: str = "warning", max_samplers: int = 32, session_timeout_s: float = 600.0,
          scheduler: str = "phase") -> int:
    """Build the service core and its HTTP front, bind, and run uvicorn until stopped."""
    import uvicorn

    from dsv4flash.atomic_io import write_bytes_atomic
    from dsv4flash.service.client import ServiceClient
    from dsv4flash.service.plane.policy_server import PolicyServer
    from dsv4flash.service.protocol.app import build_app
    from dsv4flash.service.protocol.hf_tokenizer import ensure_hf_tokenizer_dir

    store.mkdir(parents=True, exist_ok=True)
    service = ServiceClient(base_name, root=store, base_dir=base_dir)
    tok_dir = ensure_hf_tokenizer_dir(store / "service" / "hf_tokenizer", service.get_tokenizer())
    plane = PolicyServer(service, tokenizer_dir=str(tok_dir.resolve()), max_pending=max_pending,
                         max_samplers=max_samplers, session_timeout_s=session_timeout_s,
                         phase_scheduler=scheduler == "phase")
    app = build_app(plane, keys, max_body=max_body, poll_s=poll_s)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"dsv4flash serve: cannot bind {host}:{port} ({exc.strerror})", file=sys.stderr)
        return 2
    bound = sock.getsockname()[1]
    if port_file is not None:
        write_bytes_atomic(port_file, f"{bound}\n".encode())
    print(f"dsv4flash serve: http://{host}:{bound} (store {store}, base {base_name}, {len(keys.tenants())} "
          f"tenant(s))", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
