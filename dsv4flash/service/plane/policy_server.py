"""The service plane of `dsv4flash serve`: tenants, sessions, runs, samplers and operations over the core.

Every request arrives here already parsed (core types, the caller's tenant). This layer checks that the tenant
may touch the run / checkpoint / sampler named, admits the request to the tenant's bounded queue as an
operation, and hands the work to the service core (`ServiceClient`, `TrainingClient`, `SamplingClient`,
`RestClient`), which holds the one implementation of training, sampling, losses and checkpoints. Anything of
another tenant is answered exactly like something that does not exist (`NotFound`).
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dsv4flash.lifecycle.errors import PolicyNotFoundError
from dsv4flash.lifecycle.refs import ModelId, ParsedCheckpointTinkerPath, run_id_of, session_of
from dsv4flash.service.compute.scheduler import PhaseScheduler
from dsv4flash.service.plane.admission import AdmissionError
from dsv4flash.service.plane.operations import OperationTable
from dsv4flash.service.plane.owners import RunOwners


class NotFound(LookupError):
    """No such run / checkpoint / sampler / session for this tenant (HTTP 404)."""


class BadRequest(ValueError):
    """A request field with a bad value (HTTP 400); the message names the field."""


class Conflict(ValueError):
    """A request that contradicts an earlier one sent under the same ids (HTTP 409); the message names the field."""


@dataclass
class Session:
    """One SDK session (a `ServiceClient`): its tenant and when it last sent a heartbeat."""

    session_id: str
    tenant: str
    user_metadata: dict = field(default_factory=dict)
    last_seen: float = field(default_factory=time.time)
    finished: bool = False
    sampler_clones: int = 0
    custom_losses: dict = field(default_factory=dict)  # loss id -> CustomLoss (create_custom_loss)


@dataclass
class Sampler:
    """A sampling session: the core SamplingClient, what it samples, and the session it belongs to."""

    sampler_id: str
    tenant: str
    client: Any
    model_path: str | None
    session_id: str
    clones: int = 0
    completions: dict = field(default_factory=dict)  # clone number -> CompletionQueue (retrieve_futures)

    def completion_queue(self, clone: int):
        """The completion queue of one clone of this sampling session (created on first use)."""
        from dsv4flash.service.plane.completions import CompletionQueue

        return self.completions.setdefault(int(clone), CompletionQueue())


# The user_metadata key that picks a run's dsv4flash placement preset (docs/service.md): the SDK's
# create_lora_training_client has no placement argument, and user_metadata is the one free field it sends.
PRESET_KEY = "dsv4flash_preset"
# LoraConfig's fields as the request names them (Tinker's `lora_config.rank`; the preset from user_metadata).
_PLACEMENT_FIELDS = {"LoraConfig.rank": "lora_config.rank", "LoraConfig.preset": f"user_metadata.{PRESET_KEY}"}


class PolicyServer:
    """Tenant-checked, queued access to one `ServiceClient` (resident base + adapter store)."""

    def __init__(self, service, *, tokenizer_dir: str | None = None, max_pending: int = 64,
                 keep_s: float = 3600.0, max_samplers: int = 32, session_timeout_s: float = 600.0,
                 phase_scheduler: bool = True, call_timeout_s: float | None = None) -> None:
        self.service = service
        self.tokenizer_dir = tokenizer_dir
        self.owners = RunOwners(service.state_root)
        self.ops = OperationTable(max_pending=max_pending, keep_s=keep_s)
        self.rest = service.create_rest_client()
        self._sessions: dict[str, Session] = {}
        self._models: dict[str, Any] = {}  # run id -> core TrainingClient
        self._samplers: dict[str, Sampler] = {}  # insertion order = age (oldest first)
        # stateless asample: (tenant, revision id (None: base)) -> SamplingClient; per tenant, because a client runs
        # its calls in order, so one shared by tenants would queue each behind the others' backlog
        self._by_revision: dict[tuple[str, str | None], Any] = {}
        # run id -> (the request that created it, the future of its creation): a retried create is answered from
        # here, so it never builds a fresh run over the live one
        self._creations: dict[str, tuple[Any, concurrent.futures.Future]] = {}
        self.max_samplers = int(max_samplers)
        self.session_timeout_s = float(session_timeout_s)
        self.call_timeout_s = None if call_timeout_s is None else float(call_timeout_s)
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="dsv4flash-plane")
        # The compute plane's scheduler, the same one the in-process concurrent GRPO uses: every core call of
        # every tenant takes one turn on the resident base, sampling (rollouts) before training (updates).
        # Without it (phase_scheduler=False) calls meet only at the base lock, in arrival order.
        self.scheduler = PhaseScheduler() if phase_scheduler else None
        # One scheduler per compute resource: the resident base here (`scheduler`), the Megatron trainer group, the
        # sampler replicas. A call takes a turn on the resource it runs on, so one policy's rollouts on the samplers
        # overlap another's forward_backward on the trainers, while calls on one resource stay fair across tenants.
        self.schedulers = ({"base": self.scheduler, "trainer": PhaseScheduler(), "samplers": PhaseScheduler()}
                           if phase_scheduler else {})

    # ---- sessions ----
    def create_session(self, tenant: str, user_metadata: dict | None) -> str:
        """A new session id for the tenant (sessions silent for `session_timeout_s` are finished first)."""
        self.reap()
        sid = f"s{secrets.token_hex(6)}"
        with self._lock:
            self._sessions[sid] = Session(sid, tenant, dict(user_metadata or {}))
        return sid

    def session(self, tenant: str, session_id: str) -> Session:
        """The tenant's live session."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise NotFound(f"session {session_id!r} not found")
        s.last_seen = time.time()  # any request of a session keeps it alive, not only heartbeats
        return s

    def reap(self, now: float | None = None) -> list[str]:
        """Finish every session that sent nothing for `session_timeout_s` (a crashed client) -> their ids."""
        now = time.time() if now is None else now
        with self._lock:
            stale = [s for s in self._sessions.values()
                     if not s.finished and now - s.last_seen > self.session_timeout_s]
        for s in stale:
            self.finish_session(s.tenant, s.session_id)
        return [s.session_id for s in stale]

    def heartbeat(self, tenant: str, session_id: str) -> None:
        """Mark a session alive; a finished (or timed-out) one raises `Gone`."""
        self.reap()
        s = self.session(tenant, session_id)
        if s.finished:
            raise Gone(f"session {session_id} has finished")
        s.last_seen = time.time()

    def finish_session(self, tenant: str, session_id: str) -> None:
        """End a session: its live models and samplers leave memory; runs and checkpoints stay in the store."""
        self.session(tenant, session_id).finished = True
        with self._lock:
            for run in [r for r in self._models if r.startswith(f"{session_id}-train-")]:
                self._models.pop(run).release()
            for sid in [k for k, v in self._samplers.items() if v.session_id == session_id]:
                del self._samplers[sid]

    # ---- server-side custom losses ----
    def add_custom_loss(self, tenant: str, session_id: str, seq_id: int, loss) -> str:
        """Keep a validated custom loss for the session -> its loss id (usable by that session's models)."""
        s = self.session(tenant, session_id)
        loss_id = f"{session_id}:loss:{int(seq_id)}"
        s.custom_losses[loss_id] = loss
        return loss_id

    def custom_loss(self, tenant: str, model_id: str, loss_id) -> Any:
        """The custom loss `loss_id` of the session that owns `model_id` (BadRequest naming the field)."""
        if not isinstance(loss_id, str) or not loss_id:
            raise BadRequest("loss_fn_config.loss_id: required for loss_fn 'custom' (a create_custom_loss id)")
        with self._lock:
            s = self._sessions.get(session_of(model_id))
        loss = None if s is None or s.tenant != tenant else s.custom_losses.get(loss_id)
        if loss is None:
            raise BadRequest(f"loss_fn_config.loss_id: {loss_id!r} is not a custom loss of this model's session")
        return loss

    # ---- operations ----
    def submit(self, tenant: str, kind: str, start: Callable[[], Any], encode: Callable[[Any], Any]) -> str:
        """Admit one request to the tenant's queue and start it -> its request id.

        `start()` returns a core APIFuture / concurrent Future (work already queued in order), or a plain value
        callable's result when wrapped by `in_pool`.
        """
        request_id = self.ops.admit(tenant, kind)
        try:
            fut = start()
        except BaseException:
            self.ops.release(tenant)
            raise
        if hasattr(fut, "set_deadline"):  # a core call (not a plane-side one run `in_pool`): time-boxed
            fut.set_deadline(self.call_timeout_s)
        self.ops.attach(request_id, tenant, kind, getattr(fut, "future", fut), encode, fut.cancel)
        return request_id

    def in_pool(self, fn: Callable[..., Any], *args, **kwargs) -> concurrent.futures.Future:
        """Run a synchronous core call on the plane's worker pool."""
        return self._pool.submit(fn, *args, **kwargs)

    # ---- the resident base ----
    def resolve_base(self, base_model: str) -> str:
        """The resident base's name for `base_model`: its own name, or the Hugging Face directory this server
        serves for it (`tokenizer_id`), so tools that load a tokenizer by model name (tinker-cookbook's
        `get_tokenizer(model_name)`) find it on disk; BadRequest naming the field otherwise."""
        name = self.service.base.base_model
        if base_model == name:
            return name
        if self.tokenizer_dir is not None and os.path.realpath(str(base_model)) == os.path.realpath(self.tokenizer_dir):
            return name
        raise BadRequest(f"base_model: {base_model!r} is not served here (the resident base is {name!r}, also "
                         f"reachable as its directory {self.tokenizer_dir!r})")

    @property
    def served_base_name(self) -> str:
        """The one name every answer gives the base: its served Hugging Face directory when there is one."""
        # The SDK loads a sampler's tokenizer by this name alone (AutoTokenizer.from_pretrained(base_model)), so a
        # short name like `tiny` would send it to the hub.
        return self.tokenizer_dir or self.service.base.base_model

    # ---- runs ----
    def model(self, tenant: str, model_id: str):
        """The tenant's live core TrainingClient for a model id."""
        run = run_id_of(model_id)
        if self.owners.owner(run) != tenant:
            raise NotFound(f"model {model_id!r} not found")
        with self._lock:
            tc = self._models.get(run)
            owner_session = self._sessions.get(session_of(model_id))
        if owner_session is not None:
            owner_session.last_seen = time.time()
        if tc is None:
            raise NotFound(f"model {model_id!r} is not loaded on this server (it ran before a restart: resume it "
                           f"with create_training_client_from_state(<its checkpoint>))")
        return tc

    def create_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, lora: dict,
                     user_metadata: dict | None) -> concurrent.futures.Future:
        """A new LoRA run `<session>:train:<seq>` on the worker pool (a retry gets the same) -> future model id.

        The placement is checked now, so a bad one is a 400 naming the field rather than a failed future."""
        lora = dict(lora)
        if (user_metadata or {}).get(PRESET_KEY) is not None:
            lora["preset"] = str(user_metadata[PRESET_KEY])
        try:
            self.service.admit(self.service.placement(**lora))  # a policy the trainer cannot hold: 400 now
        except ValueError as exc:
            name, _, why = str(exc).partition(": ")
            raise BadRequest(f"{_PLACEMENT_FIELDS[name]}: {why}" if name in _PLACEMENT_FIELDS
                             else str(exc) if name == "base" else f"lora_config: {exc}") from exc
        request = ("create_model", base_model, dict(lora), dict(user_metadata or {}))
        return self._create_once(tenant, session_id, model_seq_id, request, lambda model_id: self._new_model(
            tenant, model_id, base_model, lora, user_metadata))

    def create_model_from_state(self, tenant: str, session_id: str, model_seq_id: int, path: str,
                                with_optimizer: bool, user_metadata: dict | None) -> concurrent.futures.Future:
        """A new run loaded from a readable checkpoint (a retry gets the same) -> future (path, model id)."""
        self.require_readable(tenant, path)
        try:
            self.service.admit_checkpoint(path)  # another base, or a placement the trainer cannot hold: 400 now
        except AdmissionError as exc:
            name, _, why = str(exc).partition(": ")
            raise BadRequest(f"{_PLACEMENT_FIELDS.get(name, name)}: {why}") from exc
        request = ("load_weights", path, bool(with_optimizer), dict(user_metadata or {}))
        return self._create_once(tenant, session_id, model_seq_id, request, lambda model_id: self._model_from_state(
            tenant, model_id, path, with_optimizer, user_metadata))

    def _create_once(self, tenant: str, session_id: str, model_seq_id: int, request,
                     build: Callable[[str], Any]) -> concurrent.futures.Future:
        """`build(model_id)` for model `<session>:train:<seq>`, started at most once per request: the SDK resends a
        create whose answer it lost, and that retry must get the live run back, not a fresh one that silently
        drops every step since the last save. Another request under the same ids is a Conflict (raised now, not
        in the future); a creation that failed may be tried again."""
        self.session(tenant, session_id)
        model_id = str(ModelId(session_id, int(model_seq_id)))
        run = run_id_of(model_id)
        with self._lock:
            known = self._creations.get(run)
            failed = known is not None and known[1].done() and (known[1].cancelled() or known[1].exception())
            if known is None or failed:
                fut = self._pool.submit(build, model_id)
                self._creations[run] = (request, fut)
                return fut
        if known[0] != request:
            raise Conflict(f"model_seq_id: {int(model_seq_id)} of session {session_id} already names model "
                           f"{model_id}, created by another request ({known[0][0]}); send that request again to get "
                           f"it back, or use a new model_seq_id")
        if known[1].done():
            self.model(tenant, model_id)  # the same run, still live (not unloaded with its finished session)
        return known[1]

    def _new_model(self, tenant: str, model_id: str, base_model: str, lora: dict, user_metadata: dict | None) -> str:
        run = run_id_of(model_id)
        self.owners.claim(run, tenant)
        tc = self.service.create_lora_training_client(self.resolve_base(base_model), user_metadata=user_metadata, run_id=run, **lora)
        self._schedule(tc, run, tenant)
        with self._lock:
            self._models[run] = tc
        return model_id

    def _model_from_state(self, tenant: str, model_id: str, path: str, with_optimizer: bool,
                          user_metadata: dict | None) -> tuple[str, str]:
        run = run_id_of(model_id)
        self.owners.claim(run, tenant)
        make = (self.service.create_training_client_from_state_with_optimizer if with_optimizer
                else self.service.create_training_client_from_state)
        tc = make(path, user_metadata, run_id=run)
        self._schedule(tc, run, tenant)
        with self._lock:
            self._models[run] = tc
        return path, model_id

    def run_of(self, tenant: str, run_or_model_id: str) -> str:
        """A run id the tenant owns (model ids accepted)."""
        run = run_id_of(run_or_model_id)
        if self.owners.owner(run) != tenant:
            raise NotFound(f"training run {run_or_model_id!r} not found")
        return run

    # ---- checkpoints ----
    def parse_path(self, path: str) -> ParsedCheckpointTinkerPath:
        """A tinker:// / mint:// checkpoint path; BadRequest naming the field otherwise."""
        try:
            return ParsedCheckpointTinkerPath.from_tinker_path(path)
        except ValueError as exc:
            raise BadRequest(f"path: {exc}") from exc

    def require_own(self, tenant: str, path: str) -> ParsedCheckpointTinkerPath:
        """A checkpoint path of one of the tenant's runs (NotFound otherwise)."""
        parsed = self.parse_path(path)
        if self.owners.owner(parsed.training_run_id) != tenant:
            raise NotFound(f"checkpoint {path} not found")
        return parsed

    def require_readable(self, tenant: str, path: str) -> ParsedCheckpointTinkerPath:
        """A checkpoint the tenant owns, one its owner published, or a tag of a policy trained into the store
        outside the server (readable by every tenant: the operator put it there); NotFound otherwise."""
        parsed = self.parse_path(path)
        owner = self.owners.owner(parsed.training_run_id)
        if owner is None and self.service.is_trained_policy(parsed.training_run_id):
            pass
        elif owner is None or (owner != tenant and not self.service.checkpoints.get(path)["public"]):
            raise NotFound(f"checkpoint {path} not found")
        try:
            self.service.require_checkpoint(path)
        except FileNotFoundError as exc:
            raise NotFound(str(exc)) from exc
        return parsed

    # ---- samplers ----
    def create_sampler(self, tenant: str, session_id: str, model_path: str | None, base_model: str | None) -> str:
        """A sampling session on a readable checkpoint or the bare base -> its id."""
        self.session(tenant, session_id)
        if model_path is not None:
            self.require_readable(tenant, model_path)
        elif base_model is not None:
            self.resolve_base(base_model)
        client = self.service.create_sampling_client(model_path=model_path)
        return self.add_sampler(tenant, session_id, client, model_path)

    def add_sampler(self, tenant: str, session_id: str, client, model_path: str | None) -> str:
        """Register a core SamplingClient as a sampling session of the tenant -> its id.

        Each holds an adapter copy, so a tenant keeps at most `max_samplers`: registering one more drops its
        oldest (an RL loop makes one per step with `save_weights_and_get_sampling_client`; old ones answer 404).
        """
        sid = f"sampler-{secrets.token_hex(6)}"
        self._schedule(client, model_path or sid, tenant)
        with self._lock:
            mine = [k for k, v in self._samplers.items() if v.tenant == tenant]
            for old in mine[:max(0, len(mine) - self.max_samplers + 1)]:
                del self._samplers[old]
            self._samplers[sid] = Sampler(sid, tenant, client, model_path, session_id)
        return sid

    def path_sampler(self, tenant: str, model_path: str | None):
        """The tenant's core SamplingClient for the revision a checkpoint path resolves to now (None: the bare base)."""
        # Stateless `asample` calls would otherwise reread the checkpoint each time; each tenant's last
        # `max_samplers` revisions are kept. Keyed by revision, not path: a name deleted and saved again is other
        # weights. Per tenant: a client runs its calls in order, so a shared one would queue tenants behind each other.
        revision = None if model_path is None else self.service.require_checkpoint(model_path).id
        key = (tenant, revision)
        with self._lock:
            client = self._by_revision.pop(key, None)
        if client is None:
            client = self.service.create_sampling_client(model_path=model_path)
            self._schedule(client, model_path or "base", tenant)
            if model_path is not None and self.service.require_checkpoint(model_path).id != revision:
                return client  # the name moved while it was read: answer with it, but keep nothing under `revision`
        self._keep_revision_client(key, client)
        return client

    def revision_sampler(self, tenant: str, revision: str, name: str):
        """The tenant's core SamplingClient for one catalog revision (its full id), shared with `path_sampler`'s
        clients of the same revision: the OpenAI routes' names (`<policy>@<revision>`, a tag) resolve to one."""
        key = (tenant, revision)
        with self._lock:
            client = self._by_revision.pop(key, None)
        if client is None:
            client = self.service.create_sampling_client(revision=revision)
            self._schedule(client, name, tenant)
        self._keep_revision_client(key, client)
        return client

    def _keep_revision_client(self, key: tuple[str, str | None], client) -> None:
        with self._lock:
            self._by_revision[key] = client  # most recent last
            mine = [k for k in self._by_revision if k[0] == key[0]]
            for old in mine[:max(0, len(mine) - self.max_samplers)]:
                del self._by_revision[old]

    def sampler(self, tenant: str, sampler_id: str) -> Sampler:
        """The tenant's sampling session."""
        with self._lock:
            s = self._samplers.get(sampler_id)
        if s is None or s.tenant != tenant:
            raise NotFound(f"sampler {sampler_id!r} not found")
        return s

    def join_sampler(self, tenant: str, sampler_id: str) -> int:
        """A fresh clone number for one more client of a sampling session."""
        s = self.sampler(tenant, sampler_id)
        with self._lock:
            s.clones += 1
            return s.clones

    # ---- REST listings (the tenant's own runs only) ----
    def list_runs(self, tenant: str, limit: int, offset: int):
        """The tenant's training runs, newest first."""
        from tinker.types import Cursor, TrainingRunsResponse

        runs = [self.rest.get_training_run(r).result() for r in sorted(self.owners.runs_of(tenant))
                if self._exists(r)]
        runs.sort(key=lambda r: (r.last_request_time, r.training_run_id), reverse=True)
        return TrainingRunsResponse(training_runs=runs[offset:offset + limit],
                                    cursor=Cursor(offset=offset, limit=limit, total_count=len(runs)))

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int):
        """Every checkpoint of the tenant's runs, newest first."""
        from tinker.types import CheckpointsListResponse, Cursor

        every = [c for r in sorted(self.owners.runs_of(tenant)) if self._exists(r)
                 for c in self.rest.list_checkpoints(r).result().checkpoints]
        every.sort(key=lambda c: (c.time, c.tinker_path), reverse=True)
        return CheckpointsListResponse(checkpoints=every[offset:offset + limit],
                                       cursor=Cursor(offset=offset, limit=limit, total_count=len(every)))

    def _exists(self, run: str) -> bool:
        try:
            self.service.store.catalog.policy(run)  # one row, not the catalog's every name
        except PolicyNotFoundError:
            return False
        return True

    def _schedule(self, client, policy: str, tenant: str) -> None:
        if self.schedulers:
            client.schedule_with(self.schedulers[client.resource], policy, tenant)

    def close(self) -> None:
        """Stop the worker pool (queued core work still finishes on its own threads)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class Gone(Exception):
    """A finished session or an expired operation (HTTP 410)."""
