"""`dsv4flash serve`: the Tinker-protocol HTTP server, and `dsv4flash serve keys add TENANT --keys FILE`.

    dsv4flash serve [--host 127.0.0.1] [--port 8000] [--store DIR|s3://BUCKET/PREFIX] [--base tiny|random-tiny|DIR]
                    [--keys FILE] [--max-loras 8] [--max-cpu-loras 64] [--max-slot-queue 64] [--batch-mode exact|fast]
    dsv4flash serve keys add TENANT --keys FILE        # appends a fresh key's hash, prints the key once

Point the SDK at it: `tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="tml-…")`.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path


# What each client does with an sk- key (docs/service.md, "Keys and tenants"; tests/service/test_http_protocol.py
# and test_http_mint.py run every case against the real clients).
SK_KEY_NOTE = ("note: tinker SDK 0.38 (and plain 0.22) refuse sk- keys given as api_key / TINKER_API_KEY before "
               "sending anything; use MinT's client (import mint), or give SDK 0.38 the key through "
               "TINKER_CREDENTIAL_CMD (a command printing it), which it trades for a JWT at /auth/token")


# `--base` names: a flavour means the project's trained base of it (the main job's, built and cached by
# dsv4flash/train/base_cache.py when missing); `random-<flavour>` the seed-0 initialisation (no build: tests, benches).
TRAINED_FLAVOURS = ("tiny",)
RANDOM_PREFIX = "random-"
RANDOM_FLAVOURS = ("tiny", "tiny_mtp", "flash")


def resolve_base(base: str) -> tuple[str, str | None]:
    """(served base name, base directory) of a `--base` value, at once (ValueError if unknown); the directory is
    None for a seeded init, and for a trained flavour (`serve(trained=True)` finds or builds it)."""
    if base in TRAINED_FLAVOURS:
        return base, None
    if base.startswith(RANDOM_PREFIX) and base[len(RANDOM_PREFIX):] in RANDOM_FLAVOURS:
        return base[len(RANDOM_PREFIX):], None
    if (Path(base) / "config.json").exists():
        return str(Path(base).resolve()), base
    raise ValueError(f"--base {base}: neither a flavour with a trained base ({', '.join(TRAINED_FLAVOURS)}), a seeded "
                     f"initialisation ({', '.join(RANDOM_PREFIX + f for f in RANDOM_FLAVOURS)}) nor a base directory "
                     "with config.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Server options, plus the `keys add TENANT` action."""
    parser.add_argument("action", nargs="*", metavar="keys add TENANT",
                        help="manage the keys file instead of serving: `keys add TENANT --keys FILE`")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one (default 8000)")
    from dsv4flash.lifecycle.default_store import default_store

    parser.add_argument("--store", default=None, help=f"adapter store: a directory or s3://bucket/prefix (default "
                        f"{default_store()}, where training runs publish)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the server keeps its own files under service/ (keys, secrets, checkpoint "
                             "registry; default: the store directory, or for an s3:// store "
                             "$XDG_STATE_HOME/dsv4flash/s3/BUCKET/PREFIX)")
    parser.add_argument("--base", default="tiny", help="resident base: tiny (the trained base the main job uses; built "
                        "and cached if missing), random-tiny (seeded, untrained) or a base directory")
    parser.add_argument("--device", default="auto", help="where the resident base and the adapters compute: auto "
                        "(CUDA when torch sees a device, else the CPU), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="base weights' dtype: auto (the release's bfloat16 on CUDA, float32 on the CPU)")
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
    parser.add_argument("--call-timeout-s", type=float, default=300.0,
                        help="per-call deadline in seconds, from when a call gets the base: past it the call stops "
                             "and its future fails with a retryable error (default 300)")
    parser.add_argument("--max-loras", type=int, default=8,
                        help="adapter device slots: the most distinct adapters decoding in one batch (default 8)")
    parser.add_argument("--max-cpu-loras", type=int, default=64,
                        help="adapters kept decoded in host memory, the CPU tier (LRU; default 64)")
    parser.add_argument("--max-slot-queue", type=int, default=64,
                        help="requests that may wait for a busy slot; one more is answered 429 with Retry-After")
    parser.add_argument("--loader-workers", type=int, default=4, help="threads loading adapters concurrently")
    parser.add_argument("--batch-mode", default="exact", choices=["exact", "fast"],
                        help="exact: each request's tokens bit-equal to it served alone (default); fast: the "
                             "batch-dependent ops batched too, equal to fp32 rounding (docs/serving.md, Batching)")
    parser.add_argument("--trainer", default="local", help="what trains: local (the resident base in this process, "
                        "default) or megatron (a veRL Megatron worker group on Ray; docs/service.md, The compute "
                        "plane)")
    parser.add_argument("--sampler", default="local", help="what samples: local (default), dsv4flash (the project's "
                        "rollout replicas on Ray) or vllm (vLLM replicas on GPUs)")
    parser.add_argument("--ray-address", default="local", help="local (a Ray cluster of this server on 127.0.0.1, "
                        "default), auto (the cluster `ray start` made here) or HOST:PORT of a cluster's head")
    parser.add_argument("--trainer-layout", default="", help="Megatron parallel sizes of the trainer group, e.g. "
                        "ep=2 or ep=16,cp=2 (keys tp, ep, cp, pp, dp; default all 1)")
    parser.add_argument("--workers", default=None, help="ranks of the trainer group (default: the least the layout "
                        "needs)")
    parser.add_argument("--trainer-placement", default="decoder_half", help="LoRA placement shell of the trainer "
                        "group: every admitted policy's modules lie inside it (default decoder_half, plus the head)")
    parser.add_argument("--trainer-max-rank", default="16", help="LoRA rank of the shell: the largest rank a policy "
                        "may have (default 16)")
    parser.add_argument("--sampler-replicas", default="1", help="sampler replicas with --sampler dsv4flash|vllm "
                        "(default 1)")
    parser.add_argument("--sampler-max-adapters", default="8", help="adapters a sampler replica keeps loaded (LRU; "
                        "an evicted one is reloaded from the store; default 8)")
    parser.add_argument("--sampler-model", default=None, help="with --sampler vllm: the release-layout checkpoint of "
                        "the served base, which vLLM loads")
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
        if args.prefix == "sk-":
            print(SK_KEY_NOTE, file=sys.stderr)
        return 0

    for name in ("max_loras", "max_cpu_loras", "max_slot_queue", "loader_workers"):
        if getattr(args, name) < (0 if name in ("max_cpu_loras", "max_slot_queue") else 1):
            print(f"dsv4flash serve: --{name.replace('_', '-')}: expected a positive integer, got "
                  f"{getattr(args, name)}", file=sys.stderr)
            return 2
    if not args.call_timeout_s > 0:
        print(f"dsv4flash serve: --call-timeout-s: expected a positive number of seconds, got {args.call_timeout_s}",
              file=sys.stderr)
        return 2
    try:
        plane = compute_plane(args)
    except ValueError as exc:
        print(f"dsv4flash serve: {exc}", file=sys.stderr)
        return 2
    from dsv4flash.engine.device import resolve_compute

    try:  # a misspelt device, or cuda where torch sees none: refused before anything is built or written
        resolve_compute(args.device, args.dtype, what="--device")
    except ValueError as exc:
        print(f"dsv4flash serve: {exc}", file=sys.stderr)
        return 2
    from dsv4flash.lifecycle.default_store import default_store, local_dir_for, store_location

    try:
        base_name, base_dir = resolve_base(args.base)
    except ValueError as exc:
        print(f"dsv4flash serve: {exc}", file=sys.stderr)
        return 2
    store = store_location(args.store) if args.store else default_store()
    state = args.state_dir.expanduser() if args.state_dir else local_dir_for(store)
    keys_path = args.keys or state / "service" / "keys"
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
    return serve(store, keys, state_dir=state, device=args.device, dtype=args.dtype, base_name=base_name,
                 base_dir=base_dir, trained=args.base in TRAINED_FLAVOURS, host=args.host, port=args.port,
                 max_body=int(args.max_request_mb * (1 << 20)), max_pending=args.max_pending, poll_s=args.poll_s,
                 max_samplers=args.max_samplers, session_timeout_s=args.session_timeout_s,
                 port_file=args.port_file, log_level=args.log_level, scheduler=args.scheduler,
                 call_timeout_s=args.call_timeout_s, plane=plane,
                 serving={"max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
                          "max_queue": args.max_slot_queue, "loader_workers": args.loader_workers,
                          "exact": args.batch_mode == "exact"})


