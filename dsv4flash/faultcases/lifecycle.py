"""Fault cases of the adapter store (`dsv4flash lifecycle`, `AdapterStore`): catalog errors, kills at every publish
step, concurrent writers on SQLite and PostgreSQL, full disks, corrupt blobs."""

from __future__ import annotations

import errno
import os
import signal
from unittest.mock import patch

from dsv4flash.faultcases import DataLost, LeftBehind, SilentWrong, case
from dsv4flash.lifecycle.faults import POINTS

PUBLISH_POINTS = [p for p in POINTS if not p.startswith("export.")]
COMMITTED = {"catalog.after_commit"}


# ------------------------------------------------------------------------------------------ helpers
def _base():
    from dsv4flash.lifecycle.fingerprint import fingerprint_from_parts

    return fingerprint_from_parts('{"model_type": "toy", "hidden_size": 8}', [("w.weight", "BF16", (8, 8))])


def _adapter(seed: int = 0, **kw):
    from dsv4flash.lifecycle.packed import PackedMoELoRA

    args = dict(layers=[0, 2], num_experts=4, hidden=8, moe_inter=6, rank=2,
                dense_shapes={"layers.0.attn.wq_a": (5, 8)}, seed=seed)
    return PackedMoELoRA.random(**{**args, **kw})


def _url(ctx, backend: str) -> str:
    return str(ctx.tmp / "store" / "catalog.sqlite") if backend == "sqlite" else ctx.postgres()


def _store(ctx, backend: str = "sqlite", revisions: int = 1):
    """A store with policy `pol` holding `revisions` published revisions; returns (store, url, [revisions])."""
    from dsv4flash.lifecycle.store import AdapterStore

    url = _url(ctx, backend)
    store = AdapterStore.open(ctx.tmp / "store", url, create=True)
    store.create_policy("pol", _base())
    revs = [store.publish("pol", _adapter(i), step=i + 1, trainer_state=b"state-%d" % i) for i in range(revisions)]
    return store, url, revs


def _cli_store(ctx, revisions: int = 1):
    """A default-layout store (root/catalog.sqlite) for CLI cases; closed, returns (root, [revisions])."""
    store, _, revs = _store(ctx, revisions=revisions)
    store.close()
    return ctx.tmp / "store", revs


def _consistent(store, acknowledged) -> None:
    """Every revision registered has its bytes; every acknowledged one is still there and loads."""
    for rec in store.catalog.revisions("pol", include_retired=True, limit=1000):
        try:
            store.blobs.verify(rec.id)
        except Exception as exc:  # noqa: BLE001 - any failure to read back is a loss
            raise DataLost(f"registered revision {rec.id[:12]} has no valid bytes: {exc}") from None
    for rev, adapter in acknowledged:
        try:
            if not store.load_adapter(rev.id).equal(adapter):
                raise DataLost(f"acknowledged revision {rev.id[:12]} loads different tensors")
        except DataLost:
            raise
        except Exception as exc:  # noqa: BLE001
            raise DataLost(f"acknowledged revision {rev.id[:12]} no longer loads: {exc}") from None


# ------------------------------------------------------------------------------------------ CLI and catalog errors
@case("lifecycle", "CLI with a mistyped --root exits 2 and creates nothing", match=r"^error: .*no adapter store here")
def cli_missing_root(ctx):
    failure = ctx.cli_must_fail("lifecycle", "--root", ctx.tmp / "typo", "policies")
    ctx.nothing_at(ctx.tmp / "typo")
    return failure


@case("lifecycle", "CLI with --catalog naming a missing SQLite file exits 2 and creates nothing",
      match=r"^error: .*missing\.sqlite: no catalog")
def cli_missing_catalog(ctx):
    root, _ = _cli_store(ctx)
    failure = ctx.cli_must_fail("lifecycle", "--root", root, "--catalog", ctx.tmp / "missing.sqlite", "policies")
    ctx.nothing_at(ctx.tmp / "missing.sqlite")
    return failure


