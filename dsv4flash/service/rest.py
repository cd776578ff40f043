"""`RestClient`: Tinker's run and checkpoint management over the embedded service's lifecycle store.

Runs are lifecycle policies; checkpoints are their `weights.<name>` / `sampler_weights.<name>` tags. Every
call returns an `APIFuture` (Tinker's RestClient returns futures too). Listings first expire checkpoints whose
TTL passed. Deleting a checkpoint removes its tag and retires the revision when nothing else points at it, so
`ServiceClient.gc()` frees its bytes.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from tinker.types import Checkpoint, CheckpointsListResponse, Cursor, TrainingRun, TrainingRunsResponse

from dsv4flash.lifecycle.errors import PolicyNotFoundError
from dsv4flash.lifecycle.refs import CHECKPOINT_TAG_PREFIXES
from dsv4flash.service.futures import APIFuture, OrderedExecutor
from dsv4flash.service.types import CheckpointArchiveUrlResponse, ParsedCheckpointTinkerPath

log = logging.getLogger("dsv4flash.service")


def _when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc)


class RestClient:
    """Run and checkpoint listings, deletion, publish flags, TTLs and archive URLs (Tinker names)."""

    def __init__(self, service) -> None:
        self.service = service
        self._exec = OrderedExecutor(f"rest-{id(self) & 0xFFFF:04x}")

    # ---- runs ----
    def list_training_runs(self, limit: int = 20, offset: int = 0) -> APIFuture:
        """Training runs (newest first), paged."""
        return self._exec.submit(self._list_runs, int(limit), int(offset))

    def get_training_run(self, training_run_id: str) -> APIFuture:
        """One training run."""
        return self._exec.submit(self._run, training_run_id)

    def get_training_run_by_tinker_path(self, tinker_path: str) -> APIFuture:
        """The run a checkpoint path belongs to."""
        return self.get_training_run(ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id)

    # ---- checkpoints ----
    def list_checkpoints(self, training_run_id: str) -> APIFuture:
        """A run's checkpoints, newest first."""
        return self._exec.submit(self._list_checkpoints, training_run_id)

    def list_user_checkpoints(self, limit: int = 100, offset: int = 0) -> APIFuture:
        """Every run's checkpoints, newest first, paged."""
        return self._exec.submit(self._list_user_checkpoints, int(limit), int(offset))

    def delete_checkpoint(self, training_run_id: str, checkpoint_id: str) -> APIFuture:
        """Delete `tinker://<run>/<kind>/<name>`; `checkpoint_id` is `weights/<name>` or `sampler_weights/<name>`."""
        return self.delete_checkpoint_from_tinker_path(f"tinker://{training_run_id}/{checkpoint_id}")

    def delete_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture:
        """Delete a checkpoint by path (its name stops resolving now; bytes go at the next gc)."""
        return self._exec.submit(self.service.delete_checkpoint, tinker_path)

    def publish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture:
        """Mark a checkpoint public."""
        return self._exec.submit(self._flag, tinker_path, True)

    def unpublish_checkpoint_from_tinker_path(self, tinker_path: str) -> APIFuture:
        """Mark a checkpoint private."""
        return self._exec.submit(self._flag, tinker_path, False)

    def set_checkpoint_ttl_from_tinker_path(self, tinker_path: str, ttl_seconds: float | None) -> APIFuture:
        """Expire a checkpoint `ttl_seconds` from now (None: never)."""
        return self._exec.submit(self._ttl, tinker_path, ttl_seconds)

    def get_checkpoint_archive_url_from_tinker_path(self, tinker_path: str) -> APIFuture:
        """A `file://` URL of the checkpoint exported as a PEFT directory (written once, atomically)."""
        return self._exec.submit(self._archive, tinker_path)

    # ---- work (public listings expire first, once per call; the helpers below never do) ----
    def _checkpoints_of(self, run_id: str) -> list[Checkpoint]:
        """A run's checkpoints, newest first."""
        catalog = self.service.store.catalog
        rows = [self._checkpoint(run_id, tag, lambda rev_id=rev_id: catalog.lookup(rev_id))
                for tag, rev_id in catalog.tags(run_id).items()]
        out = [c for c in rows if c is not None]
        out.sort(key=lambda c: (c.time, c.tinker_path), reverse=True)
        return out

    def _checkpoint(self, run_id: str, tag: str, revision) -> Checkpoint | None:
        """The Checkpoint a run's catalog tag names (`revision()` its RevisionRecord); None for a tag that is no
        checkpoint or a row that cannot be shown (a name no path can spell, a time out of range: logged, so one
        such row never fails a listing)."""
        try:
            path = ParsedCheckpointTinkerPath.from_tag(run_id, tag)
            if path is None:
                return None  # a tag set through the lifecycle API, not a Tinker checkpoint
            rev, entry = revision(), self.service.checkpoints.get(path.tinker_path)
            return Checkpoint(checkpoint_id=path.run_relative, checkpoint_type=path.checkpoint_type,
                              time=_when(rev.created), tinker_path=path.tinker_path, size_bytes=int(rev.nbytes),
                              public=bool(entry["public"]), expires_at=_when(entry["expires_at"]))
        except (ValueError, TypeError, OverflowError, OSError, LookupError) as exc:
            log.warning("listing of run %s: checkpoint %s skipped (%s)", run_id, tag, exc)
            return None

    def _training_run(self, run_id: str) -> TrainingRun:
        record = self.service.store.catalog.policy(run_id)  # PolicyNotFoundError names the run
        checkpoints = self._checkpoints_of(run_id)
        meta = dict(record.meta or {})
        info = dict(meta.get("dsv4flash_service") or {})
        last = next((c for c in checkpoints if c.checkpoint_type == "training"), None)
        last_sampler = next((c for c in checkpoints if c.checkpoint_type == "sampler"), None)
        rank = info.get("rank", info.get("lora_rank"))  # records written before the rename say lora_rank
        user_metadata = {str(k): str(v) for k, v in (meta.get("user_metadata") or {}).items()} or None
        return TrainingRun(training_run_id=run_id, base_model=info.get("base_model", self.service.base.base_model),
                           model_owner="local", is_lora=True, corrupted=False, lora_rank=rank,
                           last_request_time=_when(record.updated), last_checkpoint=last,
                           last_sampler_checkpoint=last_sampler, user_metadata=user_metadata)

    def _list_checkpoints(self, run_id: str) -> CheckpointsListResponse:
        self.service.expire_checkpoints()
        out = self._checkpoints_of(run_id)
        return CheckpointsListResponse(checkpoints=out, cursor=Cursor(offset=0, limit=len(out), total_count=len(out)))

    def _list_user_checkpoints(self, limit: int, offset: int) -> CheckpointsListResponse:
        """One page of every run's checkpoints, newest first (ties: run, then name, descending), read from the
        catalog page by page: a page costs its own rows however many runs the store holds."""
        self.service.expire_checkpoints()
        catalog = self.service.store.catalog
        rows = catalog.list_tagged(CHECKPOINT_TAG_PREFIXES, limit=limit, offset=offset)
        page = [self._checkpoint(run_id, tag, lambda rev=rev: rev) for run_id, tag, rev in rows]
        return CheckpointsListResponse(checkpoints=[c for c in page if c is not None],
                                       cursor=Cursor(offset=offset, limit=limit,
                                                     total_count=catalog.count_tagged(CHECKPOINT_TAG_PREFIXES)))

    def _run(self, run_id: str) -> TrainingRun:
        self.service.expire_checkpoints()
        return self._training_run(run_id)

    def _list_runs(self, limit: int, offset: int) -> TrainingRunsResponse:
        """One page of the runs, most recently updated first (ties: run id, descending), paged by the catalog: a
        page reads its own runs, not the store's every policy."""
        self.service.expire_checkpoints()
        catalog = self.service.store.catalog
        runs = []
        for name in catalog.list_policies(newest_first=True, limit=limit, offset=offset):
            try:
                runs.append(self._training_run(name))
            except PolicyNotFoundError:
                continue  # removed since the page was read
        return TrainingRunsResponse(training_runs=runs,
                                    cursor=Cursor(offset=offset, limit=limit, total_count=catalog.count_policies()))

    def _flag(self, path: str, public: bool) -> None:
        self.service.require_checkpoint(path)
        self.service.checkpoints.set(path, public=public)

    def _ttl(self, path: str, ttl_seconds: float | None) -> None:
        self.service.require_checkpoint(path)
        self.service.checkpoints.set(path, ttl_seconds=ttl_seconds)

    def _archive(self, path: str) -> CheckpointArchiveUrlResponse:
        target, _ = self.service.peft_archive(path)
        return CheckpointArchiveUrlResponse(target.resolve().as_uri(),
                                            _when(self.service.checkpoints.get(path)["expires_at"]))


def _async_twin(name: str):
    """`<name>_async`: the same future, from a coroutine (Tinker's double-await pattern)."""

    async def twin(self, *args, **kwargs) -> APIFuture:
        return getattr(self, name)(*args, **kwargs)

    twin.__name__ = f"{name}_async"
    twin.__doc__ = f"Async twin of `{name}`."
    return twin


for _name in ("list_training_runs", "get_training_run", "get_training_run_by_tinker_path", "list_checkpoints",
              "list_user_checkpoints", "delete_checkpoint", "delete_checkpoint_from_tinker_path",
              "publish_checkpoint_from_tinker_path", "unpublish_checkpoint_from_tinker_path",
              "set_checkpoint_ttl_from_tinker_path", "get_checkpoint_archive_url_from_tinker_path"):
    setattr(RestClient, f"{_name}_async", _async_twin(_name))
