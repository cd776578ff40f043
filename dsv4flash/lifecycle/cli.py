"""`dsv4flash lifecycle …`: inspect and operate a store from the shell (list, show, log, tag, rollback, gc, export,
import). `--root` defaults to the store training runs publish into and `dsv4flash serve` reads
(`dsv4flash.lifecycle.default_store`)."""

from __future__ import annotations

import argparse
import json
import time

from dsv4flash.lifecycle.catalog.base import HEAD

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Subcommands of `dsv4flash lifecycle`."""
    from dsv4flash.lifecycle.default_store import default_store

    parser.add_argument("--root", default=None, help="store root: a directory (blobs/ and, by default, catalog.sqlite) "
                        "or s3://bucket/prefix (docs/lifecycle.md); default "
                        f"{default_store()}, where training runs publish")
    parser.add_argument("--catalog", default=None, help="catalog URL (default: <root>/catalog.sqlite, or the one an "
                        "s3:// store recorded at init; postgresql://… for shared)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("init", help="create an empty store at --root (every other command needs an existing one)")
    sub.add_parser("policies", help="list policies with head, tags and state")
    show = sub.add_parser("show", help="one revision: row, lineage, children, evals")
    show.add_argument("ref", help="revision id, ≥6-hex prefix, policy or policy:tag")
    log = sub.add_parser("log", help="a policy's revisions, newest first, or a tag's moves")
    log.add_argument("policy")
    log.add_argument("--tag", default=None, help="show this tag's move history instead")
    log.add_argument("-n", type=int, default=20)
    tag = sub.add_parser("tag", help="point policy:TAG at a revision")
    tag.add_argument("policy")
    tag.add_argument("tag")
    tag.add_argument("ref")
    rb = sub.add_parser("rollback", help="point a tag (default: the head) at an earlier revision")
    rb.add_argument("policy")
    rb.add_argument("--tag", default=HEAD)
    rb.add_argument("--to", default=None, help="target revision (default: the current one's parent)")
    gc = sub.add_parser("gc", help="delete bytes no live revision references")
    gc.add_argument("--grace", type=float, default=3600.0, help="keep unreferenced blobs younger than this (s)")
    gc.add_argument("--dry-run", action="store_true")
    ex = sub.add_parser("export", help="write a store revision, a training output or an adapter directory in a layout "
                                       "PEFT, vLLM, Megatron or the store load (see docs/lora.md)")
    ex.add_argument("ref", help="revision id / policy[:tag] in --root, or a directory: a `python -m dsv4flash.train` "
                                "output or an adapter directory of any format")
    ex.add_argument("out")
    ex.add_argument("--format", "--layout", dest="format", choices=_formats(), default="peft",
                    help="peft (stock PEFT, vLLM), vllm (vLLM at rank r), megatron, packed (the store's), vllm_3d "
                         "(vLLM fused 3-D MoE)")
    ex.add_argument("--overwrite", action="store_true")
    imp = sub.add_parser("import", help="publish a training output or an adapter directory as a policy's new revision "
                                        "(tagged latest)")
    imp.add_argument("dir", help="a `python -m dsv4flash.train` output or an adapter directory of any format")
    imp.add_argument("--policy", default=None, help="policy name (default: a training output's recipe, else the "
                                                    "directory's name)")


def _formats() -> tuple[str, ...]:
    from dsv4flash.lifecycle.export_formats import FORMATS

    return FORMATS + ("vllm3d",)  # vllm3d: the earlier spelling of vllm_3d


def _short(rev: str | None) -> str:
    return rev[:12] if rev else "-"


def run(args: argparse.Namespace) -> int:
    """Execute one subcommand; prints plain text (JSON for `show`). A user or catalog error: one line, exit 2."""
    import sqlite3
    import sys

    from dsv4flash.lifecycle.errors import LifecycleError

    try:
        return _run(args)
    except (LifecycleError, ValueError, KeyError, FileExistsError, sqlite3.DatabaseError, OSError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__module__.startswith(("botocore", "boto3")):  # the object store of an s3:// root
            print(f"error: store {args.root}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
                  file=sys.stderr)
            return 2
        if not type(exc).__module__.startswith("psycopg"):
            raise
        print(f"error: catalog {args.catalog}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}",
              file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _export(args)
    root = _root(args)
    # `init` creates a store; `import` may create only the default one (a mistyped --root stays an error)
    create = args.action == "init" or (args.action == "import" and args.root is None)
    from dsv4flash.lifecycle.default_store import no_store_at

    if not create and (missing := no_store_at(root)) is not None:  # answered before the store (and torch) loads
        return _user_error(missing)
    from dsv4flash.lifecycle.store import AdapterStore

    with AdapterStore.open(root, args.catalog, create=create) as store:
        cat = store.catalog
        if args.action == "import":
            from dsv4flash.lifecycle.import_dir import import_adapter_dir

            rev = import_adapter_dir(store, args.dir, policy=args.policy)
            print(f"{rev.manifest.policy}:latest = {_short(rev.id)} (step {rev.manifest.step}, store {store.root})")
        elif args.action == "init":
            print(f"store at {store.root} (catalog {args.catalog or store.blobs.default_catalog()})")
        elif args.action == "policies":
            for name in cat.list_policies():
                p = cat.policy(name)
                tags = " ".join(f"{t}={_short(r)}" for t, r in sorted(p.tags.items()))
                step = p.state.step if p.state else None
                print(f"{name:24s} head={_short(p.head)} step={step} {tags} rollouts={p.rollout_count} base={p.base}")
        elif args.action == "show":
            rev = cat.resolve(args.ref)
            out = {**rev.__dict__, "meta": dict(rev.meta), "ancestors": [r.id for r in cat.ancestors(rev.id, limit=10)],
                   "children": [r.id for r in cat.children(rev.id)], "evals": cat.evals(rev.policy, rev.id),
                   "bytes_present": store.blobs.exists(rev.id)}
            print(json.dumps(out, indent=2, sort_keys=True))
        elif args.action == "log":
            cat.policy(args.policy)  # an unknown policy is an error, not an empty listing
            if args.tag:
                for m in cat.tag_history(args.policy, args.tag)[-args.n:]:
                    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(m.at))} {m.reason:8s} {_short(m.previous)} -> {_short(m.revision)}")
            else:
                for r in cat.revisions(args.policy, limit=args.n, include_retired=True):
                    print(f"{_short(r.id)} parent={_short(r.parent)} step={r.step} {r.format} {r.nbytes}B{' retired' if r.retired else ''}")
        elif args.action == "tag":
            print(_short(cat.tag(args.policy, args.tag, args.ref).id))
        elif args.action == "rollback":
            print(_short(cat.rollback(args.policy, args.tag, args.to).id))
        elif args.action == "gc":
            print(store.gc(grace_s=args.grace, dry_run=args.dry_run))
    return 0


def _export(args: argparse.Namespace) -> int:
    """`export`: a directory needs no store; a revision is read from --root. User errors exit 2 (no traceback)."""
    from pathlib import Path

    from dsv4flash.lifecycle.default_store import is_remote_store
    from dsv4flash.lifecycle.errors import AdapterFormatError
    from dsv4flash.lifecycle.export import VLLM_3D, export_adapter_dir, export_peft, export_vllm_3d

    fmt = VLLM_3D if args.format == "vllm3d" else args.format
    try:
        if Path(args.ref).is_dir():
            print(export_adapter_dir(args.ref, args.out, fmt, overwrite=args.overwrite))
            return 0
        from dsv4flash.lifecycle.packed import PackedMoELoRA
        from dsv4flash.lifecycle.store import AdapterStore

        if args.root is None and not is_remote_store(_root(args)) and args.catalog is None \
                and not (_root(args) / "catalog.sqlite").is_file():
            return _user_error(f"dsv4flash lifecycle export: {args.ref} is not a directory, and there is no store at "
                               f"{_root(args)} to hold it as a revision (pass --root for another store)")
        with AdapterStore.open(_root(args), args.catalog) as store:
            adapter = store.load_adapter(args.ref)
        if not isinstance(adapter, PackedMoELoRA):
            return _user_error(f"dsv4flash lifecycle export: revision {args.ref} is not a packed MoE LoRA revision; "
                               "only those export to the PEFT/vLLM layouts")
        if fmt == VLLM_3D:
            print(export_vllm_3d(adapter, args.out, overwrite=args.overwrite))
        else:
            print(export_peft(adapter, args.out, overwrite=args.overwrite, layout=fmt))
    except (AdapterFormatError, ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc  # KeyError's str() adds quotes
        return _user_error(f"dsv4flash lifecycle export: {message}")
    return 0


def _root(args: argparse.Namespace):
    """`--root` (a directory or an s3:// URL), else the default store."""
    from dsv4flash.lifecycle.default_store import default_store, store_location

    return store_location(args.root) if args.root is not None else default_store()


def _user_error(message: str) -> int:
    import sys

    print(f"error: {message}", file=sys.stderr)
    return 2
