"""The REST surface of training runs and checkpoints (the SDK's `RestClient`), tenant-scoped.

A tenant lists and manages only its own runs; another tenant's run or checkpoint answers 404 as if absent,
except that a published checkpoint is readable (weights_info, archive URL) by every tenant.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

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


def _path_of(request: Request, tenant: str, *, readable: bool = False):
    plane = request.app.state.plane
    p = request.path_params
    run = plane.run_of(tenant, p["run_id"]) if not readable else p["run_id"].replace(":", "-")
    path = f"tinker://{run}/{p['kind']}/{p['name']}"
    return (plane.require_readable if readable else plane.require_own)(tenant, path)


async def list_runs(request: Request) -> Response:
    tenant = tenant_of(request)
    limit, offset = _page(request, 20)
    plane = request.app.state.plane
    resp = await asyncio.to_thread(plane.list_runs, tenant, limit, offset)
    return model_json(tinker_types().TrainingRunsResponse(training_runs=[convert.training_run(r, tenant)
                                                                   for r in resp.training_runs],
                                                    cursor=convert.cursor(resp.cursor)))


async def get_run(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = request.app.state.plane
    run = plane.run_of(tenant, request.path_params["run_id"])
    return model_json(convert.training_run(await _wait(plane.rest.get_training_run(run)), tenant))


async def list_run_checkpoints(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = request.app.state.plane
    run = plane.run_of(tenant, request.path_params["run_id"])
    resp = await _wait(plane.rest.list_checkpoints(run))
    return model_json(tinker_types().CheckpointsListResponse(
        checkpoints=[convert.checkpoint(c) for c in resp.checkpoints], cursor=convert.cursor(resp.cursor)))


async def list_user_checkpoints(request: Request) -> Response:
    tenant = tenant_of(request)
    limit, offset = _page(request, 100)
    plane = request.app.state.plane
    resp = await asyncio.to_thread(plane.list_user_checkpoints, tenant, limit, offset)
    return model_json(tinker_types().CheckpointsListResponse(
        checkpoints=[convert.checkpoint(c) for c in resp.checkpoints], cursor=convert.cursor(resp.cursor)))


async def delete_checkpoint(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = _path_of(request, tenant)
    await _wait(request.app.state.plane.rest.delete_checkpoint_from_tinker_path(parsed.tinker_path))
    return JSONResponse({})


async def publish(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = _path_of(request, tenant)
    rest = request.app.state.plane.rest
    flag = rest.publish_checkpoint_from_tinker_path if request.method == "POST" else \
        rest.unpublish_checkpoint_from_tinker_path
    await _wait(flag(parsed.tinker_path))
    return JSONResponse({})


async def set_ttl(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = _path_of(request, tenant)
    import json

    raw = await read_body(request)
    try:
        ttl = json.loads(raw or b"{}").get("ttl_seconds")
    except (ValueError, AttributeError) as exc:
        raise BadRequest(f"ttl_seconds: body must be {{\"ttl_seconds\": int | null}} ({exc})") from exc
    if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
        raise BadRequest(f"ttl_seconds: expected a positive integer or null, got {ttl!r}")
    await _wait(request.app.state.plane.rest.set_checkpoint_ttl_from_tinker_path(parsed.tinker_path, ttl))
    return JSONResponse({})


async def external_weights_urls(request: Request) -> Response:
    tenant = tenant_of(request)
    parsed = _path_of(request, tenant, readable=True)
    resp = await _wait(request.app.state.plane.rest.get_checkpoint_archive_url_from_tinker_path(parsed.tinker_path))
    from datetime import datetime, timedelta, timezone

    expires = resp.expires or datetime.now(timezone.utc) + timedelta(days=3650)
    return model_json(tinker_types().ExternalWeightsUrlsResponse(urls={"peft": resp.url}, expires=expires))


async def weights_info(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = request.app.state.plane
    body = await parse(request, _WeightsInfoRequest())
    parsed = plane.require_readable(tenant, body.tinker_path)
    _, _, placement = await asyncio.to_thread(plane.service._read_checkpoint, parsed.tinker_path, False)
    return model_json(tinker_types().WeightsInfoResponse(base_model=plane.service.base.base_model, is_lora=True,
                                                   lora_rank=int(placement.rank)))


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
    Route(_CKPT + "/external_weights_urls", guarded(external_weights_urls), methods=["GET"]),
    Route("/api/v1/weights_info", guarded(weights_info), methods=["POST"]),
]
