"""MinT's two extension endpoints (mindlab-toolkit 0.2.0, `mint/_mintx.py`), polled like every future:

- `POST /api/v1/mint/forward_backward_reverse_kl`: reverse-KL distillation of a run onto a reference checkpoint
  (`dsv4flash.service.compute.distill`);
- `POST /api/v1/mint/checkpoints/interpolate`: Σ c_i · checkpoint_i as a new sampler checkpoint
  (`dsv4flash.service.compute.interpolate`).

The wire schemas are MinT's; `mint` itself pins tinker 0.22 and cannot be imported next to the server's 0.38,
so the request models below restate its field names and types (the tests drive the real `mint` client).
"""

from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dsv4flash.lifecycle.refs import has_checkpoint_scheme
from dsv4flash.service.plane.policy_server import BadRequest
from dsv4flash.service.protocol import wire
from dsv4flash.service.protocol.http import future_response, guarded, parse, tenant_of


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Tensor(_Wire):
    data: list[float] | list[int] | float
    shape: list[int] | None = None
    dtype: str = "float32"


class _ReverseKLDatum(_Wire):
    student_input: dict
    reference_input: dict
    target_tokens: _Tensor
    weights: _Tensor


class ReverseKLRequest(_Wire):
    """MinT's ForwardBackwardReverseKLRequest."""

    model_id: str
    reference_model_path: str
    data: list[_ReverseKLDatum]
    temperature: float = 1.0
    seq_id: int | None = None
    type: Literal["mint_forward_backward_reverse_kl"] = "mint_forward_backward_reverse_kl"


class InterpolateRequest(_Wire):
    """MinT's InterpolateCheckpointsRequest."""

    source_paths: list[str]
    coefficients: list[float]
    output_path: str | None = None
    output_checkpoint_type: Literal["sampler"] = "sampler"
    type: Literal["mint_interpolate_checkpoints"] = "mint_interpolate_checkpoints"


def _flat(t: _Tensor) -> list:
    return t.data if isinstance(t.data, list) else [t.data]


async def reverse_kl(request: Request) -> Response:
    from dsv4flash.service.compute.distill import ReverseKLDatum, forward_backward_reverse_kl

    tenant = tenant_of(request)
    req = await parse(request, ReverseKLRequest)
    plane = request.app.state.plane
    tc = plane.model(tenant, req.model_id)
    plane.require_readable(tenant, req.reference_model_path)
    data = [ReverseKLDatum(wire.json_tokens(d.student_input, f"data.{i}.student_input"),
                           wire.json_tokens(d.reference_input, f"data.{i}.reference_input"),
                           [int(x) for x in _flat(d.target_tokens)], [float(x) for x in _flat(d.weights)])
            for i, d in enumerate(req.data)]
    try:
        start = forward_backward_reverse_kl(tc, data, req.reference_model_path, req.temperature)
    except ValueError as exc:
        raise BadRequest(f"data: {exc}") from exc

    def encode(out, proto):
        return {"type": "mint_forward_backward_reverse_kl", "metrics": out.metrics,
                "outputs": [{"loss": {"data": t.data, "shape": t.shape, "dtype": t.dtype}} for t in out.losses]}

    rid = plane.submit(tenant, "reverse_kl", lambda: start, encode)
    return future_response(rid, model_id=req.model_id)


async def interpolate(request: Request) -> Response:
    from dsv4flash.service.compute.interpolate import interpolate_checkpoints

    tenant = tenant_of(request)
    req = await parse(request, InterpolateRequest)
    plane = request.app.state.plane
    for p in req.source_paths:
        plane.require_readable(tenant, p)
    if req.output_path is not None and has_checkpoint_scheme(req.output_path):
        parsed = plane.require_own(tenant, req.output_path)
        if parsed.checkpoint_type != "sampler":
            raise BadRequest("output_path: must be a sampler_weights path (output_checkpoint_type is 'sampler')")
        run, name = parsed.training_run_id, parsed.checkpoint_id
    else:
        own = [plane.parse_path(p).training_run_id for p in req.source_paths
               if plane.owners.owner(plane.parse_path(p).training_run_id) == tenant]
        if not own:
            raise BadRequest("output_path: none of the sources is yours; give a tinker:// sampler path of your run")
        run, name = own[0], req.output_path or f"interpolated-{secrets.token_hex(4)}"

    def encode(path, proto):
        return {"type": "mint_interpolate_checkpoints", "path": path, "checkpoint_type": "sampler",
                "source_paths": req.source_paths, "coefficients": req.coefficients, "has_rank_shards": False}

    rid = plane.submit(tenant, "interpolate", lambda: plane.in_pool(
        interpolate_checkpoints, plane.service, req.source_paths, req.coefficients, run, name), encode)
    return future_response(rid)


ROUTES = [
    Route("/api/v1/mint/forward_backward_reverse_kl", guarded(reverse_kl), methods=["POST"]),
    Route("/api/v1/mint/checkpoints/interpolate", guarded(interpolate), methods=["POST"]),
]
