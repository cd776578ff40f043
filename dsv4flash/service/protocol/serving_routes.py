"""Serving routes: `GET /metrics` (Prometheus text) and `POST /v1/adapters/prewarm` (load named adapters now).

Prewarm takes `{"names": [...]}`: checkpoint paths (`tinker://<run>/sampler_weights/<name>`, the caller's own or
published ones), or catalog names of policies trained into the store (`<policy>:<tag>`, `<policy>@<revision>`,
`<policy>` for its head). Each is loaded into a device slot (through the CPU tier) and left resident but
evictable; the answer gives each name's revision, the tier it came from and the load's milliseconds.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from dsv4flash.service.plane.policy_server import BadRequest, NotFound
from dsv4flash.service.protocol.http import guarded, plane_of, read_body, tenant_of

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _serving(request: Request):
    serving = plane_of(request).service.serving
    if serving is None:
        raise NotFound("this server runs without the serving path (no tiers, no batcher)")
    return serving


async def metrics(request: Request) -> Response:
    tenant_of(request)
    text = _serving(request).metrics()
    service = plane_of(request).service
    if service.trainer_group is not None:  # the Megatron trainer group's swaps, commits and memory
        text += await asyncio.to_thread(service.trainer_group.prometheus)
    if service.replicas is not None:  # the sampler replicas' adapters
        text += await asyncio.to_thread(service.replicas.prometheus)
    return PlainTextResponse(text, media_type=PROMETHEUS_TEXT)


def resolve_name(plane, tenant: str, name: str) -> str:
    """The revision id a served name stands for, if `tenant` may read it (NotFound otherwise)."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"names: expected adapter names (strings), got {name!r}")
    if "://" in name:
        plane.require_readable(tenant, name)
        return plane.service.require_checkpoint(name).id
    policy = name.split("@", 1)[0].split(":", 1)[0]
    service = plane.service
    if not (service.is_trained_policy(policy) or plane.owners.owner(policy) == tenant):
        raise NotFound(f"adapter {name!r} not found")
    try:  # `<policy>@<revision>`: a revision id (or prefix) of that policy; else `<policy>[:<tag>]`
        rec = service.store.resolve(name.split("@", 1)[1] if "@" in name else name)
    except Exception as exc:  # noqa: BLE001 - an unknown tag or revision: not found, naming it
        raise NotFound(f"adapter {name!r} not found ({exc})") from exc
    if rec.policy != policy:
        raise NotFound(f"adapter {name!r} not found")
    return rec.id


async def prewarm(request: Request) -> Response:
    import json

    tenant = tenant_of(request)
    serving = _serving(request)
    try:
        body = json.loads(await read_body(request) or b"{}")
    except ValueError as exc:
        raise BadRequest(f"body: not JSON ({exc})") from exc
    names = body.get("names") if isinstance(body, dict) else None
    if not isinstance(names, list) or not names:
        raise BadRequest("names: expected a non-empty list of adapter names")
    plane = plane_of(request)
    revisions = [await asyncio.to_thread(resolve_name, plane, tenant, n) for n in names]
    loaded = await asyncio.to_thread(serving.prewarm, revisions)
    return JSONResponse({"adapters": [{"name": n, **row} for n, row in zip(names, loaded)]})


ROUTES = [
    Route("/metrics", guarded(metrics), methods=["GET"]),
    Route("/v1/adapters/prewarm", guarded(prewarm), methods=["POST"]),
]
