"""Concurrent multi-policy GRPO on one resident base.

Each policy runs its rollout → score → update → export loop through the Tinker API on its own thread. Compute
phases (sampling, forward/backward, optimizer) hold the resident base; scoring (a reward function with real
latency: a sleep, a subprocess, an environment), the sampler snapshot and the adapter export (a store write)
do not, so while one policy waits for rewards or writes its adapter the base runs another policy's compute. `PhaseScheduler` hands the base out one whole compute phase at a time, rollouts
first: interleaving two policies' phases call by call (what the base lock alone would do) makes both reach
their idle scoring late and then idle together, while run-to-completion with rollouts first starts each idle gap
as early as possible so another policy's compute fills it. Base weights are held once (every policy binds its
own adapter into a shared placement shell). A policy's results depend only on its own seeds, so running
concurrently gives the same weights as running alone.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv4flash.service.types import AdamParams, Datum, ModelInput, SamplingParams


@dataclass
class GRPOPolicySpec:
    """One policy's GRPO run: prompts, group size, steps, reward function (token list -> float; may block)."""

    name: str
    seed: int
    prompts: list[list[int]]
    reward_fn: Callable[[list[int]], float]
    steps: int = 3
    group_size: int = 4
    max_tokens: int = 4
    lr: float = 1e-2
    rank: int = 4
    preset: str = "decoder_half"


@dataclass
class PolicyResult:
    """Final adapter tensors, per-step mean reward, and seconds spent per phase."""

    name: str
    adapter: dict[str, torch.Tensor]
    rewards: list[float] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)
    exports: list[str] = field(default_factory=list)