@case("lifecycle", "CLI init creates a store explicitly; a second init keeps its contents", expect="correct result")
def cli_init(ctx):
    if ctx.cli("lifecycle", "--root", ctx.tmp / "new", "init").code != 0:
        raise SilentWrong("init failed")
    if ctx.cli("lifecycle", "--root", ctx.tmp / "new", "policies").code != 0:
        raise SilentWrong("the new store does not open")
    root, revs = _cli_store(ctx)
    ctx.cli("lifecycle", "--root", root, "init")
    if revs[0].id[:12] not in ctx.cli("lifecycle", "--root", root, "policies").out:
        raise DataLost("init on an existing store lost its policies")


@case("lifecycle", "CLI show of an unknown ref", match=r"^error: 'feedfacecafe' is neither a revision id/prefix nor")
def cli_unknown_ref(ctx):
    root, _ = _cli_store(ctx)
    return ctx.cli_must_fail("lifecycle", "--root", root, "show", "feedfacecafe")


@case("lifecycle", "CLI rollback at the root revision", match=r"^error: .*(parent|root)")
def cli_rollback_at_root(ctx):
    root, _ = _cli_store(ctx)
    return ctx.cli_must_fail("lifecycle", "--root", root, "rollback", "pol")


@case("lifecycle", "CLI export of a revision whose blob is corrupt", match=r"^error: revision blob .* hashes to \w{64}")
def cli_corrupt_blob(ctx):
    root, revs = _cli_store(ctx)
    path = root / "blobs" / "objects" / revs[0].id[:2] / revs[0].id
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    failure = ctx.cli_must_fail("lifecycle", "--root", root, "export", "pol", ctx.tmp / "out")
    ctx.nothing_at(ctx.tmp / "out")
    return failure


@case("lifecycle", "CLI on a garbage catalog.sqlite", match=r"^error: .*catalog\.sqlite: cannot open the catalog "
      r"\(file is not a database\)")
def cli_garbage_catalog(ctx):
    (ctx.tmp / "store").mkdir()
    (ctx.tmp / "store" / "catalog.sqlite").write_bytes(b"not a database " * 300)
    return ctx.cli_must_fail("lifecycle", "--root", ctx.tmp / "store", "policies")


@case("lifecycle", "CLI on a catalog.sqlite truncated to half its size", match=r"^error: .*(malformed|not a database|"
      r"disk image|cannot open)")
def cli_truncated_catalog(ctx):
    root, _ = _cli_store(ctx, revisions=3)
    import sqlite3

    with sqlite3.connect(root / "catalog.sqlite") as conn:  # fold the WAL in, so the main file holds it all
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db = root / "catalog.sqlite"
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])
    return ctx.cli_must_fail("lifecycle", "--root", root, "log", "pol")


@case("lifecycle", "CLI tag pointing at an unknown revision", match=r"^error: .*feedfacecafe")
def cli_tag_unknown(ctx):
    root, _ = _cli_store(ctx)
    return ctx.cli_must_fail("lifecycle", "--root", root, "tag", "pol", "prod", "feedfacecafe")


@case("lifecycle", "CLI log of an unknown policy", match=r"^error: .*nopolicy")
def cli_log_unknown_policy(ctx):
    root, _ = _cli_store(ctx)
    return ctx.cli_must_fail("lifecycle", "--root", root, "log", "nopolicy")


@case("lifecycle", "CLI export onto an existing directory without --overwrite", match=r"^error: .*exists")
def cli_export_exists(ctx):
    root, _ = _cli_store(ctx)
    (ctx.tmp / "out").mkdir()
    return ctx.cli_must_fail("lifecycle", "--root", root, "export", "pol", ctx.tmp / "out")


@case("lifecycle", "CLI with an unreachable PostgreSQL catalog", match=r"^error: .*cannot open the catalog")
def cli_postgres_unreachable(ctx):
    (ctx.tmp / "store").mkdir()
    dsn = f"host={ctx.tmp / 'no-socket-here'} port=1 user=nobody dbname=nothing connect_timeout=2"
    return ctx.cli_must_fail("lifecycle", "--root", ctx.tmp / "store", "--catalog", dsn, "policies")


