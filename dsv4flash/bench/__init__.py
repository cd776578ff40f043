"""Benchmarks: `python -m dsv4flash.bench NAME [--json PATH]`, figures measured side by side in one run.

Each benchmark module `dsv4flash.bench.<name>` defines `add_arguments(parser)` (optional) and
`run(args) -> BenchReport`. Reports print one table with ratios against the baseline and the
physical limit, and write the same figures as a flat JSON object.
"""

from dsv4flash.bench.report import BenchReport, Figure

BENCHMARKS: dict[str, str] = {
    "codecs": "checkpoint codec decode/encode bandwidth vs memcpy and a naive decode; convert peak RSS",
    "adapters": "packed vs per-expert MoE LoRA load, catalog register/lookup at 1e6, cold-load staircase",
    "model": "tiny reference model forward+backward step time",
    "engram": "host-pinned Engram row gather vs memcpy and the measured plain-gather limit, MET/MISS (50% / 90%)",
    "train_step": "LoRA step time: decoder_half with early stop vs full_linear at the same rank, MET/MISS at 0.65",
    "recompute": "CSA2 stack on megatron-core: activation memory and step time, full recompute vs none, MET/MISS",
    "faults": "fault-case table: tried / clean error / correct result / silent wrong / data lost / left behind / hung",
    "decode": "cached incremental decode vs full recompute tokens/s at 64/256/1024 tokens, prefill tok/s, shared-prefill cache memory",
    "handoff": "trainer -> sampler handoff: adapter revision vs merged full checkpoint, bytes and time (tiny measured, V4.1 computed)",
    "service_http": "dsv4flash serve via the tinker SDK vs in-process: fwd+bwd+optim and sample p50/p99, 3 concurrent GRPO clients vs sequential",
    "verl_step": "veRL GRPO step on CPU split into rollout / weight sync / replay / update / publish vs the embedded engine's GRPO step",
    "main": "the README's main job, fresh and cached base: wall time, base build / training / evaluation, tok/s, CLI error latency",
    "grpo_reward": "the README's GRPO example: reward per step beside the frozen base's on the same problems, thirds, MET/MISS rising and learned",
    "serving": "continuous batching over 1/8/64/1000 adapters (uniform, Zipf) vs one adapter and the base: tok/s, TTFT p50/p99; cold-load staircase serial/pipelined/prewarmed, MET/MISS",
    "service": "policy service: shared-encoder multi-adapter scoring (N=1..8) and decode steps, concurrent vs sequential GRPO makespan/busy/idle/peak RSS",
}

__all__ = ["BENCHMARKS", "BenchReport", "Figure"]