class PhaseScheduler:
    """Grants the resident base to one compute phase at a time: fair across tenants, then within a tenant lowest
    priority value first, then FIFO.

    Tenants share the base by fair queuing on the base-seconds they used: the next turn goes to the waiting tenant
    that has used the least. A tenant that was idle re-enters at the level of the busy ones, whatever it used before
    (idling earns no credit, and a finished burst leaves no debt), so a tenant's wait is bounded by one turn of each
    other tenant, whatever their backlog. Within a tenant (and for the in-process GRPO, which names none), rollouts
    before updates, then arrival order. A turn whose work can pause between steps (sampling) hands the base over
    once another tenant is owed it by more than `QUANTUM_S` (`dsv4flash.service.calls.owed`), so one long call
    cannot hold the base while others wait, and two tenants' samples do not alternate token by token.
    """

    PRIORITY = {"rollout": 0, "update": 1}  # a rollout is followed by idle scoring: start it first
    GRANTS_KEPT = 4096
    QUANTUM_S = 0.05  # base-seconds a holder may be ahead of a waiting tenant before it hands over

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[tuple[str, int, int]] = []  # (tenant, priority, arrival) tickets
        self._order = itertools.count()
        self._busy = False
        self._holder: tuple[str, float] | None = None  # (tenant, perf_counter() of the grant) of the turn running
        self._used: dict[str, float] = {}  # tenant -> base-seconds used (virtual time of the fair queuing)
        self._seen: dict[str, float] = {}  # tenant -> perf_counter() of its last request for a turn
        # (policy, phase) in grant order, the last GRANTS_KEPT only: a long-running server takes millions of turns
        self.grants: collections.deque[tuple[str, str]] = collections.deque(maxlen=self.GRANTS_KEPT)
        self._released_at: float | None = None
        # Seconds the base sat idle before each grant, by the granted phase: before an update it waited for a
        # policy's scoring that no other compute covered; before a rollout, for a policy between its phases.
        self.idle_s = dict.fromkeys(self.PRIORITY, 0.0)
        self.busy_s = dict.fromkeys(self.PRIORITY, 0.0)
        self.first_grant: float | None = None  # perf_counter() of the first grant (setup before it: client creation)

    @contextlib.contextmanager
    def turn(self, policy: str, phase: str, tenant: str = ""):
        """Hold the base for one whole compute phase of `policy` (a call of `tenant`)."""
        from dsv4flash.service import calls

        ticket = (tenant, self.PRIORITY[phase], next(self._order))
        token = calls.current()
        # a call cancelled while it waits (for its turn, or to get the base back) leaves the queue at once
        unwatch = token.on_cancel(self._wake) if token is not None else (lambda: None)
        try:
            self._acquire(ticket, token)
            self.grants.append((policy, phase))
            handle = _Turn(self, ticket, phase)
            calls.set_turn(handle)
            try:
                yield
            finally:
                calls.set_turn(None)
                if handle.holding:  # not when it was stopped while waiting to get the base back
                    self._release(phase)
        finally:
            unwatch()

    def active_tenants(self, within_s: float) -> set[str]:
        """Tenants that asked for a turn within the last `within_s` seconds (waiting, holding, or between calls)."""
        now = time.perf_counter()
        with self._cond:
            return {t for t, seen in self._seen.items() if now - seen <= within_s}

    def usage(self, tenant: str) -> float:
        """Base-seconds `tenant` has used (its place in the fair queuing)."""
        with self._cond:
            return self._used.get(tenant, 0.0)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _level(self) -> float:
        """The fair-queuing clock: the least use among the tenants holding or waiting for the base."""
        active = {t for t, _, _ in self._waiting} | ({self._holder[0]} if self._holder else set())
        if active:
            return min(self._used.get(t, 0.0) for t in active)
        return max(self._used.values(), default=0.0)

    def _next(self) -> tuple[str, int, int]:
        # the tenant that has used the least (ties: the one waiting longest; phase priority stays inside a tenant,
        # or a tenant sampling back to back would win every tie against another's training), then its ticket
        first: dict[str, int] = {}
        for tenant, _, arrival in self._waiting:
            first[tenant] = min(first.get(tenant, arrival), arrival)
        tenant = min(first, key=lambda u: (self._used.get(u, 0.0), first[u]))
        return min((t for t in self._waiting if t[0] == tenant), key=lambda t: (t[1], t[2]))

    def _acquire(self, ticket: tuple[str, int, int], token, resumed: bool = False) -> None:
        tenant = ticket[0]
        with self._cond:
            idle = not resumed and not any(t[0] == tenant for t in self._waiting) \
                and not (self._holder and self._holder[0] == tenant)
            if idle:
                self._used[tenant] = self._level()  # back from idle: neither credit nor debt
            self._waiting.append(ticket)
            self._seen[tenant] = time.perf_counter()
            while self._busy or self._next() != ticket:
                if token is not None and token.cancelled:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()
                    token.check()
                self._cond.wait()
            self._waiting.remove(ticket)
            self._busy = True
            granted = time.perf_counter()
            self._holder = (tenant, granted)
            if self.first_grant is None:
                self.first_grant = granted
            if self._released_at is not None:
                self.idle_s[self._phase_of(ticket)] += granted - self._released_at

    def _phase_of(self, ticket: tuple[str, int, int]) -> str:
        return next(p for p, v in self.PRIORITY.items() if v == ticket[1])

    def _release(self, phase: str) -> None:
        with self._cond:
            tenant, granted = self._holder
            self._released_at = time.perf_counter()
            self._used[tenant] = self._used.get(tenant, 0.0) + (self._released_at - granted)
            self.busy_s[phase] += self._released_at - granted
            self._busy, self._holder = False, None
            self._cond.notify_all()

    def _owed(self) -> bool:
        """Whether a waiting tenant other than the holder has used `QUANTUM_S` less than the holder has by now."""
        with self._cond:
            if self._holder is None:
                return False
            tenant, granted = self._holder
            mine = self._used.get(tenant, 0.0) + (time.perf_counter() - granted)
            return any(t != tenant and self._used.get(t, 0.0) + self.QUANTUM_S < mine for t, _, _ in self._waiting)