@case("lifecycle", "publish with a stale expected head is refused, the head unchanged",
      match=r"expected head \w+, found \w+ \(another writer published first\)")
def stale_head(ctx):
    store, _, revs = _store(ctx, revisions=2)
    failure = ctx.must_fail(lambda: store.publish("pol", _adapter(9), expect_head=revs[0].id))
    if store.policy("pol").head != revs[1].id:
        raise SilentWrong("the head moved")
    return failure


@case("lifecycle", "loading a revision whose blob was truncated", match=r"objects/../\w{64}: header length \d+ exceeds "
      r"the file")
def truncated_blob(ctx):
    store, _, revs = _store(ctx)
    path = store.blobs.path(revs[0].id)
    os.chmod(path, 0o644)
    path.write_bytes(path.read_bytes()[:100])
    return ctx.must_fail(lambda: store.load_adapter(revs[0].id))


@case("lifecycle", "publish on a full disk (ENOSPC while writing the blob): refused, head and tmp/ clean",
      match=r"No space left on device")
def enospc_publish(ctx):
    from dsv4flash.lifecycle.blobstore import BlobWriter

    store, _, revs = _store(ctx)
    real = BlobWriter.write

    def full(self, data):
        if self._written > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)
    big = _adapter(5, hidden=64, moe_inter=48)
    with patch.object(BlobWriter, "write", full):
        failure = ctx.must_fail(lambda: store.publish("pol", big, step=2))
    if store.policy("pol").head != revs[0].id:
        raise SilentWrong("the head moved to a revision whose bytes were never written")
    if list(store.blobs.tmp_dir.iterdir()):
        raise LeftBehind(f"{store.blobs.tmp_dir} still holds {list(store.blobs.tmp_dir.iterdir())}")
    _consistent(store, [(revs[0], _adapter(0))])
    return failure


@case("lifecycle", "a killed publisher's temp blob is removed when the store is next opened", expect="correct result")
def killed_publish_temp_swept(ctx):
    from dsv4flash.faultcases.context import fork_run
    from dsv4flash.lifecycle.store import AdapterStore

    store, url, revs = _store(ctx)
    big = _adapter(5, hidden=64, moe_inter=48)
    fork_run(lambda: AdapterStore.open(store.root, url).publish("pol", big, step=2), crash_at="blob.mid_write")
    if not list(store.blobs.tmp_dir.glob("*.part")):
        raise SilentWrong("the killed publisher left no temp file to test with")
    reopened = AdapterStore.open(store.root, url)
    if list(store.blobs.tmp_dir.iterdir()):
        raise LeftBehind(f"{store.blobs.tmp_dir} still holds a dead writer's file after reopening")
    _consistent(reopened, [(revs[0], _adapter(0))])


@case("lifecycle", "gc with no grace period never removes a live writer's temp file", expect="correct result")
def gc_spares_live_writer(ctx):
    store, _, _ = _store(ctx)
    with store.blobs.writer() as w:
        w.write(b"y" * 4096)
        if store.gc(grace_s=0).temp_files_deleted:
            raise DataLost("gc deleted a live writer's temp file")
        key = w.commit()
    if store.blobs.read_bytes(key) != b"y" * 4096:
        raise DataLost("the live writer's blob is damaged")


