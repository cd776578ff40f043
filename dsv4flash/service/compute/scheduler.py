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

import contextlib
import heapq
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
    """Grants the resident base to one policy's compute phase at a time: lowest priority value first, then FIFO."""

    PRIORITY = {"rollout": 0, "update": 1}  # a rollout is followed by idle scoring: start it first

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int]] = []
        self._order = itertools.count()
        self._busy = False
        self.grants: list[tuple[str, str]] = []  # (policy, phase) in grant order
        self._released_at: float | None = None
        # Seconds the base sat idle before each grant, by the granted phase: before an update it waited for a
        # policy's scoring that no other compute covered; before a rollout, for a policy between its phases.
        self.idle_s = dict.fromkeys(self.PRIORITY, 0.0)
        self.busy_s = dict.fromkeys(self.PRIORITY, 0.0)
        self.first_grant: float | None = None  # perf_counter() of the first grant (setup before it: client creation)

    @contextlib.contextmanager
    def turn(self, policy: str, phase: str):
        """Hold the base for one whole compute phase of `policy`."""
        ticket = (self.PRIORITY[phase], next(self._order))
        with self._cond:
            heapq.heappush(self._waiting, ticket)
            while self._busy or self._waiting[0] != ticket:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._busy = True
            self.grants.append((policy, phase))
            granted = time.perf_counter()
            if self.first_grant is None:
                self.first_grant = granted
            if self._released_at is not None:
                self.idle_s[phase] += granted - self._released_at
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._released_at = time.perf_counter()
                self.busy_s[phase] += self._released_at - granted
                self._cond.notify_all()


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
