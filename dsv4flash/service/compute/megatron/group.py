"""The Megatron trainer group as the server drives it: one veRL worker group on Ray, many policies' slots.

`MegatronGroup.start` builds veRL's config for the shell (`config.actor_config`), starts `world` workers
(`worker.TinkerPolicyWorker`), lets veRL build the Megatron engine on each and reads the adapter map off the
bridge's export (`mapping.AdapterMap`). Every policy call then runs under the group's lock: activate the
policy's slot, run the call, commit what it changed. The driver keeps the last acknowledged slot of every
policy (`_acked`), so when a worker dies mid-call the call fails with `TrainerRestarting` (retryable), the group
is rebuilt and every policy is restored to exactly what was acknowledged; the client's retry then runs on it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4flash.service.compute.megatron.layout import ComputePlane
from dsv4flash.service.plane.admission import AdmissionError, check_base
from dsv4flash.service.compute.megatron.mapping import (DIGIT_BITS, AdapterMap, cut_from_shell, digits_needed,
                                                        pad_to_shell)

# The rendezvous port of a group's ranks. veRL probes a free port, then rank 0's TCPStore binds it once the workers
# are up (seconds to minutes later); a port from the kernel's ephemeral range (Linux: 32768-60999) can meanwhile
# become the local end of any outgoing connection (Ray's own gRPC ones included) and the bind fails with
# EADDRINUSE, as a group rebuilt after a server restart did under load. Ports below it are only ever taken by
# listeners, which veRL's probe skips.
MASTER_PORTS = [20000, 32000]


class TrainerRestarting(RuntimeError):
    """A trainer worker died during the call: nothing of it was acknowledged; the group is being rebuilt with every
    policy at its last acknowledged state, so sending the call again succeeds."""


@dataclass
class GroupMetrics:
    """What the group did: slot swaps and commits (bytes, seconds), calls, restarts."""

    calls: dict = field(default_factory=dict)  # kind -> count
    swaps: int = 0
    swap_bytes: int = 0
    swap_s: float = 0.0
    commit_bytes: int = 0
    restarts: int = 0
    start_s: float = 0.0


class MegatronGroup:
    """One trainer group: veRL Megatron workers holding the base once and every admitted policy's slot."""

    def __init__(self, plane: ComputePlane, *, base_dir: Path, cfg, fingerprint, work_dir: Path) -> None:
        self.plane, self.base_dir, self.cfg, self.fingerprint = plane, Path(base_dir), cfg, fingerprint
        self.work_dir = Path(work_dir)
        self.world = plane.world()
        self.max_rank = plane.max_rank
        self.metrics = GroupMetrics()
        self._lock = threading.RLock()
        self._ready = threading.Event()
        self._broken: str | None = None  # why the group is down after failed restarts
        self._acked: dict[str, list[dict]] = {}  # policy -> per-rank slot state last acknowledged
        self.group = None
        self.timings: dict[str, float] = {}  # start-up phases (seconds)
        self.map: AdapterMap | None = None
        self._pool = None

    # ---- lifecycle ----
    def start(self, log=print) -> None:
        """Connect to Ray, start the workers, build the engine on each, derive the adapter map."""
        from dsv4flash.service.compute.megatron import cluster

        t0 = time.perf_counter()
        cluster.connect(self.plane.ray_address, num_cpus=max(8, self.world + 4))
        self.cuda = cluster.cuda_available()
        self.timings["ray_s"] = time.perf_counter() - t0
        self._config = self._build_config()
        self.timings["config_s"] = time.perf_counter() - t0 - self.timings["ray_s"]
        log(f"trainer group: starting {self.world} Megatron workers ({self.plane.layout.describe()}, "
            f"{'CUDA bf16' if self.cuda else 'CPU fp32 over gloo'}), shell {self.plane.placement} rank {self.max_rank}")
        self._spawn()
        self.metrics.start_s = time.perf_counter() - t0
        phases = ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in self.timings.items())
        log(f"trainer group: ready in {self.metrics.start_s:.0f} s ({phases}; {self.map.numel} adapter elements in "
            f"the shell)")
        self._ready.set()

    def _build_config(self):
        from dsv4flash.service.compute.megatron.config import actor_config

        return actor_config(self.base_dir, self.cfg.name, self.plane.placement, self.max_rank, self.plane.layout,
                            self.world, self.work_dir, cuda=self.cuda, micro_batch=self.plane.micro_batch)

    def _spawn(self) -> None:
        import ray
        from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        from dsv4flash.service.compute.megatron.worker import TinkerPolicyWorker

        self._pool = RayResourcePool(process_on_nodes=[self.world], use_gpu=self.cuda, max_colocate_count=1,
                                     name_prefix=f"dsv4flash_trainer_{int(time.time() * 1000)}")
        self.group = RayWorkerGroup(resource_pool=self._pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(TinkerPolicyWorker), config=self._config, role="actor"), master_port_range=MASTER_PORTS)
        t0 = time.perf_counter()
        rank_params = self.group.init_model()
        self.timings["init_model_s"] = time.perf_counter() - t0
        self.dp = self.world // (self.plane.layout.tp * self.plane.layout.cp * self.plane.layout.pp)
        t0 = time.perf_counter()
        found = self._probe(rank_params)
        self.timings["adapter_map_s"] = time.perf_counter() - t0
        if self.map is not None and (found.keys, found.shapes, found.rank_params) != (
                self.map.keys, self.map.shapes, self.map.rank_params):
            raise RuntimeError("trainer group: the restarted workers hold a different adapter layout")
        self.map = found

    def _probe(self, rank_params) -> AdapterMap:
        numels = [sum(int(torch.Size(s).numel()) for _, s in params) for params in rank_params]
        offsets = [sum(numels[:r]) for r in range(self.world)]
        bits = DIGIT_BITS[torch.bfloat16 if self.cuda else torch.float32]
        codes = None
        for digit in range(digits_needed(sum(numels), bits)):
            out = self.group.probe_export(offsets, bits, digit)
            keys, shapes = out[0][0], out[0][1]
            part = [o[2] << (bits * digit) for o in out]
            codes = part if codes is None else [c + p for c, p in zip(codes, part)]
        return AdapterMap.from_codes(keys, shapes, rank_params, codes)

    def _restart(self) -> None:
        """Rebuild the workers and put every policy back at its last acknowledged state."""
        import ray

        for worker in list(getattr(self.group, "workers", [])):
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for pg in getattr(self._pool, "pgs", None) or []:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self._spawn()
        for policy, states in self._acked.items():
            self.group.restore_policy([policy] * self.world, states)
        self.metrics.restarts += 1
        self._broken = None
        self._ready.set()

    def close(self) -> None:
        """Stop the workers."""
        import ray

        for worker in list(getattr(self.group, "workers", [])):
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001
                pass

    # ---- admission ----
    def admit(self, shapes: dict[str, tuple[int, ...]], rank: int, fingerprint) -> None:
        """Refuse a policy this group cannot train (AdmissionError naming the base or the field)."""
        if fingerprint is not None:
            check_base(fingerprint.digest, self.fingerprint, "the policy")
        if rank > self.max_rank:
            raise AdmissionError(f"LoraConfig.rank: {rank} is above the trainer group's maximum rank {self.max_rank} "
                                 f"(dsv4flash serve --trainer-max-rank)")
        outside = sorted(set(shapes) - set(self.map.keys))
        if outside:
            module = outside[0].rsplit(".lora_", 1)[0]
            raise AdmissionError(f"LoraConfig.preset: adapter module {module} is outside the trainer group's placement "
                                 f"shell {self.plane.placement!r} (dsv4flash serve --trainer-placement)")

    # ---- policies ----
    def create(self, policy: str, tensors: dict[str, torch.Tensor], scale: float, *, project: bool) -> dict:
        """A new policy with these canonical tensors (rank ≤ the shell's); `project`: take what the Megatron adapter
        holds of them (a fresh init: fused modules share a factor) instead of refusing what it cannot hold ->
        the canonical tensors the policy starts from."""
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        full = pad_to_shell(tensors, self.map.keys, self.map.shapes)
        if not project:
            self.map.check_roundtrip(full, f"policy {policy}")
        local = self.map.to_local(full)
        states = [{"value": v, "exp_avg": None, "exp_avg_sq": None, "grad": None, "step": 0, "scale": float(scale)}
                  for v in local]
        self._call("create", lambda: self.group.restore_policy([policy] * self.world, states))
        self._acked[policy] = states
        return cut_from_shell(self.map.to_canonical(local), shapes, f"policy {policy}")

    def load(self, policy: str, tensors: dict[str, torch.Tensor], moments: tuple | None, step: int,
             scale: float) -> None:
        """Replace a policy's adapter (and, with `moments` = (exp_avg, exp_avg_sq) canonical dicts, its Adam
        state and step); pending gradients are dropped."""
        full = pad_to_shell(tensors, self.map.keys, self.map.shapes)
        self.map.check_roundtrip(full, f"policy {policy}")
        local = self.map.to_local(full)
        if moments is not None:
            m = self.map.to_local(pad_to_shell(moments[0], self.map.keys, self.map.shapes))
            v = self.map.to_local(pad_to_shell(moments[1], self.map.keys, self.map.shapes))
        states = [{"value": local[r], "exp_avg": None if moments is None else m[r],
                   "exp_avg_sq": None if moments is None else v[r], "grad": None,
                   "step": int(step) if moments is not None else self._acked[policy][r]["step"],
                   "scale": float(scale)} for r in range(self.world)]
        self._call("load", lambda: self.group.restore_policy([policy] * self.world, states))
        self._acked[policy] = states

    def drop(self, policy: str) -> None:
        """Forget a policy (its run left the server)."""
        if self._acked.pop(policy, None) is not None:
            self._call("drop", lambda: self.group.drop_policy(policy))

    def state(self, policy: str, shapes: dict[str, tuple[int, ...]]) -> dict:
        """The policy's acknowledged canonical state: `value`, `exp_avg`, `exp_avg_sq` (None before any step),
        `grad` (None when nothing is pending) and `step`."""
        with self._lock:
            states = self._acked[policy]
        out = {"step": int(states[0]["step"])}
        for part in ("value", "exp_avg", "exp_avg_sq", "grad"):
            if states[0][part] is None:
                out[part] = None
                continue
            out[part] = cut_from_shell(self.map.to_canonical([s[part] for s in states]), shapes,
                                       f"policy {policy} {part}")
        return out

    # ---- compute ----
    def forward(self, policy: str, batch) -> object:
        """Log-probs of the policy, no gradients -> the workers' collected output."""
        return self._call("forward", lambda: (self._activate(policy), self.group.policy_forward(batch))[1])

    def backward(self, policy: str, batch) -> object:
        """forward_backward on the policy; the gradients stay live and uncommitted until `commit_grads` (or
        `rollback`) -> the workers' collected output."""
        return self._mutating("forward_backward", policy,
                              lambda: (self._activate(policy), self.group.policy_forward_backward(batch))[1])

    def commit_grads(self, policy: str) -> None:
        """Acknowledge the gradients of the last `backward` (refused if any is not finite: FloatingPointError)."""
        states = self._call("commit", lambda: self.group.commit_grads(policy))
        self._acked[policy] = states
        self.metrics.commit_bytes += sum(int(s["grad"].numel()) * 4 for s in states)

    def rollback(self, policy: str) -> None:
        """Drop what the last call left live (back to the acknowledged slot)."""
        self._call("rollback", lambda: self.group.restore_policy([policy] * self.world, self._acked[policy]))

    def optim_step(self, policy: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   clip: float) -> dict:
        """One Adam step with the client's hyperparameters -> metrics (grad_norm)."""
        params = {"lr": float(lr), "betas": (float(betas[0]), float(betas[1])), "eps": float(eps),
                  "weight_decay": float(weight_decay)}
        def step():
            self._activate(policy)
            return self.group.policy_optim_step(policy, params, float(clip))

        out = self._mutating("optim_step", policy, step)
        self._acked[policy] = [o["state"] for o in out]
        self.metrics.commit_bytes += sum(3 * int(o["state"]["value"].numel()) * 4 for o in out)
        norms = [o["metrics"].get("grad_norm") for o in out if o["metrics"].get("grad_norm") is not None]
        return {"grad_norm": float(norms[0])} if norms else {}

    def memory(self) -> list[dict]:
        """Each rank's live adapter bytes, slot bytes, slot count and device peak."""
        return self._call("memory", lambda: self.group.memory())

    def prometheus(self) -> str:
        """The group's counters and memory gauges in Prometheus text format."""
        memory = self.memory()
        m = self.metrics
        rows = [("swaps_total", "counter", "Slot swaps onto the trainer workers (a call for another policy).", m.swaps),
                ("swap_bytes_total", "counter", "Bytes copied from slots onto the live tensors, all ranks.",
                 m.swap_bytes),
                ("swap_seconds_total", "counter", "Seconds of slot swaps (slowest rank per swap).", m.swap_s),
                ("commit_bytes_total", "counter", "Bytes copied from the live tensors back into slots, all ranks.",
                 m.commit_bytes),
                ("restarts_total", "counter", "Times the group was rebuilt after losing a worker.", m.restarts),
                ("policies", "gauge", "Policies with a slot on the group.", len(self._acked)),
                ("live_bytes", "gauge", "Bytes of the live adapter training tensors on the largest rank (one "
                 "policy's).",
                 max(r["live_bytes"] for r in memory)),
                ("slot_bytes", "gauge", "Host bytes of every slot, all ranks.", sum(r["slot_bytes"] for r in memory)),
                ("device_peak_bytes", "gauge", "Peak device memory of the largest rank (0 on the CPU).",
                 max(r["device_peak_bytes"] for r in memory))]
        lines = []
        for name, kind, text, value in rows:
            lines += [f"# HELP dsv4flash_trainer_{name} {text}", f"# TYPE dsv4flash_trainer_{name} {kind}",
                      f"dsv4flash_trainer_{name} {value:g}" if isinstance(value, float) else
                      f"dsv4flash_trainer_{name} {value}"]
        lines += ["# HELP dsv4flash_trainer_calls_total Group calls by kind.",
                  "# TYPE dsv4flash_trainer_calls_total counter"]
        lines += [f'dsv4flash_trainer_calls_total{{kind="{k}"}} {v}' for k, v in sorted(m.calls.items())]
        return "\n".join(lines) + "\n"

    def worker_pids(self) -> list[int]:
        """The workers' process ids."""
        return self._call("pid", lambda: self.group.pid())

    # ---- internals ----
    def _mutating(self, kind: str, policy: str, fn):
        """`_call` of a call that changes the policy's live tensors: if it fails (and the group still stands), the
        policy goes back to its acknowledged slot, so nothing of the failed call stays."""
        try:
            return self._call(kind, fn)
        except TrainerRestarting:
            raise  # the rebuilt group restores the acknowledged slot anyway
        except BaseException:
            try:
                self.rollback(policy)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass
            raise

    def _activate(self, policy: str) -> None:
        stats = self.group.activate(policy)
        moved = sum(s["bytes"] for s in stats)
        if moved:
            self.metrics.swaps += 1
            self.metrics.swap_bytes += moved
            self.metrics.swap_s += max(s["seconds"] for s in stats)

    def _call(self, kind: str, fn):
        """Run `fn` on the group under its lock; a dead worker turns into `TrainerRestarting` after the rebuild
        starts, a worker's refusal into the error it names."""
        import ray

        self._ready.wait()
        if self._broken is not None:
            raise TrainerRestarting(f"{kind}: the trainer group is down and could not be rebuilt ({self._broken})")
        with self._lock:
            self.metrics.calls[kind] = self.metrics.calls.get(kind, 0) + 1
            done = threading.Event()
            threading.Thread(target=self._watch, args=(done,), name="dsv4flash-trainer-watch", daemon=True).start()
            try:
                return fn()
            except ray.exceptions.RayError as exc:
                if self._dead_workers():
                    self._ready.clear()  # later calls wait for the rebuilt group
                    threading.Thread(target=self._restart_logged, name="dsv4flash-trainer-restart",
                                     daemon=True).start()
                    raise TrainerRestarting(f"{kind}: a trainer worker died ({type(exc).__name__}); the group is "
                                            f"restarting with every policy at its last acknowledged state: send the "
                                            f"call again") from None
                raise _worker_error(exc) from None
            finally:
                done.set()

    def _watch(self, done: threading.Event) -> None:
        """While a call runs: once a worker is dead, end the others too, so ranks blocked in a collective with the
        dead one fail the call instead of waiting for it forever."""
        import ray

        while not done.wait(1.0):
            if self._dead_workers():
                for worker in self.group.workers:
                    try:
                        ray.kill(worker, no_restart=True)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
                return

    def _restart_logged(self, attempts: int = 3) -> None:
        """`_restart`, tried `attempts` times; after that the group is down and every call says why."""
        import sys

        with self._lock:
            for attempt in range(1, attempts + 1):
                try:
                    self._restart()
                    print(f"dsv4flash serve: trainer group restarted ({len(self._acked)} policies restored)",
                          file=sys.stderr, flush=True)
                    return
                except Exception as exc:  # noqa: BLE001 - the next call would wait forever otherwise
                    print(f"dsv4flash serve: trainer group restart {attempt}/{attempts} failed: {exc}",
                          file=sys.stderr, flush=True)
                    self._broken = f"{type(exc).__name__}: {exc}"
                    time.sleep(5.0)
            self._ready.set()

    def _dead_workers(self) -> list[int]:
        """Ranks whose actor Ray's control store reports dead (asked there: a busy actor cannot answer a ping)."""
        from ray._private import state

        dead = []
        for rank, worker in enumerate(self.group.workers):
            info = state.actors(actor_id=worker._actor_id.hex()) or {}
            if info.get("State") == "DEAD":
                dead.append(rank)
        return dead


def _worker_error(exc) -> Exception:
    """The exception a worker raised, as the driver should raise it (its class when it is a plain one)."""
    cause = getattr(exc, "cause", None)
    if cause is not None and type(cause).__name__ == "TrainerFault":
        return FloatingPointError(str(cause).splitlines()[-1] if "\n" in str(cause) else str(cause))
    if isinstance(cause, (ValueError, KeyError, TypeError)):
        return cause
    return RuntimeError(f"trainer worker: {exc}")
