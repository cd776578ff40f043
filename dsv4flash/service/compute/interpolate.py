"""Checkpoint interpolation (MinT's `checkpoints/interpolate`): θ = Σ c_i · θ_i over LoRA factors.

Sources must share one placement (same targets and rank) on the resident base. The interpolation is taken on
the A and B factors themselves, tensor by tensor (what a weight-space average of adapters means); the merged
delta Σ c_i B_i A_i of the sources is not the same thing unless the sources share their A (or B) factors. The
result is published as a sampler checkpoint of `run_id` (atomic, like `save_weights_for_sampler`).
"""

from __future__ import annotations

import torch

from dsv4flash.lifecycle.refs import ParsedCheckpointTinkerPath
from dsv4flash.engine.resident import placement_key


def interpolate_checkpoints(service, sources: list[str], coefficients: list[float], run_id: str, name: str) -> str:
    """Publish Σ c_i · source_i as `tinker://<run_id>/sampler_weights/<name>` -> that path."""
    if not sources or len(sources) != len(coefficients):
        raise ValueError(f"interpolate: {len(sources)} source_paths and {len(coefficients)} coefficients "
                         f"(need the same number, at least one)")
    read = [service._read_checkpoint(p, False) for p in sources]
    placement = read[0][2]
    for path, (tensors, _, pc) in zip(sources[1:], read[1:]):
        if placement_key(pc) != placement_key(placement) or set(tensors) != set(read[0][0]):
            raise ValueError(f"interpolate: {path} has another placement ({pc.preset!r}, rank {pc.rank}) than "
                             f"{sources[0]} ({placement.preset!r}, rank {placement.rank})")
    out = {k: sum(float(c) * t[k].float() for c, (t, _, _) in zip(coefficients, read)).to(read[0][0][k].dtype)
           for k in read[0][0]}
    if not all(torch.isfinite(v).all() for v in out.values()):
        raise ValueError("interpolate: the result has non-finite values (check the coefficients)")
    path = f"tinker://{run_id}/sampler_weights/{name}"
    tag = ParsedCheckpointTinkerPath.from_tinker_path(path).tag
    if tag in service.store.catalog.tags(run_id):
        raise ValueError(f"interpolate: output {path} already exists (pick another output_path)")
    with service.store_lock:
        service.store.publish(run_id, out, tags=[tag],
                              extra={"placement": placement.to_dict(), "kind": "sampler_weights", "name": name,
                                     "interpolated_from": list(sources),
                                     "coefficients": [float(c) for c in coefficients]})
    return path