def compute_plane(args: argparse.Namespace):
    """The `ComputePlane` of the flags (ValueError naming the flag), checked before anything is built."""
    from dsv4flash.service.compute.megatron.layout import ComputePlane, TrainerLayout

    def integer(flag: str, value) -> int | None:
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{flag}: expected a positive integer, got {value!r}") from None

    plane = ComputePlane(trainer=args.trainer, sampler=args.sampler, ray_address=args.ray_address,
                         layout=TrainerLayout.parse(args.trainer_layout), workers=integer("--workers", args.workers),
                         placement=args.trainer_placement,
                         max_rank=integer("--trainer-max-rank", args.trainer_max_rank),
                         replicas=integer("--sampler-replicas", args.sampler_replicas),
                         max_adapters=integer("--sampler-max-adapters", args.sampler_max_adapters),
                         sampler_model=args.sampler_model)
    if plane.trainer != "megatron":
        for flag, value, default in (("--trainer-layout", args.trainer_layout, ""), ("--workers", args.workers, None)):
            if value != default:
                raise ValueError(f"{flag}: sizes the Megatron trainer group; it needs --trainer megatron")
    from dsv4flash.lora.config import LoraConfig

    try:
        LoraConfig(preset=plane.placement, rank=plane.max_rank)
    except ValueError as exc:
        raise ValueError(f"--trainer-placement {plane.placement}: {exc}") from None
    if plane.sampler == "vllm":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--sampler vllm: vLLM replicas need CUDA GPUs and torch sees none here (use --sampler "
                             "dsv4flash on a CPU machine)")
    return plane


