"""The REST surface of training runs and checkpoints (the SDK's `RestClient`), tenant-scoped.

A tenant lists and manages only its own runs; another tenant's run or checkpoint answers 404 as if absent,
except that a published checkpoint is readable (weights_info, archive URL) by every tenant.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsv4flash.lifecycle.refs import run_id_of
from dsv4flash.service.plane.policy_server import BadRequest, NotFound
from dsv4flash.service.protocol import convert
from dsv4flash.service.protocol.http import guarded, model_json, parse, read_body, tenant_of, tinker_types


async def _wait(api_future):
    """Await a core APIFuture without blocking the event loop; core lookup errors become 404."""
    from dsv4flash.lifecycle.errors import PolicyNotFoundError, RevisionNotFoundError

    try:
        return await asyncio.wrap_future(api_future.future)
    except (FileNotFoundError, PolicyNotFoundError, RevisionNotFoundError) as exc:
        raise NotFound(str(exc)) from exc


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    out = []
    for name, default in (("limit", default_limit), ("offset", 0)):
        raw = request.query_params.get(name, str(default))
        if not raw.isdigit():
            raise BadRequest(f"{name}: expected a non-negative integer, got {raw!r}")
        out.append(int(raw))
    return out[0], out[1]


def _served(run, tenant: str, plane):
    """A core TrainingRun as this server reports it: the tenant owns it, the resident base under its served name."""
    base = plane.served_base_name if run.base_model == plane.service.base.base_model else run.base_model
    return run.model_copy(update={"model_owner": tenant, "base_model": base})


def checkpoint_of(request: Request, tenant: str, *, readable: bool = False):
    """The tenant's own (or, `readable`, a readable) checkpoint a `…/checkpoints/{kind}/{name}` route names."""
    plane = request.app.state.plane
    p = request.path_params
    run = plane.run_of(tenant, p["run_id"]) if not readable else run_id_of(p["run_id"])
    path = f"tinker://{run}/{p['kind']}/{p['name']}"
    return (plane.require_readable if readable else plane.require_own)(tenant, path)


async def list_runs(request: Request) -> Response:
    tenant = tenant_of(request)
    limit, offset = _page(request, 20)
    plane = request.app.state.plane
    resp = await asyncio.to_thread(plane.list_runs, tenant, limit, offset)
    return model_json(resp.model_copy(update={"training_runs": [_served(r, tenant, plane)
                                                                for r in resp.training_runs]}))


async def get_run(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = request.app.state.plane
    run = plane.run_of(tenant, request.path_params["run_id"])
    return model_json(_served(await _wait(plane.rest.get_training_run(run)), tenant, plane))


async def list_run_checkpoints(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = request.app.state.plane
    run = plane.run_of(tenant, request.path_params["run_id"])
    return model_json(await _wait(plane.rest.list_checkpoints(run)))


async def list_user_checkpoints(request: Request) -> Response:
    tenant = tenant_of(request)
    limit, offset = _page(request, 100)
    plane = request.app.state.plane
    return model_json(await asyncio.to_thread(plane.list_user_checkpoints, tenant, limit, offset))


async def delete_checkpoint(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = checkpoint_of(request, tenant)
    await _wait(request.app.state.plane.rest.delete_checkpoint_from_tinker_path(parsed.tinker_path))
    return JSONResponse({})


async def publish(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = checkpoint_of(request, tenant)
    rest = request.app.state.plane.rest
    flag = rest.publish_checkpoint_from_tinker_path if request.method == "POST" else \
        rest.unpublish_checkpoint_from_tinker_path
    await _wait(flag(parsed.tinker_path))
    return JSONResponse({})


async def set_ttl(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = checkpoint_of(request, tenant)
    import json

    raw = await read_body(request)
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequest(f"ttl_seconds: body must be {{\"ttl_seconds\": int | null}} ({exc})") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"ttl_seconds: body must be {{\"ttl_seconds\": int | null}}, got {type(body).__name__}")
    ttl = convert.ttl_seconds(body)
    await _wait(request.app.state.plane.rest.set_checkpoint_ttl_from_tinker_path(parsed.tinker_path, ttl))
    return JSONResponse({})


async def weights_info(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = request.app.state.plane
    body = await parse(request, _WeightsInfoRequest())
    parsed = plane.require_readable(tenant, body.tinker_path)
    _, _, placement = await asyncio.to_thread(plane.service._read_checkpoint, parsed.tinker_path, False)
    return model_json(tinker_types().WeightsInfoResponse(base_model=plane.served_base_name, is_lora=True,
                                                   lora_rank=int(placement.rank),
                                                   train_unembed=bool(placement.train_head)))


def _WeightsInfoRequest():
    from pydantic import BaseModel, ConfigDict

    class WeightsInfoRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")
        tinker_path: str

    return WeightsInfoRequest


_CKPT = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"

ROUTES = [
    Route("/api/v1/training_runs", guarded(list_runs), methods=["GET"]),
    Route("/api/v1/training_runs/{run_id}", guarded(get_run), methods=["GET"]),
    Route("/api/v1/training_runs/{run_id}/checkpoints", guarded(list_run_checkpoints), methods=["GET"]),
    Route("/api/v1/checkpoints", guarded(list_user_checkpoints), methods=["GET"]),
    Route(_CKPT, guarded(delete_checkpoint), methods=["DELETE"]),
    Route(_CKPT + "/publish", guarded(publish), methods=["POST", "DELETE"]),
    Route(_CKPT + "/ttl", guarded(set_ttl), methods=["PUT"]),
    Route("/api/v1/weights_info", guarded(weights_info), methods=["POST"]),
]
