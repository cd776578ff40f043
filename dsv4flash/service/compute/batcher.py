"""Continuous batching: the sampling requests of many adapters (and the bare base) decode in one model pass a step.

`ContinuousBatcher` owns one thread that drives many `engine.sampling.Decoding`s (the state of the one decode
loop, `generate`, between its steps). Requests join and leave between steps. A joining request is prefilled (its
prompt once, however many samples; the prompts of one length that join together in one batched pass, like a
decode step); requests whose prompts are equal and whose adapters are decoder-only with the frozen KV write
share one prefill: the encoder half and the compressed KV run once and every adapter's
cache references the same tensors (`shared_encoder.multi_adapter_logits(..., caches=True)`). Then every step
runs each cohort in one pass: the frozen base op of every layer over all its rows, each row adding its own
adapter's LoRA delta (`lora.adapter_batch.AdapterBatch`, one entry per request: its adapter's factors at its
own rank with its own alpha / rank, or none for the base), the routed experts' rows split by request.

Tenants: while several are at work, each has at most `tenant_cap` requests decoding (the rest wait, or park
with their own cache), and each iteration takes one `PhaseScheduler` rollout turn in the name of the batch's
least-served tenant, so a flooding tenant's rows neither fill every step of a light tenant's request nor let
its training calls jump ahead of the light tenant's.

A cohort is the requests at the same position whose adapters share one target set (`family`: the placement
without rank, alpha and seed; base requests join any): the reference model's decode cache holds one length
per batch, so requests that joined at different positions decode as separate passes of one step.

Modes. `exact=True` (the default) runs the ops whose rounding depends on the rows around them (GEMMs that fold
the batch into M, transcendental elementwise tails; `batch_invariant.py`) once per request chunk, so each
request's tokens and log-probs are bit-equal to the same request served alone (`generate` over its own
prompt), whatever else is in the batch: a Tinker `sample`, an OpenAI completion at temperature 0, and the
same request among a thousand others give the same tokens. `exact=False` (the fast path, `--batch-mode fast`)
batches those ops too: fewer kernel calls per step, logits equal to fp32 rounding only, so a sampled token
can differ where two candidates tie to ~1e-7. Correctness is the default because the service promises
reproducible samples (same seed, same tokens) and its tests compare them exactly; the fast path is for
throughput where that promise is not needed.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch

from dsv4flash.engine.sampling import Decoding
from dsv4flash.lora.adapter_batch import AdapterBatch, adapter_batch
from dsv4flash.model.moe import MoE
from dsv4flash.service.compute.batch_invariant import instance_override, invariant_modules
from dsv4flash.service.compute.batched_cache import concat_caches
from dsv4flash.service.compute.batched_decoder import routed_by_chunk


def family(placement) -> str | None:
    """The target set of a placement (None: the bare base): adapters of one family share a batched pass."""
    if placement is None:
        return None
    spec = placement.to_dict()
    for name in ("rank", "alpha", "seed", "dropout"):
        spec.pop(name, None)
    return json.dumps(spec, sort_keys=True, default=str)


# Entry, Job and Cohort compare and hash by identity (eq=False): their fields hold tensors, and a field-wise `==`
# (what `job in jobs`, `jobs.remove(job)` or a set would call) asks a tensor for its truth value.
@dataclass(frozen=True, eq=False)
class Entry:
    """What one request decodes with: its placement and adapter tensors, or (None, None) for the bare base."""

    placement: object | None = None
    tensors: dict | None = None


@torch.no_grad()
def batched_extend(resident, entries: list[Entry], rows: list[int], cache, ids: torch.Tensor,
                   exact: bool = True):
    """One forward of `ids` [R,S] over `cache` (R rows: `rows[i]` of them for entries[i], in order) -> (logits
    [R,S,V] fp32, the extended cache); each request's rows get its own adapter's delta."""
    adapted = [e for e in entries if e.placement is not None]
    if len({family(e.placement) for e in adapted}) > 1:
        raise ValueError("batched_extend: the adapters of one pass must share a target set (one family)")
    if len(entries) == 1 or (not adapted and not exact):  # nothing to split: the shell (or base) as it is
        entry = entries[0]
        with resident.bind(entry.placement, entry.tensors) if adapted else resident.bare() as model:
            return model.decode(cache, ids)
    pc = adapted[0].placement if adapted else None
    batch = AdapterBatch(resident.adapter_slots(pc) if adapted else {}, [e.tensors for e in entries],
                         [None if e.placement is None else e.placement.scaling for e in entries])
    seq = ids.shape[1]
    bound = resident.bind(pc, adapted[0].tensors) if adapted else resident.bare()
    with bound as model, ExitStack() as stack:
        stack.enter_context(adapter_batch(batch))
        stack.enter_context(batch.rows(rows))
        if exact:
            stack.enter_context(invariant_modules(model, batch, 0, shared_source=False))
        for block in model.layers:
            if isinstance(block.ffn, MoE):
                stack.enter_context(instance_override(block.ffn, "forward",
                                                      routed_by_chunk(block.ffn, batch, [r * seq for r in rows])))
        return model.decode(cache, ids)


@dataclass(eq=False)
class Job:
    """One request in the batcher: its adapter, prompt, decode state, and where its rows sit in its cohort."""

    entry: Entry
    prompt: tuple
    state: Decoding
    future: Future
    token: object | None = None  # the call's StopToken: cancel / deadline, checked before each step
    prefilled: object | None = None  # a future of (last logits [1,V], DecodeCache) computed elsewhere
    cache: object | None = None  # the prefill cache until the job joins a cohort
    row_of: dict = field(default_factory=dict)  # key -> row among this job's rows of the cohort's cache
    offset: int = 0  # first row of this job in its cohort's cache
    tenant: str = ""
    submitted: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


@dataclass(eq=False)
class Cohort:
    """Jobs at one position (cache length) and of one family, decoding as one batch."""

    family: str | None
    jobs: list[Job]
    cache: object


@dataclass
class BatcherStats:
    """Counters since start (the serving metrics read them)."""

    steps: int = 0  # decode steps (one per cohort per iteration)
    iterations: int = 0
    tokens: int = 0  # tokens generated (every row of every step, prefill's first token included)
    rows: int = 0  # rows summed over steps (rows / steps: the mean batch occupancy)
    adapters: int = 0  # distinct adapters summed over steps
    prefills: int = 0
    batched_prefills: int = 0  # requests prefilled in a batched pass with others
    shared_prefills: int = 0  # requests whose prefill came from a shared encoder pass
    busy_s: float = 0.0
    last_rows: int = 0
    last_adapters: int = 0
    ttft_s: list = field(default_factory=list)  # per finished request: submit -> first token


class ContinuousBatcher:
    """Runs submitted decodes together, one pass per cohort per step, on one thread (started on first use)."""

    ACTIVE_S = 5.0  # a tenant that asked the scheduler for the base this recently counts as at work

    def __init__(self, resident, *, exact: bool = True, max_rows: int = 512, share_prefill: bool = True,
                 gather_s: float = 0.02, tenant_cap: int = 1) -> None:
        self.resident, self.exact, self.max_rows, self.share_prefill = resident, exact, int(max_rows), share_prefill
        # An idle batcher woken by a request waits for others sent with it (until none came for `gather_s`, at most
        # 8 times that), so requests sent at once form one cohort.
        self.gather_s = float(gather_s)
        # Tenant isolation: while two or more tenants have requests, each has at most `tenant_cap` in the batch (the
        # rest wait their turn), so a flooding tenant's rows do not slow every step of a light tenant's request.
        self.tenant_cap = int(tenant_cap)
        # The compute scheduler of the server (`PhaseScheduler`): each iteration takes one rollout turn on the
        # base, so training calls of other tenants interleave with the decode steps (None: the base lock alone).
        self.scheduler = None
        self.stats = BatcherStats()
        self._incoming: list[Job] = []
        self._parked: list[Job] = []  # decoding jobs set aside by the tenant cap (each with its own cache)
        self._cohorts: list[Cohort] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, entry: Entry, prompt: tuple, state: Decoding, *, token=None, prefilled=None,
               tenant: str = "") -> Future:
        """Queue one request (one prompt, `state`'s rows) of `tenant` -> a future of its `Rollout`."""
        if state.n_prompts != 1:
            raise ValueError(f"ContinuousBatcher: a request decodes one prompt, got {state.n_prompts}")
        job = Job(entry, prompt, state, Future(), token, prefilled, tenant=tenant)
        with self._cv:
            if self._closed:
                raise RuntimeError("ContinuousBatcher: closed")
            self._incoming.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dsv4flash-batcher", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job.future

    def run(self, entry: Entry, prompt: tuple, state: Decoding, *, token=None, prefilled=None, tenant: str = ""):
        """`submit` and wait -> the Rollout."""
        return self.submit(entry, prompt, state, token=token, prefilled=prefilled, tenant=tenant).result()

    def live(self) -> int:
        """Requests decoding or waiting to join."""
        with self._cv:
            return len(self._incoming) + len(self._parked) + sum(len(c.jobs) for c in self._cohorts)

    def close(self) -> None:
        """Stop the thread after the current step; unfinished requests fail."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    # ---- the loop ----
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._incoming and not self._cohorts and not self._parked and not self._closed:
                    self._cv.wait()
                if self._closed:
                    for job in self._incoming + self._parked + [j for c in self._cohorts for j in c.jobs]:
                        job.future.set_exception(RuntimeError("the batcher was closed"))
                    return
                for _ in range(8 if not self._cohorts and self.gather_s > 0 else 0):
                    arrived = len(self._incoming)
                    self._cv.wait(self.gather_s)  # releases the lock: the others sent at once arrive
                    if len(self._incoming) == arrived:
                        break
                joining = self._admissible()
                tenants = {job.tenant for job in joining + [j for c in self._cohorts for j in c.jobs]}
            # The turn goes to the batch's least-served tenant: a light tenant's request never waits behind a heavy
            # one's training turns because the heavy one also has rows in the batch (its rows are capped instead).
            payer = min(tenants, key=self.scheduler.usage) if self.scheduler is not None and tenants else ""
            t0 = time.perf_counter()
            try:
                with self.scheduler.turn("serving", "rollout", payer) if self.scheduler is not None \
                        else nullcontext():
                    self._admit(joining)
                    for cohort in list(self._cohorts):
                        self._step(cohort)
            except BaseException as exc:  # noqa: BLE001 - a bug must fail the requests, not hang them
                for job in joining + [j for c in self._cohorts for j in c.jobs]:
                    if not job.future.done():
                        job.future.set_exception(exc)
                self._cohorts = []
            self._cohorts = [c for c in self._cohorts if c.jobs]
            self.stats.iterations += 1
            self.stats.busy_s += time.perf_counter() - t0

    def _admissible(self) -> list[Job]:
        """Take the incoming jobs that may join now (caller holds the lock): all of them with one tenant at work,
        else up to `tenant_cap` live jobs per tenant, in arrival order; over the cap, a tenant's latest decoding
        jobs are parked (they resume, from where they were, once the cap allows)."""
        tenants = {j.tenant for c in self._cohorts for j in c.jobs} | {j.tenant for j in self._incoming + self._parked}
        if self.scheduler is not None:  # a tenant between its training calls is at work too
            tenants |= self.scheduler.active_tenants(self.ACTIVE_S) - {"serving"}
        if len(tenants) < 2:
            for job in self._parked:
                self._place(job)
            joining, self._incoming, self._parked = self._incoming, [], []
            return joining
        live: dict[str, int] = {}

        def admit(job: Job) -> bool:
            """Count `job` against its tenant's cap -> whether it fits."""
            if live.get(job.tenant, 0) >= self.tenant_cap:
                return False
            live[job.tenant] = live.get(job.tenant, 0) + 1
            return True

        for cohort in self._cohorts:
            kept = []
            for job in cohort.jobs:
                if admit(job):
                    kept.append(job)
                else:  # its rows of the cohort's cache become its own cache
                    rows = list(range(job.offset, job.offset + len(job.row_of)))
                    job.cache, job.offset = cohort.cache.select(rows), 0
                    self._parked.append(job)
            cohort.jobs = kept
        self._cohorts = [c for c in self._cohorts if c.jobs]
        parked = []
        for job in self._parked:
            if admit(job):
                self._place(job)
            else:
                parked.append(job)
        self._parked = parked
        joining, waiting = [], []
        for job in self._incoming:
            (joining if admit(job) else waiting).append(job)
        self._incoming = waiting
        return joining

    def _stopped(self, job: Job) -> bool:
        """Fail a cancelled / timed-out job (its call's token) -> True; False when it may go on."""
        if job.token is None:
            return False
        try:
            job.token.check()
        except BaseException as exc:  # noqa: BLE001 - CallCancelled / CallTimedOut go to the caller
            job.future.set_exception(exc)
            return True
        return False

    def _admit(self, joining: list[Job]) -> None:
        """Prefill the joining jobs, take their first token, and place them in cohorts."""
        joining = [j for j in joining if not self._stopped(j)]
        prefills = self._prefill(joining)
        for job in joining:
            try:
                logits, cache = prefills[id(job)]
            except KeyError:
                continue
            plan = job.state.plan()  # the first step: every key reads the prompt's last position
            job.state.advance(plan, logits.float().expand(plan.live.numel(), -1))
            job.first_token_s = time.perf_counter() - job.submitted
            self.stats.tokens += int(plan.live.numel())
            if self._finish_if_done(job):
                continue
            job.cache, job.row_of = cache, {key: 0 for key in plan.keys}
            self._place(job)

    def _prefill(self, jobs: list[Job]) -> dict[int, tuple]:
        """(last-position logits [1,V], prompt DecodeCache) per job: given, shared, or its own prefill."""
        from dsv4flash.service.compute.shared_encoder import multi_adapter_logits, sharing_refusal

        out: dict[int, tuple] = {}
        shared: dict[tuple, list[Job]] = {}
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            if job.prefilled is not None:
                out[id(job)] = job.prefilled.result()
                continue
            ids, _, images = job.prompt
            if (self.share_prefill and not images and job.entry.placement is not None
                    and sharing_refusal(self.resident, job.entry.placement) is None):
                shared.setdefault(("shared", tuple(ids.tolist())), []).append(job)
            elif not images:
                groups.setdefault(("batched", int(ids.numel()), family(job.entry.placement)), []).append(job)
            else:
                groups[("own", id(job))] = [job]
        for key, members in shared.items():  # a prompt of one request alone shares nothing: batch it by length
            if len(members) > 1:
                groups[key] = members
            else:
                job = members[0]
                groups.setdefault(("batched", int(job.prompt[0].numel()), family(job.entry.placement)), []).append(job)
        for (kind, *_), members in groups.items():
            try:
                if kind == "batched" and len(members) > 1:
                    from dsv4flash.model.decode import empty_cache

                    ids = torch.stack([j.prompt[0] for j in members])  # [k, P]
                    logits, cache = batched_extend(self.resident, [j.entry for j in members], [1] * len(members),
                                                   empty_cache(self.resident.model, len(members)), ids,
                                                   exact=self.exact)
                    for i, j in enumerate(members):
                        out[id(j)] = (logits[i:i + 1, -1], cache.select([i]))
                    self.stats.batched_prefills += len(members)
                elif kind == "shared" and len(members) > 1:
                    rows = members[0].prompt[0][None]  # [1, P]
                    result = multi_adapter_logits(self.resident, rows, [(j.entry.placement, j.entry.tensors)
                                                                        for j in members], caches=True)
                    for j, logits, cache in zip(members, result.logits, result.caches):
                        out[id(j)] = (logits[:, -1], cache)
                    self.stats.shared_prefills += len(members)
                else:
                    for j in members:
                        out[id(j)] = self._own_prefill(j)
                self.stats.prefills += len(members)
            except BaseException as exc:  # noqa: BLE001 - this group's requests fail, the batch goes on
                for j in members:
                    out.pop(id(j), None)
                    j.future.set_exception(exc)
        return out

    def _own_prefill(self, job: Job) -> tuple:
        ids, types, images = job.prompt
        entry = job.entry
        ctx = self.resident.bare() if entry.placement is None else self.resident.bind(entry.placement, entry.tensors)
        with ctx as model, torch.no_grad():
            logits, cache = model.prefill(ids[None], types[None], list(images))
        return logits[:, -1], cache

    def _place(self, job: Job) -> None:
        """Join a cohort at the job's position of a compatible family (room permitting), or start one."""
        fam, length = family(job.entry.placement), job.cache.length
        rows = len(job.row_of)
        for cohort in self._cohorts:
            size = sum(len(j.row_of) for j in cohort.jobs)
            if cohort.cache.length == length and (cohort.family is None or fam is None or cohort.family == fam) \
                    and size + rows <= self.max_rows:
                job.offset = cohort.cache.batch_size
                cohort.cache = concat_caches([cohort.cache, job.cache])
                cohort.jobs.append(job)
                cohort.family = cohort.family or fam
                job.cache = None
                return
        job.offset, cohort = 0, Cohort(fam, [job], job.cache)
        job.cache = None
        self._cohorts.append(cohort)

    def _step(self, cohort: Cohort) -> None:
        """One decode step of every job of the cohort, in one model pass."""
        cohort.jobs = [j for j in cohort.jobs if not self._stopped(j)]
        if not cohort.jobs:
            return
        plans = [j.state.plan() for j in cohort.jobs]
        select, tokens, rows = [], [], []
        for job, plan in zip(cohort.jobs, plans):
            select += [job.offset + job.row_of[p] for p in plan.parents]
            tokens += plan.extend
            rows.append(len(plan.keys))
        entries = [j.entry for j in cohort.jobs]
        logits, cache = batched_extend(self.resident, entries, rows, cohort.cache.select(select),
                                       torch.tensor(tokens)[:, None], exact=self.exact)
        logits = logits[:, 0]  # [R, V]
        self.stats.steps += 1
        self.stats.rows += len(tokens)
        self.stats.last_rows = len(tokens)
        adapters = len({id(e.tensors) for e in entries if e.tensors is not None})
        self.stats.adapters += adapters
        self.stats.last_adapters = adapters
        self.stats.tokens += len(tokens)
        start, kept = 0, []
        for job, plan, n in zip(cohort.jobs, plans, rows):
            job.state.advance(plan, logits[start:start + n][plan.inverse].float())
            job.row_of, job.offset = {key: i for i, key in enumerate(plan.keys)}, start
            start += n
            if not self._finish_if_done(job):
                kept.append(job)
        cohort.jobs, cohort.cache = kept, cache

    def _finish_if_done(self, job: Job) -> bool:
        if not job.state.finished:
            return False
        self.stats.ttft_s.append(job.first_token_s)
        del self.stats.ttft_s[:-4096]
        job.future.set_result(job.state.rollout())
        return True
