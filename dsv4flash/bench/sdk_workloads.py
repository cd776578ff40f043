"""The tinker-SDK workloads the service benchmarks time: a supervised step's data, timed calls, and a cookbook-shaped
GRPO client (rollout, a reward with latency, update, export), alone or three at once."""

from __future__ import annotations

import threading
import time

import numpy as np

MINT_GRPO = 1.77  # MinT's 3-policy concurrent GRPO speedup over sequential (the service benches' target)
KEY = "tml-bench-0000000000000000"


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of durations in seconds, in milliseconds."""
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def timed(fn, calls: int, progress, label: str) -> list[float]:
    """`calls` durations of `fn()` in seconds, after one warm-up call (progress on `progress`)."""
    fn()  # warm-up (first call builds shells, connections)
    out = []
    task = progress.add_task(label, total=calls)
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        progress.advance(task)
    return out


def sl_data(mod):
    """Two cross-entropy datums of `mod`'s types (the SDK's or the core's)."""
    rows = [[0, 10, 11, 12, 20, 21, 22, 1], [0, 13, 14, 15, 23, 24, 25, 1]]
    return [mod.Datum(model_input=mod.ModelInput.from_ints(r[:-1]),
                      loss_fn_inputs=dict(target_tokens=np.array(r[1:]), weights=np.ones(len(r) - 1, np.float32)))
            for r in rows]


def grpo_client(url: str, name: str, seed: int, steps: int, latency: float, phases: dict) -> None:
    """One cookbook-shaped GRPO loop through the SDK: rollout, score (sleeps), update, export."""
    import tinker
    from tinker import types

    sdk = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    prompts = [[0, 20 + seed, 21, 22], [0, 30 + seed, 31, 32]]
    score = 0.0
    for step in range(steps):
        sampler = tc.save_weights_and_get_sampling_client().result()
        groups = [f.result() for f in [sampler.sample(types.ModelInput.from_ints(p), 4, types.SamplingParams(
            max_tokens=4, seed=seed * 100003 + step * 101 + i)) for i, p in enumerate(prompts)]]
        t0 = time.perf_counter()
        rewards = []
        for p, g in zip(prompts, groups):
            rs = []
            for s in g.sequences:
                time.sleep(latency)  # the reward call's latency: leaves the base to the other clients
                rs.append(float((p + list(s.tokens))[-1] % 3 == 0))
            rewards.append(rs)
        score += time.perf_counter() - t0
        data = []
        for p, g, rs in zip(prompts, groups, rewards):
            mean = sum(rs) / len(rs)
            for s, r in zip(g.sequences, rs):
                toks, ob = p + list(s.tokens), len(p) - 1
                data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=dict(
                    target_tokens=np.array(toks[1:]), logprobs=np.array([0.0] * ob + list(s.logprobs), np.float32),
                    advantages=np.array([0.0] * ob + [r - mean] * len(s.tokens), np.float32))))
        fb, opt = tc.forward_backward(data, "importance_sampling"), tc.optim_step(types.AdamParams(learning_rate=1e-2))
        fb.result(), opt.result()
        tc.save_weights_for_sampler(f"{name}-step-{step + 1}").result()
    phases[name] = score


def concurrent(url: str, steps: int, latency: float) -> float:
    """Makespan of 3 GRPO clients at once."""
    con_phases: dict = {}
    threads = [threading.Thread(target=grpo_client, args=(url, f"con{i}", i, steps, latency, con_phases))
               for i in range(3)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if len(con_phases) != 3:
        raise RuntimeError("a concurrent GRPO client failed (see its traceback above)")
    return time.perf_counter() - t0


def sequential_vs_concurrent(url: str, steps: int, latency: float, advance=lambda: None) -> dict[str, float]:
    """3 GRPO clients one after another, then 3 at once -> makespans (`sequential`, `concurrent`), the scoring
    share of the sequential one (`scoring`) and the zero-idle `bound` max(sequential − scoring, sequential / 3)."""
    phases: dict = {}
    t0 = time.perf_counter()
    for i in range(3):
        grpo_client(url, f"seq{i}", i, steps, latency, phases)
    seq = time.perf_counter() - t0
    advance()
    con = concurrent(url, steps, latency)
    advance()
    scoring = sum(phases.values())
    return {"sequential": seq, "concurrent": con, "scoring": scoring, "bound": max(seq - scoring, seq / 3)}