# ------------------------------------------------------------------------------------------ kills at every publish step
def _killed_publish(ctx, backend: str, point: str) -> None:
    from dsv4flash.faultcases.context import fork_run
    from dsv4flash.lifecycle.store import AdapterStore

    store, url, revs = _store(ctx, backend)
    new = _adapter(7, hidden=64, moe_inter=48)  # large enough that "mid write" is mid-file
    status = fork_run(lambda: AdapterStore.open(store.root, url).publish("pol", new, step=2, trainer_state=b"s" * 5000,
                                                                         tags=["candidate"]), crash_at=point)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise SilentWrong(f"the publisher was not killed at {point} (status {status})")
    fresh = AdapterStore.open(store.root, url)
    head = fresh.policy("pol").head
    acknowledged = [(revs[0], _adapter(0))]
    if point in COMMITTED:
        if head == revs[0].id or fresh.policy("pol").head_parent != revs[0].id:
            raise DataLost(f"killed after commit at {point}, but the new head is not visible")
        acknowledged.append((fresh.resolve("pol"), new))
    elif head != revs[0].id:
        raise SilentWrong(f"killed before commit at {point}, yet the head moved to {str(head)[:12]}")
    _consistent(fresh, acknowledged)
    if list(fresh.blobs.tmp_dir.iterdir()):
        raise LeftBehind(f"{fresh.blobs.tmp_dir} holds the dead writer's files after reopening")
    if point not in COMMITTED:  # the retry gives the revision a clean run would
        retried = fresh.publish("pol", new, step=2, trainer_state=b"s" * 5000, tags=["candidate"])
        _consistent(fresh, acknowledged + [(retried, new)])
    fresh.close()


def _register_kill_cases() -> None:
    for backend in ("sqlite", "postgres"):
        for point in PUBLISH_POINTS:
            def run(ctx, backend=backend, point=point):
                return _killed_publish(ctx, backend, point)
            run.__name__ = f"kill_{backend}_{point.replace('.', '_')}"
            case("lifecycle", f"publish SIGKILLed at {point} ({backend}): old head or complete new one",
                 expect="correct result", needs=("postgres",) if backend == "postgres" else ())(run)


_register_kill_cases()


# ------------------------------------------------------------------------------------------ concurrent writers
WRITERS, PER_WRITER = 3, 4


def _concurrent(ctx, backend: str) -> None:
    from dsv4flash.lifecycle.errors import HeadConflictError
    from dsv4flash.lifecycle.store import AdapterStore

    store, url, revs = _store(ctx, backend)
    adapters = {w: [_adapter(100 * w + i) for i in range(PER_WRITER)] for w in range(WRITERS)}
    log = ctx.tmp / "acknowledged"
    log.mkdir()

    def writer(w: int):
        mine = AdapterStore.open(store.root, url)
        for i, ad in enumerate(adapters[w]):
            while True:
                try:
                    rev = mine.publish("pol", ad, step=w * 100 + i, extra={"writer": w, "i": i})
                    break
                except HeadConflictError:
                    continue
            (log / f"{w}-{i}").write_text(rev.id)  # acknowledged to "the user"
        mine.close()

    pids = []
    for w in range(WRITERS):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                writer(w)
            except BaseException:  # noqa: BLE001
                code = 3
            os._exit(code)
        pids.append(pid)
    statuses = [os.waitpid(p, 0)[1] for p in pids]
    if any(not os.WIFEXITED(s) or os.WEXITSTATUS(s) for s in statuses):
        raise SilentWrong(f"a writer failed (statuses {statuses})")
    fresh = AdapterStore.open(store.root, url)
    acknowledged = [(fresh.resolve(p.read_text()), adapters[int(p.name.split("-")[0])][int(p.name.split("-")[1])])
                    for p in sorted(log.iterdir())]
    _consistent(fresh, acknowledged + [(revs[0], _adapter(0))])
    chain, cur = [], fresh.policy("pol").head
    while cur is not None:
        chain.append(cur)
        cur = fresh.catalog.lookup(cur).parent
    if sorted(chain) != sorted([r.id for r, _ in acknowledged] + [revs[0].id]) or len(set(chain)) != len(chain):
        raise DataLost(f"the head's lineage ({len(chain)} revisions) is not exactly the {len(acknowledged) + 1} "
                       f"acknowledged ones")


@case("lifecycle", "concurrent publishers on SQLite: one linear chain holding every acknowledged revision",
      expect="correct result", timeout_s=120)
def concurrent_sqlite(ctx):
    return _concurrent(ctx, "sqlite")


@case("lifecycle", "concurrent publishers on PostgreSQL: one linear chain holding every acknowledged revision",
      expect="correct result", needs=("postgres",), timeout_s=120)
def concurrent_postgres(ctx):
    return _concurrent(ctx, "postgres")