def serve(store: Path | str, keys, *, state_dir: Path | None = None, device: str = "auto", dtype: str = "auto",
          base_name: str = "tiny", base_dir=None, trained: bool = False, host: str = "127.0.0.1", port: int = 8000,
          max_body: int = 64 << 20, max_pending: int = 64, poll_s: float = 5.0, port_file: Path | None = None,
          log_level: str = "warning", max_samplers: int = 32, session_timeout_s: float = 600.0,
          scheduler: str = "phase", call_timeout_s: float | None = 300.0, serving: dict | None = None,
          plane=None) -> int:
    """Build the service core and its HTTP front, bind, and run uvicorn until stopped; `trained`: the base is the
    project's trained `base_name` base (dsv4flash/train/base_cache.py), built first when it is not cached; `store` is
    a directory or an s3:// URL, `state_dir` the local directory for the server's own files (default: beside the
    store, `local_dir_for`); `serving`: the options of the serving path (`ServiceClient.enable_serving`: tiers and
    continuous batcher)."""
    import uvicorn

    from dsv4flash.atomic_io import write_bytes_atomic
    from dsv4flash.lifecycle.errors import LifecycleError
    from dsv4flash.service.client import ServiceClient
    from dsv4flash.service.plane.downloads import DownloadSigner
    from dsv4flash.service.plane.keys import SecretFileError, TokenSigner
    from dsv4flash.service.plane.policy_server import PolicyServer
    from dsv4flash.service.protocol.app import build_app
    from dsv4flash.tasks.text_tokenizer import build_text_tokenizer, ensure_hf_tokenizer_dir

    from dsv4flash.lifecycle.default_store import is_remote_store, local_dir_for

    state = Path(state_dir) if state_dir is not None else local_dir_for(store)
    state.mkdir(parents=True, exist_ok=True)
    if not is_remote_store(store):
        Path(store).mkdir(parents=True, exist_ok=True)
    try:  # before the base is built: a bad secret is refused in a moment, not after the model loads
        tokens = TokenSigner(state / "service" / "jwt_secret")
        downloads = DownloadSigner(state / "service" / "download_secret")
    except SecretFileError as exc:
        print(f"dsv4flash serve: {exc}", file=sys.stderr)
        return 2
    if trained:
        from dsv4flash.train.base_cache import trained_base

        base_dir = trained_base(base_name, log=lambda line: print(f"dsv4flash serve: {line}", file=sys.stderr,
                                                                  flush=True))
    try:
        service = ServiceClient(base_name, root=store, base_dir=base_dir, state_dir=state, device=device, dtype=dtype,
                                plane=plane, log=lambda line: print(f"dsv4flash serve: {line}", file=sys.stderr,
                                                                    flush=True))
    except LifecycleError as exc:  # an s3:// store never created, an unreachable bucket, an unreadable catalog
        print(f"dsv4flash serve: {exc}", file=sys.stderr)
        return 2
    service.enable_serving(**(serving or {}))
    tok_dir = ensure_hf_tokenizer_dir(state / "service" / "hf_tokenizer", service.get_tokenizer())
    served = build_text_tokenizer(service.get_tokenizer())
    service.text_encoder = lambda text: served.encode(text, add_special_tokens=False).ids
    plane = PolicyServer(service, tokenizer_dir=str(tok_dir.resolve()), max_pending=max_pending,
                         max_samplers=max_samplers, session_timeout_s=session_timeout_s,
                         phase_scheduler=scheduler == "phase", call_timeout_s=call_timeout_s)
    service.serving.batcher.scheduler = plane.scheduler  # decode steps take turns with training calls
    app = build_app(plane, keys, tokens, downloads, max_body=max_body, poll_s=poll_s)
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
    trainer = ("" if service.trainer_group is None else
               f", trainer megatron {service.trainer_group.world} ranks ({service.plane.layout.describe()})")
    print(f"dsv4flash serve: http://{host}:{bound} (store {store}, base {base_name} on "
          f"{service.base.compute.describe()}{trainer}, {len(keys.tenants())} tenant(s))", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
