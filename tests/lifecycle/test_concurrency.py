"""Concurrent writers from several processes: nothing lost, nothing torn, one linear chain per policy.

Four processes publish at once: each to its own policy, and all of them racing on one shared policy
with compare-and-set retries (`HeadConflictError` -> re-read the head, re-publish on top of it), while
also moving a shared tag and recording evals. Afterwards the shared policy's history must be a single
chain containing every successful publish exactly once.
"""

from __future__ import annotations

import os

import pytest

from dsv4flash.lifecycle.catalog import open_catalog
from dsv4flash.lifecycle.errors import HeadConflictError
from dsv4flash.lifecycle.store import AdapterStore

WRITERS, PER_WRITER = 4, 12


def _writer(root, url, w: int, adapters) -> None:
    store = AdapterStore(root, open_catalog(url))
    for i, ad in enumerate(adapters):
        store.publish(f"own{w}", ad, step=i)
        while True:
            try:
                rev = store.publish("shared", ad, step=w * 1000 + i, extra={"writer": w, "i": i})
                break
            except HeadConflictError:
                continue  # someone else moved the head: chain onto the new one
        store.catalog.tag("shared", "latest-eval", rev.id)
        store.catalog.record_eval("shared", rev.id, "score", float(w * 100 + i))
    store.close()


@pytest.mark.parametrize("catalog_kind", ["sqlite", "postgres"])
def test_concurrent_writers(catalog_kind, tmp_path, base_fp, adapter_factory, fork, request):
    url = str(tmp_path / "catalog.sqlite") if catalog_kind == "sqlite" else request.getfixturevalue("pg_dsn")
    root = tmp_path / "store"
    store = AdapterStore(root, open_catalog(url))
    for name in ["shared"] + [f"own{w}" for w in range(WRITERS)]:
        store.create_policy(name, base_fp)
    adapters = [[adapter_factory(100 * w + i, layers=[0], num_experts=2) for i in range(PER_WRITER)] for w in range(WRITERS)]

    pids = []
    for w in range(WRITERS):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _writer(root, url, w, adapters[w])
            except BaseException:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                code = 3
            finally:
                os._exit(code)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    assert all(os.WIFEXITED(s) and os.WEXITSTATUS(s) == 0 for s in statuses), statuses

    fresh = AdapterStore(root, open_catalog(url))
    for w in range(WRITERS):
        assert len(fresh.catalog.revisions(f"own{w}", limit=1000)) == PER_WRITER
        assert len(fresh.catalog.ancestors(fresh.policy(f"own{w}").head)) == PER_WRITER - 1
    shared = fresh.policy("shared")
    chain = [fresh.catalog.lookup(shared.head)] + fresh.catalog.ancestors(shared.head)
    assert len(chain) == WRITERS * PER_WRITER == len(fresh.catalog.revisions("shared", limit=1000))
    assert {(r.step // 1000, r.step % 1000) for r in chain} == {(w, i) for w in range(WRITERS) for i in range(PER_WRITER)}
    # within one writer, its publishes appear in order along the chain
    for w in range(WRITERS):
        mine = [r.step % 1000 for r in reversed(chain) if r.step // 1000 == w]
        assert mine == list(range(PER_WRITER))
    for r in chain:
        fresh.blobs.verify(r.id)
        assert fresh.catalog.evals("shared", r.id)["score"] == float((r.step // 1000) * 100 + r.step % 1000)
    assert len(fresh.catalog.tag_history("shared", "latest-eval")) == WRITERS * PER_WRITER
    if catalog_kind == "sqlite":
        assert fresh.catalog.integrity_check() == "ok"