class _Turn:
    """The turn a running call holds: whether another tenant is owed the base, and handing it over."""

    def __init__(self, scheduler: PhaseScheduler, ticket: tuple[str, int, int], phase: str) -> None:
        self.scheduler, self.ticket, self.phase = scheduler, ticket, phase
        self.holding = True

    def owed(self) -> bool:
        """Another tenant should run now."""
        return self.scheduler._owed()

    def hand_over(self) -> None:
        """Release the base and queue for it again in this call's own place (its tenant, priority, arrival)."""
        from dsv4flash.service import calls

        self.scheduler._release(self.phase)
        self.holding = False
        self.scheduler._acquire(self.ticket, calls.current(), resumed=True)  # still busy: keeps what it used
        self.holding = True


def run_policy(service, spec: GRPOPolicySpec, scheduler: PhaseScheduler | None = None) -> PolicyResult:
    """Rollout / score / update / export for `spec.steps` steps (Tinker cookbook shape: A = r − mean, IS loss)."""
    turn = scheduler.turn if scheduler is not None else (lambda policy, phase: contextlib.nullcontext())
    tc = service.create_lora_training_client(rank=spec.rank, preset=spec.preset, seed=spec.seed, run_id=spec.name)
    out = PolicyResult(spec.name, {})
    phases = dict.fromkeys(("rollout", "score", "update", "export"), 0.0)
    for step in range(spec.steps):
        t0 = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client()  # an adapter snapshot, no base compute: outside the turn
        with turn(spec.name, "rollout"):
            futures = [sampler.sample(ModelInput.from_ints(p), spec.group_size,
                                      SamplingParams(max_tokens=spec.max_tokens,
                                                     seed=spec.seed * 100003 + step * 101 + i))
                       for i, p in enumerate(spec.prompts)]
            groups = [f.result() for f in futures]
        t1 = time.perf_counter()
        rewards = [[spec.reward_fn(p + s.tokens) for s in g.sequences] for p, g in zip(spec.prompts, groups)]
        t2 = time.perf_counter()
        data = []
        for prompt, group, rs in zip(spec.prompts, groups, rewards):
            mean = sum(rs) / len(rs)
            for seq, r in zip(group.sequences, rs):
                toks, ob = prompt + seq.tokens, len(prompt) - 1
                data.append(Datum(ModelInput.from_ints(toks[:-1]),
                                  {"target_tokens": toks[1:], "logprobs": [0.0] * ob + seq.logprobs,
                                   "advantages": [0.0] * ob + [r - mean] * len(seq.tokens)}))
        with turn(spec.name, "update"):
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(AdamParams(learning_rate=spec.lr))
            fb.result(), opt.result()
        t3 = time.perf_counter()
        # The export writes the adapter into the store (serialise, hash, disk) and computes nothing on the base:
        # outside the turn, so another policy's compute overlaps it.
        out.exports.append(tc.save_weights_for_sampler(f"step-{step + 1}").result().path)
        t4 = time.perf_counter()
        out.rewards.append(sum(map(sum, rewards)) / sum(map(len, rewards)))
        for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += dt
    out.adapter = tc._exec.submit(lambda: {k: p.detach().clone() for k, p in tc.adapter.items()}).result()
    out.phase_s = phases
    return out


def run_sequential(service, specs: list[GRPOPolicySpec], scheduler: PhaseScheduler | None = None
                   ) -> tuple[list[PolicyResult], float]:
    """Each policy alone, one after another -> (results, makespan seconds). A `scheduler` (uncontended here)
    only accounts the base's busy and idle time per phase, for comparison with a concurrent run."""
    t0 = time.perf_counter()
    results = [run_policy(service, s, scheduler) for s in specs]
    return results, time.perf_counter() - t0


def run_concurrent(service, specs: list[GRPOPolicySpec], scheduler: PhaseScheduler | None = None
                   ) -> tuple[list[PolicyResult], float]:
    """All policies interleaved on the one resident base -> (results in spec order, makespan seconds)."""
    results: list[PolicyResult | None] = [None] * len(specs)
    errors: list[BaseException] = []
    scheduler = scheduler or PhaseScheduler()

    def work(i: int) -> None:
        try:
            results[i] = run_policy(service, specs[i], scheduler)
        except BaseException as exc:  # re-raised below with the policy named
            errors.append(RuntimeError(f"policy {specs[i].name!r} failed: {exc!r}"))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,), name=f"grpo-{s.name}") for i, s in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - t0
